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
                             max_tokens=32, pad_multiple=8, rows="uniform") for r in range(2)]
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


# ---------------------------------------------------------------------------------------------------
# Packed rows (rows="packed")
# ---------------------------------------------------------------------------------------------------

def test_packed_row_alignment_by_hand():
    # The module docstring's example: a = [a0 | a1 a2], b = [b0 b1 | b2], padded to 8.
    a = Response([11], [12, 13], advantage=0.5, rollout_logprobs=[-0.1, -0.2])
    b = Response([21, 22], [23], advantage=-1.0, rollout_logprobs=[-0.3])
    packed = pack_minibatch([a, b], dp_size=1, dp_rank=0, max_tokens=100, pad_multiple=8, rows="packed")
    (mb,) = packed.micro_batches
    assert mb.tokens_BS.tolist() == [[11, 12, 13, 21, 22, 23, 0, 0]]
    assert mb.segments_BS.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1]]
    assert mb.positions_BS.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert mb.loss_mask_BS.tolist() == [[1, 1, 0, 0, 1, 0, 0, 0]]
    # a label never crosses into the next sequence where the mask is on
    assert mb.labels_BS[mb.loss_mask_BS.bool()].tolist() == [12, 13, 23]
    assert torch.equal(mb.old_logprobs_BS, torch.tensor([[-0.1, -0.2, 0, 0, -0.3, 0, 0, 0]]))
    assert mb.advantages.tolist() == [0.5, -1.0] and mb.num_sequences == 2
    assert packed.rows == [[0, 1]] and packed.places == [[(0, 0), (0, 3)]]
    assert packed.padding_fraction == 1 - 6 / 8


def test_unpacked_places_are_one_response_per_row():
    responses = [Response([1] * n, [2], 1.0) for n in (3, 5, 2)]
    packed = pack_minibatch(responses, dp_size=1, dp_rank=0, max_tokens=100, pad_multiple=2)
    assert not packed.micro_batches[0].packed
    for rows, places in zip(packed.rows, packed.places):
        assert places == [(b, 0) for b in range(len(rows))]


def long_tailed(n: int, seed: int) -> list[Response]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.distributions.LogNormal(3.0, 0.9).sample((n,)).clamp(1, 400).long().tolist()
    prompts = torch.randint(4, 30, (n,), generator=g).tolist()
    return [Response([7] * p, [9] * r, float(i % 3 - 1)) for i, (p, r) in enumerate(zip(prompts, lengths))]


@pytest.mark.parametrize("dp_size, max_tokens, pad", [(1, 512, 2), (2, 1024, 4), (4, 300, 8), (3, 4096, 2)])
def test_packed_plan_invariants(dp_size, max_tokens, pad):
    responses = long_tailed(48, seed=dp_size)
    lengths = [len(r.prompt_ids) + len(r.response_ids) for r in responses]
    capacity = max(padded_length(n, pad) for n in lengths)
    per_rank = [pack_minibatch(responses, dp_size=dp_size, dp_rank=k, max_tokens=max_tokens, pad_multiple=pad,
                               rows="packed") for k in range(dp_size)]
    seen = sorted(i for p in per_rank for rows in p.rows for i in rows)
    assert seen == list(range(len(responses)))                                 # each response exactly once
    assert len({p.num_microbatches for p in per_rank}) == 1                    # equal counts over DP
    assert len({len([i for rows in p.rows for i in rows]) for p in per_rank}) == 1  # equal responses per rank
    for p in per_rank:
        for mb, rows, places in zip(p.micro_batches, p.rows, p.places):
            B, S = mb.tokens_BS.shape
            assert S % pad == 0 and S <= capacity                               # no row longer than unpacked's
            assert B == 1 or B * S <= max_tokens                                # the budget
            assert mb.packed == (len(rows) > B)         # one response per row: a plain micro-batch
            for q, (i, (row, start)) in enumerate(zip(rows, places)):
                n = lengths[i]
                assert mb.tokens_BS[row, start:start + n].tolist() == responses[i].prompt_ids + responses[i].response_ids
                if mb.packed:
                    assert (mb.segments_BS[row, start:start + n] == q).all()
                    assert mb.positions_BS[row, start:start + n].tolist() == list(range(n))
                else:
                    assert start == 0 and row == q
                assert mb.advantages[q] == responses[i].advantage
            assert int(mb.loss_mask_BS.sum()) == sum(len(responses[i].response_ids) for i in rows)
    unpacked = pack_minibatch(responses, dp_size=dp_size, dp_rank=0, max_tokens=max_tokens, pad_multiple=pad)
    assert per_rank[0].padding_fraction < unpacked.padding_fraction


