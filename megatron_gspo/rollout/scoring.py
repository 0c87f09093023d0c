"""Scoring groups as they finish: the reward pool (rewards/pool.py) as the rollout uses it.

    scorer = Scorer(pool, config.reward)
    groups, stats = await scorer.stop_on_failure(backend.generate(prompts, on_group=scorer.submit))
    counts = await scorer.score(groups)                                       # every sample's reward set

The reward function's value is the outcome reward: a multi-turn episode's attaches to its last model turn
and the sample's reward is the sum over its turns (samples.Sample.set_outcome_reward).

`submit` hands a group's samples to the worker processes the moment the group's last response arrives,
so verifiers run while the other groups are still generating; `score` waits for what is left (that
wait is `ScoreCounts.wait_s`, the part of scoring generation did not hide; past `progress_every_s` a
line says how far it is), sets `sample.reward`, and applies the batch rule: more than half the samples
timing out or failing is an error naming the function and a failing sample (rewards/pool.py:check_batch)
instead of a step trained on zeros.

A broken function fails sooner: the pool gives up when the first samples of the run all fail
(rewards/pool.py) and raises that RewardError from every sample not yet scored. `stop_on_failure`
then cancels the generation and raises it at once, and `score` raises it without waiting for the rest
of the batch.

With the in-process backend every rank generates the same groups; only rank 0 scores (a verifier that
times out on one rank but not another would split the ranks' batches) and its rewards reach every rank,
or its failure: every rank then raises RolloutFailed with rank 0's message (rollout/protocol.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Awaitable, Sequence, TypeVar

import torch.distributed as dist

from megatron_gspo import profiling
from megatron_gspo.config import RewardConfig
from megatron_gspo.rewards.pool import RewardPool, Score, check_batch
from megatron_gspo.rollout.protocol import Failed, RolloutFailed, failed_on_rank0
from megatron_gspo.samples import Sample

T = TypeVar("T")


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

    def __init__(self, pool: RewardPool | None, reward: RewardConfig, *, collective: bool = False,
                 progress_every_s: float = 5.0):
        self.pool, self.reward, self.collective = pool, reward, collective
        self.progress_every_s = progress_every_s
        """While `score` waits for rewards, a progress line this often (on the rank with the pool)."""
        self._pending: dict[int, list[Future]] = {}
        self._failure_waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        """What `stop_on_failure` waits on, while it does."""

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
        future = self.pool.submit([sample])[0]
        future.add_done_callback(self._wake_on_failure)
        return future

    def _wake_on_failure(self, future: Future) -> None:
        """(In a pool thread, or inline.) A sample that raised (the pool gave up) wakes `stop_on_failure`."""
        waiter = self._failure_waiter
        if waiter is None or future.cancelled() or future.exception() is None:
            return
        loop, failed = waiter
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(lambda: failed.done() or failed.set_result(None))

    async def stop_on_failure(self, generation: Awaitable[T]) -> T:
        """`await generation` (a backend's generate, with on_group=self.submit), unless the pool gives up on
        the reward function first: then the generation is cancelled and the pool's RewardError raised at
        once, not after every response was generated."""
        task = asyncio.ensure_future(generation)
        if self.pool is None:
            return await task
        loop = asyncio.get_running_loop()
        failed = loop.create_future()
        self._failure_waiter = (loop, failed)
        try:
            if self.pool.failure is None:
                await asyncio.wait([task, failed], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise self.pool.failure
            return task.result()
        except BaseException:
            self._pending.clear()  # the groups submitted so far are never scored
            raise
        finally:
            self._failure_waiter = None
            if not task.done():  # the pool gave up, or this call was cancelled
                task.cancel()
                await asyncio.wait([task])

    async def score(self, groups: Sequence[Sequence[Sample]]) -> ScoreCounts:
        """Set every sample's reward (collective with `collective=True`: rank 0's failure raises RolloutFailed
        on every rank); the counts of this call."""
        start = time.perf_counter()
        rewards: list[list[float]] | Failed | None = None
        counts = ScoreCounts(samples=sum(len(g) for g in groups),
                             truncated=sum(s.finish_reason == "length" for g in groups for s in g))
        if self.pool is not None:
            try:
                rewards = await self._score_here(groups, counts)
            except Exception as error:
                if not self.collective:
                    raise
                rewards = failed_on_rank0("scoring", error)  # the other ranks wait for it below
        if self.collective:
            box = [(rewards, counts.timeouts, counts.errors, counts.unparsed)]
            dist.broadcast_object_list(box, src=0)
            rewards, counts.timeouts, counts.errors, counts.unparsed = box[0]
            if isinstance(rewards, Failed):
                raise RolloutFailed(rewards.message)
        for group, values in zip(groups, rewards):
            for sample, value in zip(group, values):
                sample.set_outcome_reward(value)  # an episode's: on its last turn, summed with its turns' own
        counts.wait_s = time.perf_counter() - start
        profiling.add(profiling.current() + "/reward_wait", counts.wait_s)
        return counts

    async def _score_here(self, groups: Sequence[Sequence[Sample]], counts: ScoreCounts) -> list[list[float]]:
        """The pool's rewards per group, with the failure counts added to `counts` (rank 0)."""
        for group in groups:
            if id(group) not in self._pending:  # a backend that never called on_group
                self.submit(group)
        futures = [self._pending.pop(id(g)) for g in groups]
        await self._wait([f for group in futures for f in group])
        scores = [[f.result() for f in group] for group in futures]
        flat = [s for group in scores for s in group]
        counts.timeouts = sum(s.status == "timeout" for s in flat)
        counts.errors = sum(s.status == "error" for s in flat)
        counts.unparsed = sum(s.status == "unparsed" for s in flat)
        check_batch(flat, [s for g in groups for s in g], self.reward.fn)
        return [[s.value for s in group] for group in scores]

    async def _wait(self, futures: Sequence[Future]) -> None:
        """Until every future is done, with a progress line every progress_every_s; the pool's RewardError
        as soon as a future raises it (the pool gave up on the function)."""
        start = time.monotonic()
        waiting = [f for f in futures if not f.done()]  # none with reward.workers=0
        while waiting:
            done, waiting = await asyncio.to_thread(concurrent.futures.wait, waiting, self.progress_every_s,
                                                    concurrent.futures.FIRST_EXCEPTION)
            for f in done:
                if not f.cancelled() and f.exception() is not None:
                    raise f.exception()
            if waiting:
                workers = self.pool.workers
                print(f"waiting for rewards: {len(futures) - len(waiting)} of {len(futures)} samples scored after "
                      f"{time.monotonic() - start:.0f} s (reward.fn={self.reward.fn}, {workers} "
                      f"worker{'s' * (workers != 1)}, timeout {self.pool.timeout_s:g} s)", flush=True)
