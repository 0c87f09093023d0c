"""Filling a batch of scored groups, optionally with dynamic sampling (DAPO-style).

A group whose G rewards are all equal has zero advantage for every sample (GSPO eq. 6): it costs a
forward/backward and teaches nothing. With `drop_zero_variance=True` such groups are dropped and
more prompts are rolled out until the batch has `num_groups` groups with signal. The first round asks
for ceil(missing * oversample) prompts; later rounds divide that by the fraction of groups that had
signal so far in this call (a policy that is right, or wrong, on almost every prompt needs many
prompts per kept group), at most `max_prompts_per_round` prompts a round. After `max_rounds` rounds
the batch is topped up with dropped zero-signal groups (zero advantage: they change no weight) instead
of failing: late in a run, when nearly every prompt is solved, that is the normal case.

What was dropped, padded and left over is reported, never hidden, and `ScoredBatch.metrics()` (the one
definition of the rollout's metrics) gives the reward of *every* generated sample: the kept groups all have signal, so their mean reward is pulled
towards the middle and is not the policy's reward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, Sequence

from megatron_gspo.rollout.protocol import RolloutStats
from megatron_gspo.rollout.scoring import ScoreCounts, Scorer
from megatron_gspo.samples import Prompt, Sample

GenerateFn = Callable[..., Awaitable[tuple[list[list[Sample]], RolloutStats]]]
"""Rolls out G samples per prompt: a rollout backend's `generate(prompts, on_group=...)` (rollout/backend.py)."""


class PromptsExhausted(RuntimeError):
    """The prompt source ran out before the batch was full."""


@dataclass
class ScoredBatch:
    groups: list[list[Sample]]
    """Exactly `num_groups` groups of G scored samples: kept groups in generation order, then any
    padding groups."""
    dropped_group_ids: list[int] = field(default_factory=list)
    """Zero-variance groups that dynamic sampling dropped (including those later used as padding)."""
    padded_group_ids: list[int] = field(default_factory=list)
    """Dropped zero-variance groups put back to fill the batch after `max_rounds` rounds."""
    surplus_group_ids: list[int] = field(default_factory=list)
    """Groups with signal generated beyond `num_groups` by over-sampling (not used)."""
    rounds: int = 0
    """Generate calls made."""
    rollout_stats: list[RolloutStats] = field(default_factory=list)
    """What each generate call returned besides the groups."""
    generated_rewards: list[list[float]] = field(default_factory=list)
    """The rewards of every generated group (kept, dropped or surplus), in generation order."""
    score_counts: ScoreCounts = field(default_factory=ScoreCounts)
    """Timeouts, errors, unparsed and truncated responses over every generated sample, and the wait for rewards."""

    @property
    def num_dropped(self) -> int:
        return len(self.dropped_group_ids)

    def metrics(self) -> dict[str, float]:
        """The policy's reward over every sample generated this step, and the trained batch's.

        reward_mean / reward_std / zero_signal_group_fraction: over all generated samples and groups
        (what the policy does; equal to the trained batch's without dynamic sampling).
        reward_mean_trained / zero_signal_group_fraction_trained: over the groups that train.
        """
        flat = [r for group in self.generated_rewards for r in group]
        n = max(len(flat), 1)
        mean = sum(flat) / n
        trained = [s.reward for group in self.groups for s in group]
        zero = sum(not _varies(group) for group in self.generated_rewards)
        versions = sorted({s.weight_version for s in self.samples if s.weight_version is not None})
        stats, counts = self.rollout_stats, self.score_counts
        return {"reward/mean": mean,
                "reward/std": math.sqrt(sum((r - mean) ** 2 for r in flat) / n),
                "reward/zero_signal_group_fraction": zero / max(len(self.generated_rewards), 1),
                "reward/mean_trained": sum(trained) / max(len(trained), 1),
                "reward/zero_signal_group_fraction_trained":
                    sum(not has_signal(g) for g in self.groups) / max(len(self.groups), 1),
                "rollout/groups_generated": float(len(self.generated_rewards)),
                "rollout/dynamic_sampling_padded_groups": float(len(self.padded_group_ids)),
                "rollout/dynamic_sampling_dropped_groups": float(self.num_dropped),
                **response_length_metrics([s.model_tokens for s in self.samples]),
                **episode_metrics(stats),
                **partial_rollout_metrics(self.samples),
                "rollout/weight_version": ",".join(versions),
                "reward/timeouts": float(counts.timeouts),
                "reward/errors": float(counts.errors),
                "reward/unparsed_fraction": counts.unparsed / max(counts.samples, 1),
                "rollout/response_truncated_fraction": counts.truncated / max(counts.samples, 1),
                "time/reward_wait_s": counts.wait_s,
                # over every round of dynamic sampling: all response tokens / all generation time
                "rollout/tokens_per_s": (sum(st.response_tokens for st in stats)
                                         / max(sum(st.elapsed_s for st in stats), 1e-9))}

    @property
    def samples(self) -> list[Sample]:
        """The trained samples, group after group."""
        return [s for group in self.groups for s in group]

    @property
    def rewards(self) -> list[float]:
        """The trained samples' rewards, in the order of `samples`."""
        return [s.reward for s in self.samples]


