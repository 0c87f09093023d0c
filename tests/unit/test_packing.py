"""Packing responses into micro-batches: alignment by hand, the split rule, and its invariants."""
import pytest
import torch

from megatron_gspo.training.packing import (Response, assign_to_dp, pack_minibatch, padded_length,
                                            plan_microbatches)


def test_alignment_of_a_3_token_prompt_and_2_token_response():
    # tokens  p0 p1 p2 r0 r1 0 0 0 / labels p1 p2 r0 r1 0 0 0 0 / mask 0 0 1 1 0 0 0 0 / old 0 0 l0 l1 0..
    r = Response(prompt_ids=[11, 12, 13], response_ids=[21, 22], advantage=0.5, rollout_logprobs=[-0.1, -0.2])
    packed = pack_minibatch([r], dp_size=1, dp_rank=0, max_tokens=100, pad_multiple=8)
    (mb,) = packed.micro_batches
    assert mb.tokens_BS.tolist() == [[11, 12, 13, 21, 22, 0, 0, 0]]
    assert mb.labels_BS.tolist() == [[12, 13, 21, 22, 0, 0, 0, 0]]
    assert mb.loss_mask_BS.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0]]
    assert torch.equal(mb.old_logprobs_BS, torch.tensor([[0, 0, -0.1, -0.2, 0, 0, 0, 0]]))
    assert torch.equal(packed.rollout_logprobs[0], mb.old_logprobs_BS)
    assert mb.advantages.tolist() == [0.5]
    assert packed.num_global_sequences == 1 and packed.rows == [[0]]
    # Every masked label is a response token, in order.
    assert mb.labels_BS[mb.loss_mask_BS.bool()].tolist() == [21, 22]


def test_per_token_advantages_align_with_labels():
    r = Response([1, 2, 3], [4, 5], advantage=[0.25, -0.5])
    (mb,) = pack_minibatch([r], dp_size=1, dp_rank=0, max_tokens=100, pad_multiple=2).micro_batches
    assert mb.tokens_BS.shape == (1, 6)
    assert mb.advantages.tolist() == [[0, 0, 0.25, -0.5, 0, 0]]
    # No rollout log-probs: old log-probs are zeros (to be recomputed), no rollout tensor kept.
    assert not mb.old_logprobs_BS.any()


def test_empty_response_is_a_row_with_no_trained_token():
    packed = pack_minibatch([Response([1, 2], [], 1.0, [])], dp_size=1, dp_rank=0, max_tokens=64)
    assert packed.micro_batches[0].loss_mask_BS.sum() == 0
    assert packed.num_global_sequences == 1


def test_pad_multiple_covers_cp_and_sequence_parallel():
    # cp=2, tp=2 -> rows are multiples of 2*cp*tp = 8.
    r = Response(list(range(1, 6)), [7] * 4, 1.0)  # 9 tokens -> 16
    (mb,) = pack_minibatch([r], dp_size=1, dp_rank=0, max_tokens=100, pad_multiple=8).micro_batches
    assert mb.tokens_BS.shape[1] == 16 == padded_length(9, 8)


def test_dp_assignment_equal_counts_balanced_tokens():
    lengths = [10, 90, 20, 80, 30, 70, 40, 60]
    ranks = assign_to_dp(lengths, 2)
    assert sorted(i for r in ranks for i in r) == list(range(8))
    assert [len(r) for r in ranks] == [4, 4]
    tokens = [sum(lengths[i] for i in r) for r in ranks]
    assert tokens == [200, 200]
    with pytest.raises(ValueError, match="do not divide over 3"):
        assign_to_dp(lengths, 3)


def test_microbatches_respect_the_budget_and_sort_by_length():
    lengths = [8, 64, 16, 32, 8, 8, 16, 64]
    (plan,) = plan_microbatches(lengths, dp_size=1, max_tokens=64)
    # Longest first: [64] [64] [32,16]... each chunk holds budget // (its first row's length) rows.
    assert plan == [[1], [7], [3, 2], [6, 0, 4, 5]]
    for chunk in plan:
        assert len(chunk) * max(lengths[i] for i in chunk) <= 64


