"""Filling a batch of scored groups, optionally with dynamic sampling (DAPO-style).

A group whose G rewards are all equal has zero advantage for every sample (GSPO eq. 6): it costs a
forward/backward and teaches nothing. With `drop_zero_variance=True` such groups are dropped and
more prompts are rolled out (over-sampling by `oversample`) until the batch has `num_groups` groups
with signal; what was dropped is reported, never hidden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, Sequence

from megatron_gspo.rollout.rewards import RewardFn, score_samples
from megatron_gspo.types import Prompt, Sample

GenerateFn = Callable[[Sequence[Prompt]], Awaitable[tuple[list[list[Sample]], object]]]
"""Rolls out G samples per prompt: e.g. functools.partial(RolloutClient.generate, n=G, sampling=...)."""


class PromptsExhausted(RuntimeError):
    """The prompt source ran out before the batch was full."""


@dataclass
class ScoredBatch:
    groups: list[list[Sample]]
    """Exactly `num_groups` groups of G scored samples, in generation order."""
    dropped_group_ids: list[int] = field(default_factory=list)
    """Zero-variance groups that dynamic sampling dropped."""
    surplus_group_ids: list[int] = field(default_factory=list)
    """Groups with signal generated beyond `num_groups` by over-sampling (not used)."""
    rounds: int = 0
    """Generate calls made."""
    rollout_stats: list = field(default_factory=list)
    """What each generate call returned besides the groups (RolloutStats for the HTTP client)."""

    @property
    def num_dropped(self) -> int:
        return len(self.dropped_group_ids)


def has_signal(group: Sequence[Sample]) -> bool:
    """False when all rewards of the group are equal (every advantage would be exactly 0)."""
    rewards = [s.reward for s in group]
    if any(r is None for r in rewards):
        raise ValueError(f"group {group[0].group_id} has unscored samples")
    return max(rewards) != min(rewards)


async def collect_scored_groups(generate: GenerateFn, prompts: Iterator[Prompt], num_groups: int,
                                reward_fn: RewardFn, *, drop_zero_variance: bool = False,
                                oversample: float = 1.5, max_rounds: int = 10,
                                reward_timeout_s: float = 10.0) -> ScoredBatch:
    """Roll out, score and (optionally) filter groups until `num_groups` are kept.

    Each round asks for ceil(missing * oversample) prompts (only `missing` without dynamic sampling).
    Raises PromptsExhausted if the prompts run out, RuntimeError after max_rounds rounds.
    """
    if num_groups < 1 or oversample < 1.0 or max_rounds < 1:
        raise ValueError("need num_groups >= 1, oversample >= 1 and max_rounds >= 1")
    batch = ScoredBatch(groups=[])
    while len(batch.groups) < num_groups:
        if batch.rounds == max_rounds:
            raise RuntimeError(f"dynamic sampling: only {len(batch.groups)} of {num_groups} groups with signal "
                               f"after {max_rounds} rounds ({batch.num_dropped} zero-variance groups dropped)")
        missing = num_groups - len(batch.groups)
        want = math.ceil(missing * oversample) if drop_zero_variance else missing
        round_prompts = [p for _, p in zip(range(want), prompts)]
        if not round_prompts:
            raise PromptsExhausted(f"prompts ran out with {len(batch.groups)} of {num_groups} groups "
                                   f"({batch.num_dropped} zero-variance groups dropped)")
        groups, stats = await generate(round_prompts)
        batch.rounds += 1
        batch.rollout_stats.append(stats)
        for group in groups:
            score_samples(group, reward_fn, timeout_s=reward_timeout_s)
            if drop_zero_variance and not has_signal(group):
                batch.dropped_group_ids.append(group[0].group_id)
            elif len(batch.groups) < num_groups:
                batch.groups.append(group)
            else:
                batch.surplus_group_ids.append(group[0].group_id)
    return batch
