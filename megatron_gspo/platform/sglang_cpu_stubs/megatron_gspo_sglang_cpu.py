"""A CPU SGLang server's attention in one batched call per layer instead of one call per request.

SGLang 0.5.23's CPU attention (`--attention-backend torch_native`,
sglang/srt/layers/attention/torch_native_backend.py:_run_sdpa_forward_extend / _decode) loops over the
requests of a batch in Python and runs one `scaled_dot_product_attention` per request and layer ("TODO:
this loop process a sequence per iter, this is inefficient"). With the CPU demo's 256 short responses
that loop was 58% of the scheduler's busy time (py-spy). Here each layer gathers every request's keys and
values from the KV pool at once, pads them to the longest request, and runs ONE masked SDPA:

    decode:  q [B, H, 1, D] against k/v [B, Hkv, L, D], key j visible iff j < seq_len_b
    extend:  q [B, H, E, D] (request b's e_b new tokens at positions prefix_b + i, padded to E = max e_b)
             against the same k/v, key j visible iff j <= prefix_b + i (causal; prefix_b + i < seq_len_b)

Same math as SGLang's loop (tests/unit/test_sglang_cpu_attention.py compares the two, values to 1e-6,
with GQA, prefixes, ragged lengths and NaN in unwritten cache slots). Padded key slots read the request's
first key (written, finite) and are masked; padded query rows attend to key 0 and are dropped. Anything
else (encoder/cross attention, non-causal, sliding windows) goes to SGLang's own loop.

How it reaches the server: a general SGLang plugin (SGLang's `sglang.srt.plugins` entry-point group,
sglang/srt/plugins/__init__.py), declared by the `megatron_gspo_sglang_cpu-*.dist-info` folder beside this
file. rollout/sglang/server.py puts this folder on PYTHONPATH for CPU servers only; every SGLang process
calls `load_plugins()` at start; the plugin prints INSTALLED (below) to the server log. GPU servers
never see it. MEGATRON_GSPO_SGLANG_BATCHED_ATTENTION=0 in the server's environment turns it off
(ServerConfig.batched_attention=False). install() also installs, whatever that switch says, the sibling
module megatron_gspo_sglang_cpu_routing.py (without it --enable-return-routed-experts cannot start on CPU).

The two functions import only torch: the trainer's tests run them without SGLang.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.nn.functional import scaled_dot_product_attention

ENV_SWITCH = "MEGATRON_GSPO_SGLANG_BATCHED_ATTENTION"
INSTALLED = "megatron_gspo_sglang_cpu: batched torch_native attention installed"
TARGET = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"


def _padded_kv(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens):
    """Every request's keys/values [B, Hkv, L, D] (L = longest request), the key positions [L] and the
    valid keys [B, L]. Slots past a request's length read its first key: never an unwritten slot."""
    length = int(seq_lens.max())
    slots_BL = req_to_token[req_pool_indices, :length].long()
    positions_L = torch.arange(length, device=seq_lens.device)
    valid_BL = positions_L[None, :] < seq_lens[:, None]
    slots_BL = torch.where(valid_BL, slots_BL, slots_BL[:, :1])
    return (k_cache[slots_BL].permute(0, 2, 1, 3), v_cache[slots_BL].permute(0, 2, 1, 3), positions_L, valid_BL)


def decode_attention(query_BHD, output_BHD, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, *,
                     scaling=None, enable_gqa=False):
    """One new token per request (query row b belongs to request b); writes and returns output_BHD."""
    k, v, _, valid_BL = _padded_kv(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
    out = scaled_dot_product_attention(query_BHD.unsqueeze(2).to(k.dtype), k, v, attn_mask=valid_BL[:, None, None, :],
                                       scale=scaling, enable_gqa=enable_gqa)
    output_BHD.copy_(out.squeeze(2))
    return output_BHD


def extend_attention(query_THD, output_THD, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                     extend_prefix_lens, extend_seq_lens, *, scaling=None, enable_gqa=False):
    """Causal attention of each request's extend_seq_lens[b] new tokens (packed request after request in
    query_THD) over its prefix and themselves; writes and returns output_THD."""
    k, v, positions_L, _ = _padded_kv(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens)
    steps_E = torch.arange(int(extend_seq_lens.max()), device=seq_lens.device)
    real_BE = steps_E[None, :] < extend_seq_lens[:, None]
    steps_BE = torch.minimum(steps_E[None, :], (extend_seq_lens - 1).clamp(min=0)[:, None])  # padding: last row
    starts_B = torch.cumsum(extend_seq_lens, 0) - extend_seq_lens
    q = query_THD[starts_B[:, None] + steps_BE].permute(0, 2, 1, 3).to(k.dtype)  # [B, H, E, D]
    visible_BEL = positions_L[None, None, :] <= (extend_prefix_lens[:, None] + steps_BE)[:, :, None]
    out = scaled_dot_product_attention(q, k, v, attn_mask=visible_BEL[:, None], scale=scaling, enable_gqa=enable_gqa)
    output_THD.copy_(out.permute(0, 2, 1, 3)[real_BE])
    return output_THD


def _no_window(sliding_window_size) -> bool:
    return sliding_window_size is None or sliding_window_size <= -1


def _decode_hook(original, self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                 encoder_lens=None, scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                 sliding_window_size=None):
    if encoder_lens is None and _no_window(sliding_window_size):
        return decode_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                scaling=scaling, enable_gqa=enable_gqa)
    return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens,
                    scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)


def _extend_hook(original, self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                 extend_prefix_lens, extend_seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                 causal=False, is_cross_attn=False, sliding_window_size=None):
    if encoder_lens is None and causal and _no_window(sliding_window_size):
        return extend_attention(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                                extend_prefix_lens, extend_seq_lens, scaling=scaling, enable_gqa=enable_gqa)
    return original(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn,
                    sliding_window_size)


def install() -> None:
    """SGLang general-plugin entry point: the unpinned routed-experts buffer (megatron_gspo_sglang_cpu_routing.py,
    always: without it --enable-return-routed-experts cannot start on CPU), then, unless switched off, wrap the
    torch_native backend's two per-request loops."""
    import megatron_gspo_sglang_cpu_routing

    megatron_gspo_sglang_cpu_routing.install()
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{TARGET}._run_sdpa_forward_decode", _decode_hook, HookType.AROUND)
    HookRegistry.register(f"{TARGET}._run_sdpa_forward_extend", _extend_hook, HookType.AROUND)
    print(f"{INSTALLED} (pid {os.getpid()})", file=sys.stderr, flush=True)  # the server log shows it
