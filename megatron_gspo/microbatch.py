"""Batches as the trainer hands them to Megatron's schedules.

Shapes: B rows (one sequence each, right-padded, unless rows are packed: segments_BS), S positions.
Position s of a row holds input token tokens[s] and the target labels[s] = tokens[s+1] that the logits
at s predict; loss_mask[s] = 1 when that target is a trained response token. Everything that varies along S is split the same way under
context parallelism, so the shift never crosses a CP boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megatron_gspo.parallel.context_parallel import split_for_cp


def sequence_sums(values_BS: torch.Tensor, segments_BS: torch.Tensor | None, num_sequences: int) -> torch.Tensor:
    """[N] sums of `values_BS` over each sequence's positions: rows (segments_BS None, N = B), or the
    sequences of packed rows (MicroBatch.segments_BS); padding (-1) is counted in sequence 0, so its
    values must be zero."""
    if segments_BS is None:
        return values_BS.sum(1)
    return values_BS.new_zeros(num_sequences).index_add(0, segments_BS.flatten().clamp(min=0), values_BS.flatten())


@dataclass
class MicroBatch:
    tokens_BS: torch.Tensor
    """Input token ids (long)."""
    labels_BS: torch.Tensor
    """Target ids: tokens shifted left by one (long); anything where loss_mask is 0."""
    loss_mask_BS: torch.Tensor
    """1 where labels_BS is a trained response token (prompt, padding, tool output: 0)."""
    old_logprobs_BS: torch.Tensor
    """Behaviour-policy log-probs of labels_BS (float32); anything where loss_mask is 0."""
    advantages: torch.Tensor
    """[B] one advantage per sequence, or [B, S] per token (gspo_token / grpo)."""
    routing_BSLk: torch.Tensor | None = None
    """The rollout engine's MoE routing to replay (gspo.routing_replay=rollout): [B, S, L, k] expert ids
    of input position s at layer l (uint8/int16); padding positions hold experts 0..k-1. None otherwise."""
    segments_BS: torch.Tensor | None = None
    """Packed rows (training/packing.py): which of the micro-batch's sequences (0..N-1, row-major) each
    position belongs to, -1 on padding; a position attends only to earlier positions of its own
    sequence. None: one sequence per row, causal attention over the row."""
    positions_BS: torch.Tensor | None = None
    """Packed rows: each position's index within its own sequence (the rotary position). None: 0..S-1."""
    correction_BS: torch.Tensor | None = None
    """Train-inference correction weights of labels_BS (float32, stop-gradient; loss/correction.py), set with
    pi_old's log-probs when correction.weight is on; 1 where loss_mask is 0. None: no correction."""

    def sequence_index(self) -> tuple[torch.Tensor, int]:
        """([B * S] each position's sequence, N): rows, or packed rows' segments (padding in sequence 0: it
        is never in the loss mask)."""
        if self.packed:
            return self.segments_BS.flatten().clamp(min=0), self.num_sequences
        rows, length = self.tokens_BS.shape
        return torch.arange(rows).repeat_interleave(length), rows

    @property
    def packed(self) -> bool:
        return self.segments_BS is not None

    @property
    def num_sequences(self) -> int:
        """Sequences in the micro-batch (of the whole micro-batch: a CP rank's part may lack some)."""
        if self.packed:
            return int(self.segments_BS.max()) + 1
        return self.tokens_BS.shape[0]

    def for_cp_rank(self, cp_size: int, cp_rank: int) -> "MicroBatch":
        """This CP rank's part of every sequence (Megatron's load-balanced 2*cp-chunk layout)."""
        if cp_size == 1:
            return self
        parts = {}
        for f in fields(self):
            value = getattr(self, f.name)
            along_s = value is not None and value.dim() >= 2
            parts[f.name] = split_for_cp(value, cp_size, cp_rank, seq_dim=1) if along_s else value
        return MicroBatch(**parts)

    def rows(self, start: int, stop: int) -> "MicroBatch":
        if self.packed:
            raise ValueError("rows() of packed rows would cut the per-sequence advantages apart")
        return MicroBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[start:stop]
                             for f in fields(self)})
