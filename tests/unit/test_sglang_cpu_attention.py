"""The CPU SGLang plugin's batched attention equals SGLang's per-request loop
(platform/sglang_cpu_stubs/megatron_gspo_sglang_cpu.py; the loop: sglang/srt/layers/attention/
torch_native_backend.py:_run_sdpa_forward_extend / _decode, restated below one request at a time)."""
import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from megatron_gspo.rollout.sglang.server import cpu_plugin

plugin = cpu_plugin()

H, HKV, D, POOL, SLOTS = 4, 2, 8, 200, 6


def kv_pool(seq_lens, seed):
    """A KV pool whose unwritten slots hold NaN, and each request's slots scattered through it."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.full((POOL, HKV, D), float("nan"))
    v_cache = torch.full((POOL, HKV, D), float("nan"))
    req_to_token = torch.zeros(SLOTS, 32, dtype=torch.int32)  # stale zeros past each request's length
    used = torch.randperm(POOL - 1, generator=g)[: int(sum(seq_lens))] + 1
    req_pool_indices = torch.randperm(SLOTS, generator=g)[: len(seq_lens)]
    start = 0
    for slot, n in zip(req_pool_indices.tolist(), seq_lens):
        slots = used[start:start + n]
        req_to_token[slot, :n] = slots.int()
        k_cache[slots] = torch.randn(n, HKV, D, generator=g)
        v_cache[slots] = torch.randn(n, HKV, D, generator=g)
        start += n
    return k_cache, v_cache, req_to_token, req_pool_indices


def reference(query_THD, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, prefix_lens, extend_lens):
    """One SDPA per request, as SGLang's loop: the new tokens sit at the end of a query as long as the
    whole sequence, causal over it."""
    out, start = [], 0
    for b, (seq, prefix, new) in enumerate(zip(seq_lens, prefix_lens, extend_lens)):
        q = torch.zeros(H, seq, D)
        q[:, prefix:] = query_THD[start:start + new].movedim(0, 1)
        slots = req_to_token[req_pool_indices[b], :seq].long()
        k, v = k_cache[slots].movedim(0, 1), v_cache[slots].movedim(0, 1)
        o = scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True, scale=0.3)[0]
        out.append(o[:, prefix:].movedim(0, 1))
        start += new
    return torch.cat(out)


@pytest.mark.parametrize("seq_lens, prefix_lens", [([4, 4, 4], [0, 0, 0]), ([3, 9, 1, 5], [0, 4, 0, 2]),
                                                   ([1], [0]), ([12, 2], [11, 0])])
def test_extend_equals_the_per_request_loop(seq_lens, prefix_lens):
    extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
    k_cache, v_cache, req_to_token, req_pool_indices = kv_pool(seq_lens, seed=len(seq_lens))
    query = torch.randn(sum(extend_lens), H, D, generator=torch.Generator().manual_seed(1))
    output = torch.full_like(query, float("nan"))
    plugin.extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, torch.tensor(seq_lens),
                            torch.tensor(prefix_lens), torch.tensor(extend_lens), scaling=0.3, enable_gqa=True)
    expected = reference(query, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, prefix_lens, extend_lens)
    torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seq_lens", [[5, 5, 5, 5], [1, 7, 3], [9]])
def test_decode_equals_the_per_request_loop(seq_lens):
    k_cache, v_cache, req_to_token, req_pool_indices = kv_pool(seq_lens, seed=7 + len(seq_lens))
    query = torch.randn(len(seq_lens), H, D, generator=torch.Generator().manual_seed(2))
    output = torch.full_like(query, float("nan"))
    plugin.decode_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, torch.tensor(seq_lens),
                            scaling=0.3, enable_gqa=True)
    # decode = an extend of one new token after a prefix of seq_len - 1
    expected = reference(query, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                         [s - 1 for s in seq_lens], [1] * len(seq_lens))
    torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)


def test_the_hooks_leave_other_attention_to_sglang():
    calls = []
    original = lambda *args: calls.append(args) or "sglang"  # noqa: E731
    seq_lens = torch.tensor([2])
    common = (None, torch.zeros(1, H, D), torch.zeros(1, H, D), torch.zeros(4, HKV, D), torch.zeros(4, HKV, D),
              torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0]), seq_lens)
    assert plugin._decode_hook(original, *common, None, 1.0, True, False, False, 16) == "sglang"  # sliding window
    assert plugin._decode_hook(original, *common, torch.tensor([1])) == "sglang"                  # encoder lens
    assert plugin._extend_hook(original, *common, torch.tensor([1]), torch.tensor([1]), None, 1.0, True,
                               False) == "sglang"                                                 # not causal
    assert len(calls) == 3
