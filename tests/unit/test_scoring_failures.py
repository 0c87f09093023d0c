"""A broken reward function stops the rollout (training and eval) within about two timeouts, naming it,
while generation still runs or after it; a line shows progress while a batch waits for rewards."""
import asyncio
import re
import time

import pytest

from megatron_gspo.config import RewardConfig, SamplingConfig
from megatron_gspo.evaluation import evaluate
from megatron_gspo.rewards.pool import RewardError, RewardPool
from megatron_gspo.rollout.batch_filling import collect_scored_groups
from megatron_gspo.rollout.protocol import RolloutStats
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.samples import Prompt, Sample

G = 4
HANGS = "reward_fns:hangs"   # never returns (tests/unit/reward_fns.py)


def fake_generate(events: list, *, then_s: float):
    """Each prompt's group of G samples goes to on_group at once; then the generation takes `then_s` more
    seconds (a slow server still generating other groups), unless cancelled (noted in `events`)."""
    async def generate(prompts, n=G, sampling=None, on_group=None):
        groups = [[Sample(group_id=p.group_id, sample_index=i, prompt_ids=p.prompt_ids, response_ids=[1],
                          rollout_logprobs=[0.0], finish_reason="stop", response_text="7", answer="7")
                   for i in range(n)] for p in prompts]
        for group in groups:
            on_group(group)
        try:
            await asyncio.sleep(then_s)
        except asyncio.CancelledError:
            events.append("generation cancelled")
            raise
        return groups, RolloutStats(elapsed_s=then_s)
    return generate


def prompts(k):
    return [Prompt(group_id=i, prompt_ids=[i + 1], answer="7") for i in range(k)]


def check_stopped(error: RewardError, took: float) -> None:
    # 2 workers, 1 s: 2 timeouts at ~1 s, 2 more at ~2 s (a replacement worker starts in ~0.2 s)
    assert took < 3.0, took
    assert str(error).startswith(f"reward function {HANGS!r} failed on its first 4 samples in a row "
                                 "(4 timed out after 1 s): is it broken?"), str(error)


@pytest.mark.parametrize("then_s", [60.0, 0.0])
def test_training_rollout_stops_within_two_timeouts(then_s):
    # then_s=60: the groups are being scored while the servers still generate (SGLang) -- the generation is
    # cancelled; 0: every group arrives at once and the wait is for rewards (the in-process backend).
    # Before: 16 x 4 samples x 1 s / 2 workers = 32 s of waiting (after the generation), then check_batch.
    events = []
    with RewardPool(HANGS, workers=2, timeout_s=1) as pool:
        scorer = Scorer(pool, RewardConfig(fn=HANGS, workers=2, timeout_s=1))
        start = time.perf_counter()
        with pytest.raises(RewardError) as info:
            asyncio.run(collect_scored_groups(fake_generate(events, then_s=then_s), iter(prompts(16)), 16, scorer))
        check_stopped(info.value, time.perf_counter() - start)
    assert events == (["generation cancelled"] if then_s else [])


def test_eval_stops_within_two_timeouts():
    # The case: 10 eval prompts x 16 samples, before: 160 x 1 s / 2 workers = 80 s, printing nothing.
    events = []
    with RewardPool(HANGS, workers=2, timeout_s=1) as pool:
        scorer = Scorer(pool, RewardConfig(fn=HANGS, workers=2, timeout_s=1))
        start = time.perf_counter()
        with pytest.raises(RewardError) as info:
            asyncio.run(evaluate(fake_generate(events, then_s=60.0), {"held_out": prompts(10)}, scorer,
                                 SamplingConfig(), k=16))
        check_stopped(info.value, time.perf_counter() - start)
    assert events == ["generation cancelled"]


def test_a_line_while_the_batch_waits_for_rewards(capsys):
    # 8 samples of 0.3 s on one worker: ~2.4 s of waiting, a line every 0.5 s (5 s in training).
    with RewardPool("reward_fns:sleepy", workers=1, timeout_s=10) as pool:
        scorer = Scorer(pool, RewardConfig(fn="reward_fns:sleepy", workers=1), progress_every_s=0.5)
        batch = asyncio.run(collect_scored_groups(fake_generate([], then_s=0.0), iter(prompts(2)), 2, scorer))
    assert [s.reward for s in batch.samples] == [1.0] * 8
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2, lines
    for line in lines:
        assert re.fullmatch(r"waiting for rewards: [0-7] of 8 samples scored after [0-9] s "
                            r"\(reward.fn=reward_fns:sleepy, 1 worker, timeout 10 s\)", line), line