def test_all_dp_ranks_get_the_same_number_of_microbatches():
    # Rank 0 gets the two long rows (2 micro-batches of 1), rank 1 short ones that fit in one: it splits.
    lengths = [64, 8, 64, 8]
    plan = plan_microbatches(lengths, dp_size=2, max_tokens=64)
    assert [len(p) for p in plan] == [2, 2]
    assert all(chunk for rank in plan for chunk in rank)


def test_uniform_microbatches_for_pipeline_parallel():
    lengths = [8, 16, 8, 8, 16, 8, 8, 8]
    packed = [pack_minibatch([Response([1] * (n - 1), [2], 1.0) for n in lengths], dp_size=2, dp_rank=r,
                             max_tokens=32, pad_multiple=8, uniform=True) for r in range(2)]
    shapes = {tuple(mb.tokens_BS.shape) for p in packed for mb in p.micro_batches}
    assert shapes == {(2, 16)}                     # 4 rows per rank, 2 fit 32 tokens at length 16
    assert packed[0].num_microbatches == packed[1].num_microbatches == 2


def test_every_response_lands_once_over_dp_ranks():
    g = torch.Generator().manual_seed(0)
    responses = [Response([1] * int(torch.randint(1, 20, (), generator=g)),
                          [2] * int(torch.randint(0, 30, (), generator=g)), float(i)) for i in range(24)]
    seen = []
    counts = set()
    for rank in range(4):
        packed = pack_minibatch(responses, dp_size=4, dp_rank=rank, max_tokens=96, pad_multiple=4)
        counts.add(packed.num_microbatches)
        for mb, rows in zip(packed.micro_batches, packed.rows):
            assert mb.advantages.tolist() == [float(i) for i in rows]
            assert mb.loss_mask_BS.sum(1).tolist() == [len(responses[i].response_ids) for i in rows]
            assert mb.tokens_BS.numel() <= 96 or len(rows) == 1
            seen += rows
        assert packed.num_global_sequences == 24
    assert sorted(seen) == list(range(24)) and len(counts) == 1


@pytest.mark.parametrize("response, message", [
    (Response([], [1], 1.0), "prompt is empty"),
    (Response([1], [2, 3], 1.0, [-0.1]), "1 rollout log-probs for 2 response tokens"),
    (Response([1], [2, 3], [0.1]), "1 per-token advantages for 2"),
])
def test_bad_responses_are_rejected(response, message):
    with pytest.raises(ValueError, match=message):
        pack_minibatch([response], dp_size=1, dp_rank=0, max_tokens=64)


def test_rollout_samples_adapt_to_responses():
    from megatron_gspo.samples import Sample

    samples = [Sample(group_id=0, sample_index=i, prompt_ids=[1, 2, 3], response_ids=[4, 5],
                      rollout_logprobs=[-0.1, -0.2], finish_reason="stop", reward=float(i)) for i in range(2)]
    from megatron_gspo.training.packing import responses_from_samples

    responses = responses_from_samples(samples, torch.tensor([0.5, -0.5]))
    packed = pack_minibatch(responses, dp_size=1, dp_rank=0, max_tokens=64, pad_multiple=2)
    (mb,) = packed.micro_batches
    assert sorted(mb.advantages.tolist()) == [-0.5, 0.5]
    assert mb.old_logprobs_BS[0].tolist() == pytest.approx([0, 0, -0.1, -0.2, 0, 0])
    with pytest.raises(ValueError, match="2 samples but 1 advantages"):
        responses_from_samples(samples, [0.5])


def test_padding_fraction_counts_every_rank_s_micro_batches():
    from megatron_gspo.training.packing import Response, pack_minibatch
    # lengths 4 and 8 (pad multiple 2): one micro-batch of two rows at length 8 -> 16 positions, 12 real
    a, b = Response([1, 2], [3, 4], 1.0), Response([1, 2, 3], [4, 5, 6, 7, 8], -1.0)
    assert pack_minibatch([a, b], dp_size=1, dp_rank=0, max_tokens=64).padding_fraction == 1 - 12 / 16
    # two DP ranks, one row each at its own length: no padding at all, whichever rank asks
    assert pack_minibatch([a, b], dp_size=2, dp_rank=1, max_tokens=64).padding_fraction == 0.0
