"""Layer specs for building Megatron-Core GPT models without Transformer Engine (CPU)."""
from __future__ import annotations

from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_gspo.parallel.cp_attention import ContextParallelDotProductAttention


def local_layer_spec(
    *, num_experts: Optional[int] = None, moe_grouped_gemm: bool = False, qk_layernorm: bool = True
) -> ModuleSpec:
    """Megatron's local (non-TE) GPT layer spec whose core attention supports context parallelism.

    Norms come from `WrappedTorchNorm`, which follows `config.normalization` (RMSNorm for Qwen3).
    At cp=1 the attention computes what the stock `DotProductAttention` does.
    """
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm
    )
    # A fresh spec per call, so editing it in place touches no one else's.
    spec.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention
    return spec
