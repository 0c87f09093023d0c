"""Held-out evaluation: k responses per prompt of each eval dataset, scored by the training reward.

    results = await evaluate(generate, {"aime24": prompts}, scorer, sampling, k=32)
    results["eval/aime24/mean@32"]      # average pass@1 over the 32 samples (the GSPO paper's AIME'24 number)

Per dataset NAME, with k = eval.samples_per_prompt:
- `eval/NAME/mean@k`: the mean reward over all k samples of every prompt. With a 0/1 verifier this is
  the average pass@1 over k samples, the measure the GSPO paper reports (AIME'24: k = 32).
- `eval/NAME/pass@k`: the unbiased pass@k estimator (Chen et al. 2021) averaged over prompts; a sample
  is correct when its reward is > 0. With n = k samples per prompt it is the fraction of prompts with at
  least one correct sample.
- `eval/NAME/response_length`: mean response length in tokens (the model's: an episode's environment
  tokens left out); `eval/NAME/truncated_fraction`: the share cut by max_new_tokens (or, in an episode, the
  context length); `eval/NAME/prompts`: how many prompts were evaluated.
- Multi-turn episodes (rollout.tools / rollout.episode_fn: evaluation runs the same episode):
  `eval/NAME/turns_mean` and `eval/NAME/tool_calls_mean` per sample, `eval/NAME/tool_errors` in all.
"""
from __future__ import annotations

import math
import time
from typing import Awaitable, Callable, Mapping, Sequence

from megatron_gspo.config import SamplingConfig, TrainConfig
from megatron_gspo.samples import Prompt, Sample


def eval_sampling(config: TrainConfig) -> SamplingConfig:
    """How eval responses are sampled: eval.temperature / top_p / max_new_tokens (default the training
    sampling's max_new_tokens), the rest as in training."""
    e, s = config.eval, config.sampling
    return SamplingConfig(temperature=e.temperature, top_p=e.top_p, top_k=s.top_k,
                          max_new_tokens=e.max_new_tokens or s.max_new_tokens, stop_token_ids=s.stop_token_ids,
                          stop=s.stop)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct) from n samples, c of them correct:
    1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_metrics(name: str, groups: Sequence[Sequence[Sample]], k: int) -> dict[str, float]:
    """The metrics of one dataset's scored groups (k samples each); see the module doc."""
    if not groups:
        raise ValueError(f"eval dataset {name!r}: no prompts were evaluated")
    rewards = [[s.reward for s in g] for g in groups]
    if any(r is None for rs in rewards for r in rs):
        raise ValueError(f"eval dataset {name!r}: unscored samples")
    if any(len(rs) != k for rs in rewards):
        raise ValueError(f"eval dataset {name!r}: every prompt needs k={k} samples")
    samples = [s for g in groups for s in g]
    prefix = f"eval/{name}"
    return {f"{prefix}/mean@{k}": sum(sum(rs) for rs in rewards) / (k * len(rewards)),
            f"{prefix}/pass@{k}": sum(pass_at_k(k, sum(r > 0 for r in rs), k) for rs in rewards) / len(rewards),
            f"{prefix}/response_length": sum(s.model_tokens for s in samples) / len(samples),
            f"{prefix}/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
            f"{prefix}/prompts": float(len(groups)),
            **({f"{prefix}/turns_mean": sum(len(s.turns) for s in samples) / len(samples),
                f"{prefix}/tool_calls_mean": sum(len(s.tool_calls) for s in samples) / len(samples),
                f"{prefix}/tool_errors": float(sum(c.error is not None for s in samples for c in s.tool_calls))}
               if samples[0].turns is not None else {})}


Generate = Callable[..., Awaitable[tuple[list[list[Sample]], object]]]
"""A rollout backend's `generate(prompts, n=, sampling=, on_group=)` (rollout/backend.py)."""


async def evaluate(generate: Generate, datasets: Mapping[str, Sequence[Prompt]], scorer, sampling: SamplingConfig,
                   k: int) -> dict[str, float]:
    """Every dataset's prompts, k samples each with `sampling`, scored by `scorer`
    (rollout/scoring.py) as the groups finish; the metrics of all datasets, and `eval/time_s`."""
    start = time.perf_counter()
    metrics: dict[str, float] = {}
    for name, prompts in datasets.items():
        generation = generate(list(prompts), n=k, sampling=sampling, on_group=scorer.submit)
        groups, _ = await scorer.stop_on_failure(generation)  # a reward function the pool gives up on stops it
        await scorer.score(groups)
        metrics.update(eval_metrics(name, groups, k))
    metrics["eval/time_s"] = time.perf_counter() - start
    return metrics
