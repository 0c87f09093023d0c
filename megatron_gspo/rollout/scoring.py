"""Scoring groups as they finish: the reward pool (rewards/pool.py) as the rollout uses it.

    scorer = Scorer(pool, config.reward)
    groups, stats = await backend.generate(prompts, on_group=scorer.submit)   # scoring starts per group
    counts = await scorer.score(groups)                                       # every sample's reward set

The reward function's value is the outcome reward: a multi-turn episode's attaches to its last model turn
and the sample's reward is the sum over its turns (samples.Sample.set_outcome_reward).

`submit` hands a group's samples to the worker processes the moment the group's last response arrives,
so verifiers run while the other groups are still generating; `score` waits for what is left (that
wait is `ScoreCounts.wait_s`, the part of scoring generation did not hide), sets `sample.reward`, and
applies the batch rule: more than half the samples timing out or failing is an error naming the
function and a failing sample (rewards/pool.py:check_batch) instead of a step trained on zeros.

With the in-process backend every rank generates the same groups; only rank 0 scores (a verifier that
times out on one rank but not another would split the ranks' batches) and its rewards reach every rank.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from megatron_gspo import profiling
from megatron_gspo.config import RewardConfig
from megatron_gspo.rewards.pool import RewardPool, Score, check_batch
from megatron_gspo.samples import Sample


@dataclass
class ScoreCounts:
    samples: int = 0
    timeouts: int = 0
    """Samples whose verifier ran past reward.timeout_s (scored 0)."""
    errors: int = 0
    """Samples whose verifier raised, crashed or returned a non-number (scored 0)."""
    unparsed: int = 0
    """Samples whose response states no answer the verifier can read (it raised Unparsed; scored 0)."""
    truncated: int = 0
    """Responses cut by max_new_tokens (finish reason "length")."""
    wait_s: float = 0.0
    """Seconds `score` waited for rewards after generation returned."""

    def add(self, other: "ScoreCounts") -> None:
        for name in ("samples", "timeouts", "errors", "unparsed", "truncated", "wait_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class Scorer:
    """The rollout's view of the reward pool. `pool` is None on ranks that receive rewards (collective)."""

    def __init__(self, pool: RewardPool | None, reward: RewardConfig, *, collective: bool = False):
        self.pool, self.reward, self.collective = pool, reward, collective
        self._pending: dict[int, list[Future]] = {}

    def submit(self, group: Sequence[Sample]) -> None:
        """Start scoring a finished group (returns at once)."""
        if self.pool is None:
            return
        self._pending[id(group)] = [self._submit_one(s) for s in group]

    def _submit_one(self, sample: Sample) -> Future:
        if self.reward.truncated == "zero" and sample.finish_reason == "length":
            done: Future = Future()
            done.set_result(Score(0.0, "ok", "truncated: scored 0 (reward.truncated=zero)"))
            return done
        return self.pool.submit([sample])[0]

    async def score(self, groups: Sequence[Sequence[Sample]]) -> ScoreCounts:
        """Set every sample's reward (collective with `collective=True`); the counts of this call."""
        start = time.perf_counter()
        rewards: list[list[float]] | None = None
        counts = ScoreCounts(samples=sum(len(g) for g in groups),
                             truncated=sum(s.finish_reason == "length" for g in groups for s in g))
        if self.pool is not None:
            for group in groups:
                if id(group) not in self._pending:  # a backend that never called on_group
                    self.submit(group)
            scores = [await _results(self._pending.pop(id(g))) for g in groups]
            flat = [s for group in scores for s in group]
            counts.timeouts = sum(s.status == "timeout" for s in flat)
            counts.errors = sum(s.status == "error" for s in flat)
            counts.unparsed = sum(s.status == "unparsed" for s in flat)
            check_batch(flat, [s for g in groups for s in g], self.reward.fn)
            rewards = [[s.value for s in group] for group in scores]
        if self.collective:
            box = [(rewards, counts.timeouts, counts.errors, counts.unparsed)]
            dist.broadcast_object_list(box, src=0)
            rewards, counts.timeouts, counts.errors, counts.unparsed = box[0]
        for group, values in zip(groups, rewards):
            for sample, value in zip(group, values):
                sample.set_outcome_reward(value)  # an episode's: on its last turn, summed with its turns' own
        counts.wait_s = time.perf_counter() - start
        profiling.add(profiling.current() + "/reward_wait", counts.wait_s)
        return counts


async def _results(futures: Sequence[Future]) -> list[Score]:
    if all(f.done() for f in futures):  # scored already (e.g. reward.workers=0): no event-loop round trips
        return [f.result() for f in futures]
    return await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
