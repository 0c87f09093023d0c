"""The Hugging Face <-> Megatron-Core name and layout map for Qwen3 / Qwen3-MoE, as one table.

Megatron side: the keys GPTModel.sharded_state_dict() asks for (megatron-core 0.16, checked by loading
into the model built by `megatron_gspo.model.gpt.build_model`, tests/distributed/test_convert_load.py).
Transformer layers are stacked under one key with a leading layer axis (`decoder.layers.X` holds
[num_layers, ...]); experts add an expert axis ([num_layers, num_experts, ...]). The local spec's
`input_layernorm` / `pre_mlp_layernorm` are saved under the TE spec's fused names
(`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`), and TE's grouped experts save
under SequentialMLP's keys (moe/experts.py, TEGroupedMLP.sharded_state_dict: "interchangeable"),
so one table serves both specs. Only the local spec is verified here (no TE on CPU); TE modules
may also ask for `_extra_state` objects this table does not list (e.g. core attention's).

Each `Entry` maps one Megatron tensor (one layer's or one expert's slice of it) to the Hugging Face
tensors it is made of, with a `Layout` saying how: `COPY` (one to one), `QKV` (q, k, v fused per query
group), `GLU` (gate and up stacked). HF -> Megatron walks the table forward (`fuse`); Megatron -> HF
walks the same entries and inverts the layout (`split`); `hf_index` is the inverse name map derived
from the table.

Shapes (`DIMS` symbols in the table): V vocab, H hidden, D head dim, QD all query heads x D, KD all
KV heads x D, E experts, F dense MLP width, M expert MLP width; in `fuse`/`split`: G query groups,
Q query heads per group.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator

import torch

from megatron_gspo.model.gpt import Qwen3Shape


class Layout(enum.Enum):
    COPY = "copy"
    QKV = "qkv"
    """[G*(Q+2)*D, H] = per group g: its Q query heads, then k_g, then v_g (Megatron's fused QKV)."""
    GLU = "glu"
    """[2F, H] = cat(gate [F, H], up [F, H]) (Megatron's gated linear_fc1)."""


class Scope(enum.Enum):
    MODEL = "model"
    """One tensor for the model."""
    LAYER = "layer"
    """One slice per transformer layer: Megatron index (layer,)."""
    EXPERT = "expert"
    """One slice per (layer, expert): Megatron index (layer, expert)."""


@dataclass(frozen=True)
class Entry:
    mcore: str
    """Megatron sharded key (stacked over layers / experts for LAYER / EXPERT scope)."""
    hf: tuple[str, ...]
    """Hugging Face name templates ({layer}, {expert}), in the order `Layout` fuses them."""
    dims: tuple[str, ...]
    """Each HF tensor's shape in the symbols of `DIMS` (e.g. "QD H")."""
    scope: Scope
    layout: Layout = Layout.COPY
    extra_state: bool = False
    """The Megatron module is a linear layer with an `_extra_state` object next to its weight."""

    @property
    def extra_state_key(self) -> str:
        return self.mcore.removesuffix(".weight") + "._extra_state"


# The symbols of Entry.dims.
DIMS = {
    "V": lambda s: s.vocab_size,
    "H": lambda s: s.hidden_size,
    "D": lambda s: s.head_dim,
    "QD": lambda s: s.num_attention_heads * s.head_dim,
    "KD": lambda s: s.num_query_groups * s.head_dim,
    "E": lambda s: s.num_experts,
    "F": lambda s: s.ffn_hidden_size,
    "M": lambda s: s.moe_ffn_hidden_size,
}

_LAYER = "model.layers.{layer}."
_EXPERT = _LAYER + "mlp.experts.{expert}."
_LAYERS = "decoder.layers."

MODEL_ENTRIES = (
    Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), ("V H",), Scope.MODEL),
    Entry("decoder.final_layernorm.weight", ("model.norm.weight",), ("H",), Scope.MODEL),
)
OUTPUT_ENTRY = Entry("output_layer.weight", ("lm_head.weight",), ("V H",), Scope.MODEL)  # untied models only

