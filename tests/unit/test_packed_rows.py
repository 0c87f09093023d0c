"""Packed rows in the model forward: the block-diagonal causal mask and the per-sequence rotary angles."""
import torch

from megatron_gspo.model.packed_rows import packed_attention_mask, rotary_at_positions
from megatron_gspo.parallel.context_parallel import cp_chunk_indices
from megatron_gspo.platform.cpu import apply_cpu_patches


def brute_force_mask(segments: list[int]) -> torch.Tensor:
    S = len(segments)
    return torch.tensor([[not (k <= q and segments[k] == segments[q]) for k in range(S)] for q in range(S)])


def test_mask_is_causal_within_each_sequence_and_blocks_the_others():
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    mask = packed_attention_mask(segments)
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    for b in range(2):
        assert torch.equal(mask[b, 0], brute_force_mask(segments[b].tolist()))
    # one sequence per row: the plain causal mask
    assert torch.equal(mask[1, 0], torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1))
    # every query sees itself (padding included), so no softmax row is all masked
    assert not mask.all(dim=-1).any()


def test_mask_under_cp_selects_this_rank_query_rows():
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, -1, -1, -1, -1]])
    full = packed_attention_mask(segments)
    for rank in range(2):
        mine = packed_attention_mask(segments, cp_size=2, cp_rank=rank)
        assert torch.equal(mine, full[:, :, cp_chunk_indices(16, 2, rank)])


def test_rotary_at_positions_takes_rows_of_megatrons_own_table():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    apply_cpu_patches()
    rotary = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000)
    table = rotary(12)                                                        # [12, 1, 1, 16]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]])
    with rotary_at_positions(rotary, positions):
        emb = rotary(8)
    assert emb.shape == (8, 2, 1, 16)
    for b in range(2):
        for s in range(8):
            assert torch.equal(emb[s, b, 0], table[positions[b, s], 0, 0])
    assert torch.equal(emb[:, 1], table[:8, 0])                              # 0..7: bitwise Megatron's
    assert "forward" not in vars(rotary) and torch.equal(rotary(12), table)   # restored

