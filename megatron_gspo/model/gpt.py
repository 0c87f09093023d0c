"""Building Megatron-Core's GPTModel for Qwen3 (dense) and Qwen3-MoE.

The architecture is described once (`Qwen3Shape`); `transformer_config` maps it onto Megatron's
TransformerConfig for a parallel layout, and `build_model` returns the model chunks for this rank
(one per virtual pipeline stage), with the local layer spec on CPU and Transformer Engine on GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel.utils import (is_pp_first_stage, is_pp_last_stage, is_vp_first_stage,
                                                   is_vp_last_stage)
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_gspo.config import ParallelConfig
from megatron_gspo.model.packed_rows import rotary_at_positions
from megatron_gspo.model.spec import local_layer_spec


@dataclass(frozen=True)
class Qwen3Shape:
    """The hyper-parameters of a Qwen3 / Qwen3-MoE decoder (Hugging Face config.json names in docs)."""

    vocab_size: int
    """True vocabulary size (`vocab_size`); Megatron pads it, the loss masks the padding."""
    hidden_size: int
    """`hidden_size`."""
    num_layers: int
    """`num_hidden_layers`."""
    num_attention_heads: int
    """`num_attention_heads`."""
    num_query_groups: int
    """`num_key_value_heads` (GQA)."""
    head_dim: int
    """`head_dim` (Qwen3-MoE: 128, not hidden_size / heads)."""
    ffn_hidden_size: int
    """`intermediate_size`: the dense MLP width."""
    num_experts: int | None = None
    """`num_experts` (None: dense Qwen3)."""
    moe_ffn_hidden_size: int | None = None
    """`moe_intermediate_size`: one expert's MLP width."""
    moe_router_topk: int = 8
    """`num_experts_per_tok`."""
    norm_topk_prob: bool = True
    """`norm_topk_prob`: renormalise the top-k probabilities (Megatron: softmax after top-k)."""
    rotary_base: float = 1_000_000.0
    """`rope_theta`."""
    norm_eps: float = 1e-6
    """`rms_norm_eps`."""
    tie_word_embeddings: bool = False
    """`tie_word_embeddings`: output layer shares the embedding weight."""
    max_position_embeddings: int = 40960
    """`max_position_embeddings`."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None


# A Qwen3-MoE-like model small enough for CPU tests: 4 experts top-2, GQA, qk-norm, head_dim != h/heads.
TINY_MOE = Qwen3Shape(vocab_size=500, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, head_dim=24, ffn_hidden_size=128, num_experts=4,
                      moe_ffn_hidden_size=48, moe_router_topk=2, rotary_base=10000.0,
                      max_position_embeddings=512)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron-LM's padding: the vocab rounded up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def transformer_config(shape: Qwen3Shape, layout: ParallelConfig, *, params_dtype=torch.float32,
                       aux_loss_coeff: float = 1e-3, aux_loss_type: str = "seq_aux_loss",
                       **overrides):
    """Megatron TransformerConfig for `shape` under `layout`; `overrides` win over derived values."""
    moe = {}
    if shape.is_moe:
        moe = dict(
            num_moe_experts=shape.num_experts,
            moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
            moe_router_topk=shape.moe_router_topk,
            # Qwen3-MoE: softmax over all experts, then top-k renormalised (norm_topk_prob) equals
            # Megatron's top-k-then-softmax; without renormalisation softmax comes first.
            moe_router_pre_softmax=not shape.norm_topk_prob,
            moe_router_load_balancing_type=aux_loss_type,
            moe_aux_loss_coeff=aux_loss_coeff,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=torch.cuda.is_available(),
            moe_router_dtype="fp32",
        )
    fields = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        pipeline_dtype=params_dtype,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        # Megatron requires sequence parallelism for MoE with TP > 1 (moe_layer.py:379).
        sequence_parallel=layout.tp > 1 and shape.is_moe,
        calculate_per_token_loss=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        **moe,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def check_layout(shape: Qwen3Shape, layout: ParallelConfig) -> None:
    """ValueError, naming the parallel.* keys and the model's numbers (config.json names), when Megatron-Core
    0.16 cannot split `shape` under `layout`: the rules it asserts only once the model is built.

    - tp divides num_attention_heads (transformer_config.py:924), num_key_value_heads (with Transformer
      Engine tp may also be a multiple of it, KV heads then replicated: transformer_config.py:939,
      attention.py:289; the CPU attention splits them: parallel/cp_attention.py:112) and the dense
      intermediate_size (tensor_parallel/layers.py:842, 1166). The vocabulary is padded to a multiple of
      128 * tp (padded_vocab_size): no rule.
    - ep > 1 needs an MoE model (transformer_config.py:1049) and divides num_experts (moe/moe_layer.py:101);
      the expert tp (etp) divides moe_intermediate_size (moe/experts.py).
    - pp divides num_hidden_layers (transformer_block.py:156); with vpp, vpp divides the layers per stage
      (transformer_block.py:175).
    - cp: no rule on the shape (rows are padded to a multiple of 2 * cp * tp: training/packing.py).
    """
    problems = []

    def need(ok: bool, problem: str) -> None:
        if not ok:
            problems.append(problem)

    tp, heads, groups = layout.tp, shape.num_attention_heads, shape.num_query_groups
    need(heads % tp == 0, f"parallel.tp={tp} must divide num_attention_heads={heads}")
    if torch.cuda.is_available():  # Transformer Engine attention (layer_spec)
        need(groups % tp == 0 or tp % groups == 0,
             f"parallel.tp={tp} must divide num_key_value_heads={groups} or be a multiple of it")
    else:
        need(groups % tp == 0, f"parallel.tp={tp} must divide num_key_value_heads={groups} (on CPU)")
    if shape.is_moe:
        need(shape.num_experts % layout.ep == 0, f"parallel.ep={layout.ep} must divide num_experts={shape.num_experts}")
        need(shape.moe_ffn_hidden_size % layout.expert_tp == 0,
             f"the expert tensor parallel size {layout.expert_tp} (parallel.etp={layout.etp}, parallel.tp={tp}) "
             f"must divide moe_intermediate_size={shape.moe_ffn_hidden_size}")
    else:
        need(shape.ffn_hidden_size % tp == 0, f"parallel.tp={tp} must divide intermediate_size={shape.ffn_hidden_size}")
        need(layout.ep == 1, f"parallel.ep={layout.ep} needs an MoE model (this one is dense): set parallel.ep=1")
    layers, pp = shape.num_layers, layout.pp
    need(layers % pp == 0, f"parallel.pp={pp} must divide num_hidden_layers={layers}")
    if layout.vpp is not None and layers % pp == 0:
        need((layers // pp) % layout.vpp == 0, f"parallel.vpp={layout.vpp} must divide the {layers // pp} layers "
                                               f"of each of the pp={pp} stages (num_hidden_layers={layers})")
    if problems:
        raise ValueError("; ".join(problems))


class PolicyGPTModel(GPTModel):
    """Megatron's GPTModel, whose forward with `labels` returns this rank's logits in Megatron's own
    [s, b, V] layout instead of a cross-entropy loss: `model(tokens, positions, None, labels=labels_BS)`.

    Without labels GPTModel returns `logits.transpose(0, 1).contiguous()` ([b, s, V]): a logits-sized
    copy in the forward and another in the backward (measured by benchmarks/train_overhead.py: ~1.4 s
    of a 1.5 s gap to Megatron's own training step at V=16384 on CPU, and one logits buffer of extra
    peak memory). Megatron's labels path hands the untransposed logits to compute_language_model_loss;
    here that hook returns them, and the trainer's log-probs are computed on [s, b] (the labels
    transposed, a small tensor). Without labels it is GPTModel exactly.
    """

    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        """GPTModel.forward; with an `attention_mask` (packed rows' segment ids, model/packed_rows.py) the
        rotary angles follow `position_ids` (each sequence's own positions) instead of 0..s-1."""
        if attention_mask is None or getattr(self, "rotary_pos_emb", None) is None \
                or self.position_embedding_type != "rope":
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)
        with rotary_at_positions(self.rotary_pos_emb, position_ids):
            return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)

    def compute_language_model_loss(self, labels, logits):
        if self.config.mtp_num_layers:
            raise NotImplementedError("PolicyGPTModel returns the logits in place of the LM loss; multi-token "
                                      "prediction layers would take that loss too (Qwen3 has none)")
        return logits


