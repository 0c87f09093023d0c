"""CPU TEST SCAFFOLDING: an import stand-in for SGLang's `sgl_kernel` (no CPU build is published).

See ../README.md. Put on PYTHONPATH only for a CPU SGLang server process; GPU machines use the
real package. Every function here raises if called, except `assign_req_to_token_pool_cpu`.
"""
from sgl_kernel import allreduce, scalar_type  # noqa: F401  (SGLang imports them as submodules)

__version__ = "0.0.0+cpu-stand-in"


def _not_available(name: str):
    def stand_in(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is a CPU import stand-in (megatron_gspo/platform/sglang_cpu_stubs); SGLang "
            f"called it, so this model/setting needs the real sgl_kernel (a GPU or AMX CPU build)")
    stand_in.__name__ = name
    return stand_in


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the i-th run of out_cache_loc.

    out_cache_loc holds the new KV slots of all requests back to back: request i's run starts
    after the (end - start) lengths of requests 0..i-1. pool_len (the row length) is implied by
    the 2-D req_to_token here; it is kept for the kernel's signature.
    """
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, start:end] = out_cache_loc[offset:offset + end - start].to(req_to_token.dtype)
        offset += end - start


assign_extend_cache_locs_cpu = _not_available("assign_extend_cache_locs_cpu")
assign_draft_cache_locs_contiguous_cpu = _not_available("assign_draft_cache_locs_contiguous_cpu")
build_tree_kernel_efficient_cpu = _not_available("build_tree_kernel_efficient_cpu")
copy_all_layer_kv_cache_cpu = _not_available("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _not_available("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _not_available("fill_bonus_tokens_cpu")
verify_tree_greedy_cpu = _not_available("verify_tree_greedy_cpu")