def test_packed_plan_splits_a_row_when_more_micro_batches_are_needed():
    # One 24-token response sets the row length; four 6-token ones share the second row.
    responses = [Response([1] * 12, [2] * 12, 1.0)] + [Response([1] * 3, [2] * 3, 1.0) for _ in range(4)]
    packed = pack_minibatch(responses, dp_size=1, dp_rank=0, max_tokens=100, pad_multiple=2, rows="packed")
    assert packed.rows == [[0, 1, 2, 3, 4]] and packed.places == [[(0, 0), (1, 0), (1, 6), (1, 12), (1, 18)]]
    # three micro-batches: the two rows apart, then the row of four split in two
    split = pack_minibatch(responses, dp_size=1, dp_rank=0, max_tokens=100, pad_multiple=2, rows="packed",
                           min_microbatches=3)
    assert split.rows == [[0], [1, 2], [3, 4]]
    assert [mb.tokens_BS.shape for mb in split.micro_batches] == [(1, 24), (1, 12), (1, 12)]
    with pytest.raises(ValueError, match="rows must be padded, uniform or packed"):
        pack_minibatch(responses, dp_size=1, dp_rank=0, max_tokens=100, rows="uniform+packed")


def test_a_stale_prefix_conditions_but_is_not_trained():
    """A partial rollout's first tokens (by older weights) keep loss_mask 0: the rows equal those of the same
    tokens with the prefix moved into the prompt, except that the sample's log-probs stay aligned."""
    from megatron_gspo.samples import Sample
    from megatron_gspo.training.packing import responses_from_samples

    cut = Sample(group_id=0, sample_index=0, prompt_ids=[11, 12, 13], response_ids=[21, 22, 23, 24],
                 rollout_logprobs=[-0.1, -0.2, -0.3, -0.4], finish_reason="length", stale_prefix=2)
    (mb,) = pack_minibatch(responses_from_samples([cut], [0.5]), dp_size=1, dp_rank=0, max_tokens=64,
                           pad_multiple=8).micro_batches
    assert mb.loss_mask_BS.tolist() == [[0, 0, 0, 0, 1, 1, 0, 0]]
    assert mb.labels_BS[mb.loss_mask_BS.bool()].tolist() == [23, 24]
    assert mb.old_logprobs_BS[mb.loss_mask_BS.bool()].tolist() == pytest.approx([-0.3, -0.4])
    moved = Response([11, 12, 13, 21, 22], [23, 24], 0.5, [-0.3, -0.4])
    (same,) = pack_minibatch([moved], dp_size=1, dp_rank=0, max_tokens=64, pad_multiple=8).micro_batches
    for name in ("tokens_BS", "labels_BS", "loss_mask_BS"):
        assert torch.equal(getattr(mb, name), getattr(same, name)), name
    # packed rows keep each response's prefix untrained as well
    other = Response([31], [41, 42], -0.5, [-0.5, -0.6])
    packed = pack_minibatch(responses_from_samples([cut], [0.5]) + [other], dp_size=1, dp_rank=0, max_tokens=64,
                            pad_multiple=2, rows="packed")
    assert sum(mb.loss_mask_BS.sum().item() for mb in packed.micro_batches) == 2 + 2
    with pytest.raises(ValueError, match="stale_prefix 2 must leave at least one of the 2 response tokens"):
        pack_minibatch([Response([1], [2, 3], 1.0, stale_prefix=2)], dp_size=1, dp_rank=0, max_tokens=64)
    with pytest.raises(ValueError, match="stale_prefix 4 must leave"):
        Sample(group_id=0, sample_index=0, prompt_ids=[1], response_ids=[2, 3, 4, 5], rollout_logprobs=[0.0] * 4,
               finish_reason="stop", stale_prefix=4)


