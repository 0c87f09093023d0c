"""The load-balanced CP layout (Megatron-LM get_batch_on_this_cp_rank / rope_utils.py)."""
import pytest
import torch

from megatron_gspo.parallel.context_parallel import (
    cp_chunk_indices,
    cp_gathered_positions,
    split_for_cp,
)


def test_hand_example_seq8_cp2():
    # S=8, cp=2 -> 4 chunks of 2: [0,1] [2,3] [4,5] [6,7].
    # Rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2.
    assert cp_chunk_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_chunk_indices(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_hand_example_seq8_cp4():
    # S=8, cp=4 -> 8 chunks of 1: rank r holds positions r and 7-r.
    assert [cp_chunk_indices(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("seq_len,cp_size", [(8, 1), (8, 2), (16, 4), (24, 3)])
def test_ranks_partition_the_sequence(seq_len, cp_size):
    positions = cp_gathered_positions(seq_len, cp_size)
    assert sorted(positions.tolist()) == list(range(seq_len))


def test_split_matches_megatron_view_index_select():
    # The formulation of Megatron-LM's get_batch_on_this_cp_rank / rope_utils.py:65-69:
    # view the sequence as [2*cp, S/(2*cp)], pick chunks (r, 2*cp-1-r), flatten.
    tokens = torch.arange(2 * 24).view(2, 24)  # [b, S]
    cp = 3
    for r in range(cp):
        want = tokens.view(2, 2 * cp, -1).index_select(1, torch.tensor([r, 2 * cp - 1 - r])).reshape(2, -1)
        assert torch.equal(split_for_cp(tokens, cp, r, seq_dim=1), want)


def test_split_along_other_dims():
    emb = torch.arange(16.0).view(16, 1, 1, 1)  # rotary table layout [S, 1, 1, dim]
    assert split_for_cp(emb, 2, 1, seq_dim=0).flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    mask = torch.arange(8).view(1, 1, 8, 1).expand(1, 1, 8, 8)  # [b, 1, S, S]: select query rows
    assert split_for_cp(mask, 2, 0, seq_dim=2)[0, 0, :, 0].tolist() == [0, 1, 6, 7]


def test_cp1_is_identity():
    t = torch.randn(2, 6)
    assert split_for_cp(t, 1, 0) is t


@pytest.mark.parametrize("seq_len,cp_size,cp_rank", [(6, 2, 0), (8, 2, 2), (8, 0, 0)])
def test_rejects_bad_layouts(seq_len, cp_size, cp_rank):
    with pytest.raises(ValueError):
        cp_chunk_indices(seq_len, cp_size, cp_rank)