def response_length_metrics(response_lengths: Sequence[int]) -> dict[str, float]:
    """The trained batch's response lengths: the model's tokens (an episode's environment tokens left out)."""
    return {"rollout/response_length_mean": sum(response_lengths) / max(len(response_lengths), 1),
            "rollout/response_length_max": float(max(response_lengths, default=0))}


def episode_metrics(stats: Sequence[RolloutStats]) -> dict[str, float]:
    """Multi-turn episodes over every generate call of the step (dynamic sampling's dropped groups too):
    model turns and tool calls per episode, failed tool calls (each became an error message to the model), and
    the share of response tokens that were the environment's. {} without episodes."""
    episodes = sum(st.episodes for st in stats)
    if not episodes:
        return {}
    env = sum(st.env_tokens for st in stats)
    return {"rollout/turns_mean": sum(st.turns for st in stats) / episodes,
            "rollout/tool_calls_mean": sum(st.tool_calls for st in stats) / episodes,
            "rollout/tool_errors": float(sum(st.tool_errors for st in stats)),
            "rollout/env_token_fraction": env / max(env + sum(st.response_tokens for st in stats), 1)}


def partial_rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """The trained batch's responses continued after a weight push (rollout.partial_rollout): their share,
    and the share of response tokens in stale prefixes (generated by older weights, not trained)."""
    tokens = sum(len(s.response_ids) for s in samples)
    return {"rollout/partial_fraction": sum(s.stale_prefix > 0 for s in samples) / max(len(samples), 1),
            "rollout/stale_prefix_fraction": sum(s.stale_prefix for s in samples) / max(tokens, 1)}


def _varies(rewards: Sequence[float]) -> bool:
    return max(rewards) != min(rewards)


def has_signal(group: Sequence[Sample]) -> bool:
    """False when all rewards of the group are equal (every advantage would be exactly 0)."""
    rewards = [s.reward for s in group]
    if any(r is None for r in rewards):
        raise ValueError(f"group {group[0].group_id} has unscored samples")
    return _varies(rewards)


async def collect_scored_groups(generate: GenerateFn, prompts: Iterator[Prompt], num_groups: int,
                                scorer: Scorer, *, drop_zero_variance: bool = False,
                                oversample: float = 1.5, max_rounds: int = 4,
                                max_prompts_per_round: int | None = None) -> ScoredBatch:
    """Roll out, score and (optionally) filter groups until `num_groups` are kept.

    Each group goes to `scorer` (rollout/scoring.py) as it finishes generating; a round's rewards are
    awaited once its generation returns (a reward function the pool gives up on stops the generation).

    Without dynamic sampling: one round of `num_groups` prompts. With it: round 1 asks for
    ceil(missing * oversample) prompts, later rounds for ceil(missing * oversample / f), f = the
    fraction of this call's groups that had signal (at least 1/16), capped at max_prompts_per_round
    (default 4 * num_groups); after max_rounds rounds, dropped groups pad the batch (latest first).
    Raises PromptsExhausted if the prompts run out before the batch is full (or padded).
    """
    if num_groups < 1 or oversample < 1.0 or max_rounds < 1:
        raise ValueError("need num_groups >= 1, oversample >= 1 and max_rounds >= 1")
    cap = max(max_prompts_per_round or 4 * num_groups, 1)
    batch = ScoredBatch(groups=[])
    dropped: list[list[Sample]] = []
    with_signal = 0
    while len(batch.groups) < num_groups:
        if batch.rounds == max_rounds:
            pad = dropped[::-1][:num_groups - len(batch.groups)]
            batch.groups += pad
            batch.padded_group_ids = [g[0].group_id for g in pad]
            if len(batch.groups) < num_groups:  # only when every dropped group was already used up
                raise RuntimeError(f"dynamic sampling: only {len(batch.groups)} of {num_groups} groups "
                                   f"after {max_rounds} rounds")
            break
        missing = num_groups - len(batch.groups)
        if not drop_zero_variance:
            want = missing
        else:
            seen = len(batch.generated_rewards)
            fraction = 1.0 if seen == 0 else max(with_signal / seen, 1 / 16)
            want = min(math.ceil(missing * oversample / fraction), cap)
        round_prompts = [p for _, p in zip(range(want), prompts)]
        if not round_prompts:
            raise PromptsExhausted(f"prompts ran out with {len(batch.groups)} of {num_groups} groups "
                                   f"({batch.num_dropped} zero-variance groups dropped)")
        groups, stats = await scorer.stop_on_failure(generate(round_prompts, on_group=scorer.submit))
        batch.score_counts.add(await scorer.score(groups))
        batch.rounds += 1
        batch.rollout_stats.append(stats)
        for group in groups:
            batch.generated_rewards.append([s.reward for s in group])
            signal = has_signal(group)
            with_signal += signal
            if drop_zero_variance and not signal:
                batch.dropped_group_ids.append(group[0].group_id)
                dropped.append(group)
            elif len(batch.groups) < num_groups:
                batch.groups.append(group)
            else:
                batch.surplus_group_ids.append(group[0].group_id)
    return batch