def _reference_rows(mb, responses, places, per_token):
    """The module docstring's alignment, position by position, from each response's (row, start)."""
    B, S = mb.tokens_BS.shape
    want = {name: torch.zeros(B, S) for name in ("tokens", "labels", "mask", "rollout", "advantages")}
    want["segments"], want["positions"] = torch.full((B, S), -1.0), torch.zeros(B, S)
    ends = {}
    for n, (r, (row, start)) in enumerate(zip(responses, places)):
        ids, P, R = [*r.prompt_ids, *r.response_ids], len(r.prompt_ids), len(r.response_ids)
        for j, token in enumerate(ids):
            want["tokens"][row, start + j] = token
            want["segments"][row, start + j], want["positions"][row, start + j] = n, j
            if j + 1 < len(ids):
                want["labels"][row, start + j] = ids[j + 1]
        for k in range(R):
            at = start + P - 1 + k
            want["mask"][row, at] = float(k >= r.stale_prefix)
            want["rollout"][row, at] = r.rollout_logprobs[k]
            if per_token:
                want["advantages"][row, at] = r.advantage[k]
        ends[row] = (start + P + R, start)
    for row, (end, last) in ends.items():  # packed padding: positions go on from the last response's
        for at in range(end, S):
            want["positions"][row, at] = at - last
    return want


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("pack_sequences", [False, True])
def test_rows_match_a_position_by_position_reference(per_token, pack_sequences):
    """Random prompts, responses (some empty), stale prefixes and advantages: every tensor of every
    micro-batch equals the alignment written out position by position."""
    g = torch.Generator().manual_seed(3)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))  # noqa: E731
    responses = []
    for _ in range(40):
        P, R = rand(1, 12), rand(0, 20)
        responses.append(Response(
            [rand(1, 500) for _ in range(P)], [rand(1, 500) for _ in range(R)],
            advantage=[float(torch.randn((), generator=g)) for _ in range(R)] if per_token else float(torch.randn((), generator=g)),
            rollout_logprobs=[-float(torch.rand((), generator=g)) for _ in range(R)],
            stale_prefix=min(rand(0, 4), max(R - 1, 0))))
    packed = pack_minibatch(responses, dp_size=1, dp_rank=0, max_tokens=96, pad_multiple=4,
                            rows="packed" if pack_sequences else "padded")
    assert sorted(i for row in packed.rows for i in row) == list(range(len(responses)))
    for mb, order, places in zip(packed.micro_batches, packed.rows, packed.places):
        mine = [responses[i] for i in order]
        want = _reference_rows(mb, mine, places, per_token)
        assert torch.equal(mb.tokens_BS, want["tokens"].long()) and torch.equal(mb.labels_BS, want["labels"].long())
        assert torch.equal(mb.loss_mask_BS, want["mask"]) and torch.equal(mb.old_logprobs_BS, want["rollout"])
        if per_token:
            assert torch.equal(mb.advantages, want["advantages"])
        else:
            assert mb.advantages.tolist() == [torch.tensor(r.advantage).item() for r in mine]
        if mb.packed:  # (a micro-batch whose rows hold one response each is not packed)
            assert torch.equal(mb.segments_BS, want["segments"].long())
            assert torch.equal(mb.positions_BS, want["positions"].long())
        else:
            assert all(start == 0 for _, start in places)
    assert any(mb.packed for mb in packed.micro_batches) == pack_sequences

