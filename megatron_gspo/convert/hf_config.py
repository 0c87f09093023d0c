"""Reading a Hugging Face Qwen3 / Qwen3-MoE config.json into `Qwen3Shape`, refusing what it cannot hold.

Both spellings transformers has used are accepted: v4 (`num_experts`, top-level `rope_theta`) and
v5 (`num_local_experts`, `rope_parameters.rope_theta`). Anything the Megatron model built by
`megatron_gspo.model.gpt` would compute differently is refused with a ValueError naming the field and
the file, before a converter writes anything.
"""
from __future__ import annotations

import json
from pathlib import Path

from megatron_gspo.model.gpt import Qwen3Shape
from megatron_gspo.model.presets import PRESETS

ARCHITECTURES = {"Qwen3ForCausalLM": False, "Qwen3MoeForCausalLM": True}  # name -> is MoE


def config_path(hf_dir_or_file: str | Path) -> Path:
    path = Path(hf_dir_or_file)
    return path / "config.json" if path.is_dir() else path


def shape_of(preset: str | None, hf_path: str | None) -> Qwen3Shape:
    """The model's shape: the named preset (model.presets) if given, else the HF config.json's."""
    return PRESETS[preset] if preset is not None else read_hf_config(hf_path)


def read_hf_config(hf_dir_or_file: str | Path) -> Qwen3Shape:
    """The `Qwen3Shape` of the checkpoint whose config.json is at (or in) `hf_dir_or_file`."""
    path = config_path(hf_dir_or_file)
    if not path.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {path}")
    with open(path) as f:
        return shape_from_hf_dict(json.load(f), source=str(path))


def shape_from_hf_dict(cfg: dict, *, source: str = "config.json") -> Qwen3Shape:
    """`Qwen3Shape` from a parsed config.json; `source` names the file in error messages."""

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"{source}: `{field}` = {cfg.get(field)!r}: {why}")

    def need(field: str):
        if field not in cfg or cfg[field] is None:
            raise ValueError(f"{source}: required field `{field}` is missing")
        return cfg[field]

    architectures = cfg.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise refuse("architectures", f"expected one of {sorted(ARCHITECTURES)}")
    is_moe = ARCHITECTURES[architectures[0]]

    # Checks that hold for dense and MoE models alike.
    if cfg.get("attention_bias", False):
        raise refuse("attention_bias", "the Megatron model has no q/k/v/o biases")
    if cfg.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "the Megatron model uses SwiGLU (silu)")
    if cfg.get("use_sliding_window", False):
        raise refuse("use_sliding_window", "sliding-window attention is not supported")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise refuse("layer_types", "only full attention is supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        field = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
        raise refuse(field, f"rope_type {rope_type!r}: only the default RoPE is supported")
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if rope_theta is None:
        raise ValueError(f"{source}: neither `rope_theta` nor `rope_parameters.rope_theta` is set")
    if float(rope_theta) != int(rope_theta):
        # GPTModel takes an integer rotary_base (model/gpt.py build_model).
        raise refuse("rope_theta", "must be an integer for Megatron's rotary_base")

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    fields = dict(
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        num_layers=need("num_hidden_layers"),
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        ffn_hidden_size=need("intermediate_size"),
        rotary_base=float(rope_theta),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 40960),
    )
    if fields["num_attention_heads"] % fields["num_query_groups"]:
        raise refuse("num_key_value_heads", f"must divide num_attention_heads = {heads}")

    if is_moe:
        if cfg.get("mlp_only_layers"):
            raise refuse("mlp_only_layers", "every layer must be MoE (no dense layers in between)")
        if cfg.get("decoder_sparse_step", 1) != 1:
            raise refuse("decoder_sparse_step", "every layer must be MoE (step 1)")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not experts:
            raise ValueError(f"{source}: neither `num_experts` nor `num_local_experts` is set")
        fields.update(num_experts=experts, moe_ffn_hidden_size=need("moe_intermediate_size"),
                      moe_router_topk=need("num_experts_per_tok"),
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return Qwen3Shape(**fields)
