"""Dynamic sampling: zero-variance groups are dropped, over-sampling refills, drops are reported."""
import asyncio

import pytest

from megatron_gspo.rollout.rewards import math_verify
from megatron_gspo.rollout.sampling import PromptsExhausted, collect_scored_groups, has_signal
from megatron_gspo.types import Prompt, Sample

G = 4


def fake_generate(calls):
    """Group k's sample i answers "1" when (k % 3 == 0 -> always, k % 3 == 1 -> never, else -> i even):
    so groups 0, 3, 6, ... and 1, 4, 7, ... have zero variance, 2, 5, 8, ... have signal."""
    async def generate(prompts):
        calls.append([p.group_id for p in prompts])
        groups = []
        for p in prompts:
            k = p.group_id
            texts = ["1" if (k % 3 == 0 or (k % 3 == 2 and i % 2 == 0)) else "0" for i in range(G)]
            groups.append([Sample(group_id=k, sample_index=i, prompt_ids=p.prompt_ids, response_ids=[],
                                  rollout_logprobs=[], finish_reason="stop", response_text=t, answer="1")
                           for i, t in enumerate(texts)])
        return groups, {"prompts": len(prompts)}
    return generate


def prompt_stream(k):
    return iter([Prompt(group_id=i, prompt_ids=[i + 1]) for i in range(k)])


def test_drop_and_refill():
    calls = []
    batch = asyncio.run(collect_scored_groups(fake_generate(calls), prompt_stream(100), 3, math_verify,
                                              drop_zero_variance=True, oversample=2.0))
    assert [g[0].group_id for g in batch.groups] == [2, 5, 8]
    assert all(has_signal(g) for g in batch.groups)
    # round 1: ceil(3*2)=6 prompts (0..5) keep 2, 5; round 2: ceil(1*2)=2 prompts (6, 7) keep none;
    # round 3: 2 prompts (8, 9) keep 8; 9 has no signal.
    assert calls == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9]]
    assert batch.dropped_group_ids == [0, 1, 3, 4, 6, 7, 9] and batch.num_dropped == 7
    assert batch.rounds == 3 and batch.rollout_stats == [{"prompts": 6}, {"prompts": 2}, {"prompts": 2}]


def test_without_dynamic_sampling_everything_is_kept():
    calls = []
    batch = asyncio.run(collect_scored_groups(fake_generate(calls), prompt_stream(100), 4, math_verify))
    assert calls == [[0, 1, 2, 3]] and batch.num_dropped == 0
    assert [s.reward for s in batch.groups[0]] == [1.0] * G


def test_surplus_groups_are_reported():
    batch = asyncio.run(collect_scored_groups(fake_generate([]), iter([Prompt(2, [1]), Prompt(5, [1])]), 1,
                                              math_verify, drop_zero_variance=True, oversample=2.0))
    assert [g[0].group_id for g in batch.groups] == [2] and batch.surplus_group_ids == [5]


def test_prompts_running_out_is_an_error():
    # prompts 0..4: only group 2 has signal; 0, 1, 3, 4 are dropped.
    with pytest.raises(PromptsExhausted, match="1 of 2 groups .*4 zero-variance groups dropped"):
        asyncio.run(collect_scored_groups(fake_generate([]), prompt_stream(5), 2, math_verify,
                                          drop_zero_variance=True))
