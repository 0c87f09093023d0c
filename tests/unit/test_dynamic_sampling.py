"""Dynamic sampling: zero-variance groups are dropped, over-sampling refills, drops are reported."""
import asyncio

import pytest

from megatron_gspo.rollout.protocol import RolloutStats
from megatron_gspo.config import RewardConfig
from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.rollout.batch_filling import PromptsExhausted, collect_scored_groups, has_signal
from megatron_gspo.samples import Prompt, Sample

G = 4


def fake_generate(calls):
    """Group k's sample i answers "1" when (k % 3 == 0 -> always, k % 3 == 1 -> never, else -> i even):
    so groups 0, 3, 6, ... and 1, 4, 7, ... have zero variance, 2, 5, 8, ... have signal."""
    async def generate(prompts, on_group=None):
        calls.append([p.group_id for p in prompts])
        groups = []
        for p in prompts:
            k = p.group_id
            texts = ["1" if (k % 3 == 0 or (k % 3 == 2 and i % 2 == 0)) else "0" for i in range(G)]
            groups.append([Sample(group_id=k, sample_index=i, prompt_ids=p.prompt_ids, response_ids=[],
                                  rollout_logprobs=[], finish_reason="stop", response_text=t, answer="1")
                           for i, t in enumerate(texts)])
        return groups, RolloutStats(elapsed_s=0.5, response_tokens=len(prompts))
    return generate


@pytest.fixture(scope="module")
def pool():
    with RewardPool("math", workers=2) as pool:
        yield pool


@pytest.fixture
def math_verify(pool):
    """The math verifier in the reward pool, as the rollout scores."""
    return Scorer(pool, RewardConfig(fn="math"))


def prompt_stream(k):
    return iter([Prompt(group_id=i, prompt_ids=[i + 1]) for i in range(k)])


def test_drop_and_refill(math_verify):
    calls = []
    batch = asyncio.run(collect_scored_groups(fake_generate(calls), prompt_stream(100), 3, math_verify,
                                              drop_zero_variance=True, oversample=2.0))
    assert [g[0].group_id for g in batch.groups] == [2, 5, 8]
    assert all(has_signal(g) for g in batch.groups)
    # round 1: ceil(3*2)=6 prompts (0..5) keep 2, 5 (2 of 6 groups had signal); round 2: the missing
    # group over that fraction, ceil(1*2/(1/3))=6 prompts (6..11): keeps 8, 11 is surplus.
    assert calls == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert batch.dropped_group_ids == [0, 1, 3, 4, 6, 7, 9, 10] and batch.num_dropped == 8
    assert batch.surplus_group_ids == [11] and batch.padded_group_ids == []
    assert batch.rounds == 2 and [st.response_tokens for st in batch.rollout_stats] == [6, 6]
    # tokens/s over both rounds: 12 "tokens" (one per prompt in the fake) in 2 x 0.5 s
    assert batch.metrics()["rollout/tokens_per_s"] == 12.0


def test_rounds_are_capped(math_verify):
    calls = []
    batch = asyncio.run(collect_scored_groups(fake_generate(calls), prompt_stream(100), 3, math_verify,
                                              drop_zero_variance=True, oversample=2.0, max_prompts_per_round=4))
    # min(6, 4); then 2 * 2 / (1/4) = 16 -> 4; then 1 * 2 / (2/8) = 8 -> 4.
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [g[0].group_id for g in batch.groups] == [2, 5, 8] and batch.surplus_group_ids == [11]


def test_metrics_are_over_every_generated_sample(math_verify):
    """The kept groups all have signal (mean 0.5 here); reward_mean is the policy's: every sample."""
    batch = asyncio.run(collect_scored_groups(fake_generate([]), prompt_stream(100), 3, math_verify,
                                              drop_zero_variance=True, oversample=2.0))
    m = batch.metrics()
    # 12 groups generated (0..11): 0, 3, 6, 9 all "1"; 1, 4, 7, 10 all "0"; 2, 5, 8, 11 half "1".
    assert m["rollout/groups_generated"] == 12
    assert m["reward/mean"] == (4 * G + 4 * G / 2) / (12 * G) == 0.5
    assert m["reward/mean_trained"] == 0.5 and m["reward/zero_signal_group_fraction_trained"] == 0.0
    assert m["reward/zero_signal_group_fraction"] == 8 / 12
    assert m["rollout/dynamic_sampling_padded_groups"] == 0.0
    # Without dynamic sampling the generated and the trained batch are the same.
    plain = asyncio.run(collect_scored_groups(fake_generate([]), prompt_stream(100), 4, math_verify)).metrics()
    assert plain["reward/mean"] == plain["reward/mean_trained"] == (2 * G + G / 2) / (4 * G)  # groups 0 and 3 all "1", 2 half
    assert plain["reward/zero_signal_group_fraction"] == plain["reward/zero_signal_group_fraction_trained"] == 3 / 4


def test_padding_after_max_rounds(math_verify):
    """A policy with signal on no prompt: after max_rounds the batch is filled with dropped groups
    (zero advantage, so they change nothing), reported as padding, instead of failing."""
    calls = []
    no_signal = iter([Prompt(group_id=3 * i, prompt_ids=[1]) for i in range(100)])  # k % 3 == 0: all "1"
    batch = asyncio.run(collect_scored_groups(fake_generate(calls), no_signal, 2, math_verify,
                                              drop_zero_variance=True, max_rounds=2, max_prompts_per_round=5))
    assert [len(c) for c in calls] == [3, 5]  # ceil(2*1.5); then 2*1.5*16 capped at 5
    assert [g[0].group_id for g in batch.groups] == [21, 18] and batch.padded_group_ids == [21, 18]
    assert not any(has_signal(g) for g in batch.groups)
    m = batch.metrics()
    assert m["reward/mean"] == 1.0 and m["reward/zero_signal_group_fraction"] == 1.0
    assert m["rollout/dynamic_sampling_padded_groups"] == 2.0 and m["rollout/groups_generated"] == 8


def test_without_dynamic_sampling_everything_is_kept(math_verify):
    calls = []
    batch = asyncio.run(collect_scored_groups(fake_generate(calls), prompt_stream(100), 4, math_verify))
    assert calls == [[0, 1, 2, 3]] and batch.num_dropped == 0
    assert [s.reward for s in batch.groups[0]] == [1.0] * G


def test_surplus_groups_are_reported(math_verify):
    batch = asyncio.run(collect_scored_groups(fake_generate([]), iter([Prompt(2, [1]), Prompt(5, [1])]), 1,
                                              math_verify, drop_zero_variance=True, oversample=2.0))
    assert [g[0].group_id for g in batch.groups] == [2] and batch.surplus_group_ids == [5]


def test_prompts_running_out_is_an_error(math_verify):
    # prompts 0..4: only group 2 has signal; 0, 1, 3, 4 are dropped.
    with pytest.raises(PromptsExhausted, match="1 of 2 groups .*4 zero-variance groups dropped"):
        asyncio.run(collect_scored_groups(fake_generate([]), prompt_stream(5), 2, math_verify,
                                          drop_zero_variance=True))
