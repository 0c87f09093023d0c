"""Megatron's load-balanced context-parallel (CP) sequence layout, as pure data-layout helpers.

A sequence of length S (divisible by 2*cp) is cut into 2*cp equal chunks; CP rank r holds chunk r
followed by chunk 2*cp-1-r. Under causal attention the early chunks are cheap and the late ones
expensive, so pairing them gives every rank the same work. This is the layout Megatron-LM's
`get_batch_on_this_cp_rank` produces and that Megatron-Core's rotary embedding assumes
(`models/common/embeddings/rope_utils.py:get_pos_emb_on_this_cp_rank`).

Example, S=8, cp=2 (chunks of 2): rank 0 holds positions [0, 1, 6, 7], rank 1 holds [2, 3, 4, 5].

Process groups are passed in; nothing here reads Megatron's global parallel state.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def cp_chunk_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global sequence positions held by `cp_rank`, in its local order (a LongTensor of S/cp)."""
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"bad CP coordinates: cp_rank={cp_rank}, cp_size={cp_size}")
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp_size={2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    early, late = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat([
        torch.arange(early * chunk, (early + 1) * chunk),
        torch.arange(late * chunk, (late + 1) * chunk),
    ])


def cp_gathered_positions(seq_len: int, cp_size: int) -> torch.Tensor:
    """Global positions of an all-gather over the CP group (rank 0's part, then rank 1's, ...)."""
    return torch.cat([cp_chunk_indices(seq_len, cp_size, r) for r in range(cp_size)])


def split_for_cp(t: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a full-sequence tensor (sequence along `seq_dim`)."""
    if cp_size == 1:
        return t
    idx = cp_chunk_indices(t.size(seq_dim), cp_size, cp_rank).to(t.device)
    return t.index_select(seq_dim, idx)


def gather_from_cp(t_local: torch.Tensor, cp_group: dist.ProcessGroup, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of `split_for_cp`: the full sequence in natural order on every rank.

    For tests and debugging; not differentiable.
    """
    cp_size = dist.get_world_size(cp_group)
    if cp_size == 1:
        return t_local
    parts = [torch.empty_like(t_local) for _ in range(cp_size)]
    dist.all_gather(parts, t_local.contiguous(), group=cp_group)
    gathered = torch.cat(parts, dim=seq_dim)
    # gathered[j] sits at global position positions[j]; argsort maps it back to natural order.
    positions = cp_gathered_positions(gathered.size(seq_dim), cp_size)
    return gathered.index_select(seq_dim, torch.argsort(positions).to(t_local.device))
