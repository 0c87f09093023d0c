"""A CPU SGLang server can record MoE routing (`--enable-return-routed-experts`): its host buffer unpinned.

SGLang 0.5.23 keeps every KV-cache token's routed expert ids in a host buffer that it pins for fast
device-to-host copies: state_capturer/base.py:67-73 allocates it through ALLOC_MEMORY_FUNCS[device] with
pin_memory=True. For "cpu" that is alloc_with_host_register (mem_cache/pool_host/common.py:453-454, the
default of every device but npu/musa/xpu), which pins by calling _cuda_host_register (common.py:348-349)
-> torch.cuda.cudart() (common.py:147): on a CPU build of torch the scheduler dies at start-up with
"Torch not compiled with CUDA enabled". Without CUDA there is no device to copy from and nothing to pin
for, so here the same allocation runs with pin_memory=False. Everything after it is SGLang's own: the
routers' ids are captured per layer (layers/moe/topk.py:2574), copied into this buffer by KV slot
(base.py:220) and read back per request (base.py:188).

Installed by megatron_gspo_sglang_cpu.install() (the CPU servers' SGLang plugin, see that module), which
prints INSTALLED below to the server log.
"""
from __future__ import annotations

import os
import sys

import torch

INSTALLED = "megatron_gspo_sglang_cpu: unpinned routed-experts host buffer installed"
TARGET = "sglang.srt.mem_cache.pool_host.common.alloc_with_host_register"


def _unpinned_without_cuda(original, dims, dtype, device, pin_memory, allocator,
                           registration_granularity_bytes=None):
    if not torch.cuda.is_available():
        pin_memory = False  # pinning needs the CUDA runtime (common.py:147)
    return original(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes)


def install() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _unpinned_without_cuda, HookType.AROUND)
    print(f"{INSTALLED} (pid {os.getpid()})", file=sys.stderr, flush=True)  # the server log shows it
