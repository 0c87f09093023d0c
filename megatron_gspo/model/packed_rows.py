"""What a model forward needs for packed rows (several sequences per row, training/packing.py).

Two things change when a row holds sequences a, b, ...: each position may attend only to earlier
positions of its own sequence, and each sequence's rotary angles must be those of its own positions
0, 1, ... . Both follow from the micro-batch's `segments_BS` and `positions_BS` (microbatch.MicroBatch).

The trainer hands the rows' segment ids to the model as its attention mask; the local spec's core
attention (parallel/cp_attention.py) then attends sequence by sequence (varlen). `packed_attention_mask`
is the equivalent dense mask, the reference the tests hold that path to. Transformer Engine's attention
takes neither (its packed format is THD with cu_seqlens), so packed rows need the local spec.
`rotary_at_positions` gives each position its sequence's own angles (RoPE is relative, so a sequence at
an offset would attend the same in exact arithmetic, but in float32 the angles of large positions lose
precision: the sequence's own positions keep its numbers those of a row of its own, and of the sampler).
"""
from __future__ import annotations

import contextlib

import torch

from megatron_gspo.parallel.context_parallel import cp_chunk_indices


def packed_attention_mask(segments_BS: torch.Tensor, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """[B, 1, sq, S] bool, True where query q may NOT see key k: k after q, or another sequence.

    `segments_BS` is the whole row (all S positions, before any CP split); padding (-1) forms a
    segment of its own, so every query sees at least itself. Under CP the query rows are this rank's
    positions (cp_chunk_indices), in the order the rank holds them.
    """
    B, S = segments_BS.shape
    q_pos = torch.arange(S) if cp_size == 1 else cp_chunk_indices(S, cp_size, cp_rank)
    k_pos = torch.arange(S)
    seg_q = segments_BS[:, q_pos]
    later = k_pos[None, :] > q_pos[:, None]                                   # [sq, S]
    other = seg_q[:, :, None] != segments_BS[:, None, :]                       # [B, sq, S]
    return (other | later[None]).unsqueeze(1)


@contextlib.contextmanager
def rotary_at_positions(rotary, position_ids_BS: torch.Tensor):
    """Within the block, `rotary` (Megatron's RotaryEmbedding) gives each (position, row) the angles of
    `position_ids_BS` ([B, s], this rank's positions: already CP-split) instead of those of 0..s-1:
    [s, B, 1, D], which apply_rotary_pos_emb broadcasts over the heads. The angles are rows of
    RotaryEmbedding's own table, so a row with positions 0..s-1 gets bitwise Megatron's."""
    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        table = rotary.get_emb(int(position_ids_BS.max()) + 1)               # [P, 1, 1, D]
        return table[position_ids_BS.t()].squeeze(2)                          # [s, B, 1, D]

    if "forward" in vars(rotary):
        raise RuntimeError("rotary_at_positions does not nest")
    rotary.forward = forward  # the instance attribute shadows the class's forward for module __call__
    try:
        yield
    finally:
        del rotary.forward
