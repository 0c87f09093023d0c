"""Megatron-Core's warnings about missing Transformer Engine and apex, said once instead of six times per rank.

megatron-core 0.16.1 warns at import time, from six modules, that TE and apex are absent and which local
fallback it uses (optimizer/__init__.py:24, optimizer/optimizer.py:28, optimizer/clip_grads.py:29,
models/gpt/gpt_layer_specs.py:70, models/backends.py:21, distributed/fsdp/src/megatron_fsdp/mixed_precision.py:114).
On a CPU machine that is expected: `hide_fallback_warnings` filters exactly those messages (every other warning
still shows) and `FALLBACK_NOTE` is the one line the trainer prints instead (rank 0, training/loop.py).
"""
from __future__ import annotations

import importlib.util
import warnings

FALLBACK_MESSAGES = (r"Transformer Engine and Apex are not installed\. Falling back to",
                     r"Apex is not installed\. Falling back to Torch Norm")
"""The warnings' text (regular expressions matched at the start of the message)."""

FALLBACK_NOTE = ("megatron-core: Transformer Engine and apex are not installed: using its local fallbacks "
                 "(torch norms and optimizers, multi-tensor ops in torch)")


def hide_fallback_warnings() -> None:
    """Filter Megatron-Core's TE/apex fallback warnings (call before importing megatron.core)."""
    for message in FALLBACK_MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def fallbacks_in_use() -> bool:
    """Neither Transformer Engine nor apex is importable: Megatron-Core runs its local fallbacks."""
    return importlib.util.find_spec("transformer_engine") is None and importlib.util.find_spec("apex") is None