ATTENTION_ENTRIES = (
    Entry(_LAYERS + "self_attention.linear_qkv.layer_norm_weight", (_LAYER + "input_layernorm.weight",),
          ("H",), Scope.LAYER),
    Entry(_LAYERS + "self_attention.linear_qkv.weight", tuple(_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
          ("QD H", "KD H", "KD H"), Scope.LAYER, Layout.QKV, extra_state=True),
    Entry(_LAYERS + "self_attention.q_layernorm.weight", (_LAYER + "self_attn.q_norm.weight",), ("D",), Scope.LAYER),
    Entry(_LAYERS + "self_attention.k_layernorm.weight", (_LAYER + "self_attn.k_norm.weight",), ("D",), Scope.LAYER),
    Entry(_LAYERS + "self_attention.linear_proj.weight", (_LAYER + "self_attn.o_proj.weight",), ("H QD",),
          Scope.LAYER, extra_state=True),
    Entry(_LAYERS + "mlp.linear_fc1.layer_norm_weight", (_LAYER + "post_attention_layernorm.weight",),
          ("H",), Scope.LAYER),
)
DENSE_MLP_ENTRIES = (
    Entry(_LAYERS + "mlp.linear_fc1.weight", (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight"),
          ("F H", "F H"), Scope.LAYER, Layout.GLU, extra_state=True),
    Entry(_LAYERS + "mlp.linear_fc2.weight", (_LAYER + "mlp.down_proj.weight",), ("H F",), Scope.LAYER,
          extra_state=True),
)
MOE_ENTRIES = (
    Entry(_LAYERS + "mlp.router.weight", (_LAYER + "mlp.gate.weight",), ("E H",), Scope.LAYER),
    Entry(_LAYERS + "mlp.experts.experts.linear_fc1.weight", (_EXPERT + "gate_proj.weight", _EXPERT + "up_proj.weight"),
          ("M H", "M H"), Scope.EXPERT, Layout.GLU, extra_state=True),
    Entry(_LAYERS + "mlp.experts.experts.linear_fc2.weight", (_EXPERT + "down_proj.weight",), ("H M",), Scope.EXPERT,
          extra_state=True),
)


def entries(shape: Qwen3Shape) -> tuple[Entry, ...]:
    """The table for `shape`: which entries exist depends on MoE vs dense and tied embeddings."""
    output = () if shape.tie_word_embeddings else (OUTPUT_ENTRY,)
    mlp = MOE_ENTRIES if shape.is_moe else DENSE_MLP_ENTRIES
    return MODEL_ENTRIES + output + ATTENTION_ENTRIES + mlp


@dataclass(frozen=True)
class Item:
    """One unit of conversion: an entry at one index (a layer, or a layer and an expert)."""

    entry: Entry
    index: tuple[int, ...]
    """() for MODEL scope, (layer,) for LAYER, (layer, expert) for EXPERT."""

    @property
    def hf_names(self) -> tuple[str, ...]:
        names = dict(zip(("layer", "expert"), self.index))
        return tuple(t.format(**names) for t in self.entry.hf)


def items(shape: Qwen3Shape, layers: range | None = None) -> Iterator[Item]:
    """Every conversion item, model-scope ones first, then layer by layer (experts within a layer)."""
    table = entries(shape)
    for entry in table:
        if entry.scope is Scope.MODEL:
            yield Item(entry, ())
    for layer in layers if layers is not None else range(shape.num_layers):
        for entry in table:
            if entry.scope is Scope.LAYER:
                yield Item(entry, (layer,))
            elif entry.scope is Scope.EXPERT:
                for expert in range(shape.num_experts):
                    yield Item(entry, (layer, expert))


def hf_index(shape: Qwen3Shape) -> dict[str, tuple[Item, int]]:
    """HF name -> (item, position in the item's fused tensor): the inverse of the table."""
    return {name: (item, i) for item in items(shape) for i, name in enumerate(item.hf_names)}


def stacked_shape(shape: Qwen3Shape, entry: Entry, unstacked: tuple[int, ...]) -> tuple[int, ...]:
    """The global Megatron shape of `entry`, whose per-item slice has shape `unstacked`."""
    lead = {Scope.MODEL: (), Scope.LAYER: (shape.num_layers,),
            Scope.EXPERT: (shape.num_layers, shape.num_experts)}[entry.scope]
    return lead + tuple(unstacked)


def hf_shapes(shape: Qwen3Shape, item: Item) -> tuple[tuple[int, ...], ...]:
    """Expected Hugging Face shape of each of `item`'s tensors."""
    return tuple(tuple(DIMS[d](shape) for d in spec.split()) for spec in item.entry.dims)


def fused_shape(shape: Qwen3Shape, item: Item) -> tuple[int, ...]:
    """The shape of `item`'s Megatron tensor (unstacked): its HF parts, which share their trailing
    dims, one after the other along the first (every layout fuses along it)."""
    parts = hf_shapes(shape, item)
    return (sum(p[0] for p in parts),) + parts[0][1:]


def fuse(shape: Qwen3Shape, layout: Layout, parts: list[torch.Tensor]) -> torch.Tensor:
    """The Megatron tensor made of the HF `parts` (a new tensor, or the one part for COPY)."""
    if layout is Layout.COPY:
        (tensor,) = parts
        return tensor
    if layout is Layout.GLU:
        return torch.cat(parts, dim=0)
    q, k, v = parts
    G, D, H = shape.num_query_groups, shape.head_dim, q.shape[-1]
    return torch.cat([q.view(G, -1, H), k.view(G, D, H), v.view(G, D, H)], dim=1).view(-1, H)


def split(shape: Qwen3Shape, layout: Layout, fused: torch.Tensor) -> list[torch.Tensor]:
    """The inverse of `fuse`: contiguous HF tensors (new memory, except for COPY)."""
    if layout is Layout.COPY:
        return [fused]
    if layout is Layout.GLU:
        return [half.contiguous() for half in fused.chunk(2, dim=0)]
    G, D, H = shape.num_query_groups, shape.head_dim, fused.shape[-1]
    Q = shape.num_attention_heads // G
    q, k, v = fused.view(G, (Q + 2) * D, H).split([Q * D, D, D], dim=1)
    return [t.reshape(-1, H).contiguous() for t in (q, k, v)]