def layer_spec(shape: Qwen3Shape):
    """Transformer Engine spec on GPUs, the local spec with CP-capable attention on CPU."""
    if torch.cuda.is_available():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=shape.num_experts, moe_grouped_gemm=shape.is_moe, qk_layernorm=True)
    return local_layer_spec(num_experts=shape.num_experts, moe_grouped_gemm=False, qk_layernorm=True)


def build_model(shape: Qwen3Shape, config, *, pgs: ProcessGroupCollection, wrap_ddp: bool = True,
                ddp_overrides: dict | None = None):
    """This rank's model chunks (a list: one per virtual pipeline stage), DDP-wrapped if asked.

    GPTModel (and through it every layer: attention, MLP, MoE router and dispatcher, embeddings)
    and DDP get the process groups `pgs` (`pg_collection=`); the schedules hand the same collection
    to finalize_model_grads (training/step.py run_schedule). What megatron-core 0.16.1 still reads
    from its globals at step time regardless (e.g. RowParallelLinear.forward passes tp_group=None,
    tensor_parallel/layers.py:1281, for a group it then does not use) is listed, with each upstream
    line, in tests/distributed/workers/explicit_groups.py.
    """
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        model = PolicyGPTModel(
            config=config,
            transformer_layer_spec=layer_spec(shape),
            vocab_size=padded_vocab_size(shape.vocab_size, config.tensor_model_parallel_size),
            max_sequence_length=shape.max_position_embeddings,
            pre_process=is_pp_first_stage(pgs.pp) and is_vp_first_stage(vp_stage, vpp),
            post_process=is_pp_last_stage(pgs.pp) and is_vp_last_stage(vp_stage, vpp),
            parallel_output=True,
            share_embeddings_and_output_weights=shape.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(shape.rotary_base),
            vp_stage=vp_stage if vpp else None,
            pg_collection=pgs,
        )
        chunks.append(model)
    if not wrap_ddp:
        return chunks
    ddp_config = DistributedDataParallelConfig(**{
        "grad_reduce_in_fp32": True, "overlap_grad_reduce": False, "use_distributed_optimizer": False,
        **(ddp_overrides or {})})
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                     disable_bucketing=i > 0, pg_collection=pgs)
             for i, chunk in enumerate(chunks)]
    # The schedules call these hooks (as Megatron-LM's training.py sets them): without
    # finalize_model_grads no gradient is all-reduced over DP, nor are sequence-parallel norm grads
    # over TP, nor tied embeddings over PP.
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model


def model_process_groups(model_chunks) -> ProcessGroupCollection:
    """The process groups `build_model` gave these chunks (GPTModel keeps its `pg_collection`)."""
    chunk = model_chunks[0]
    return (chunk.module if isinstance(chunk, DistributedDataParallel) else chunk).pg_collection

