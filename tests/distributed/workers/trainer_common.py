"""Shared pieces of the distributed test workers: their `key=value` arguments (layout and options), a tiny
dense Qwen3 and synthetic responses."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from megatron_gspo.config import (CorrectionConfig, GSPOConfig, ModelConfig, OptimizerConfig, ParallelConfig, RolloutConfig,
                                  TrainConfig)
from megatron_gspo.loss.advantages import group_advantages
from megatron_gspo.model.presets import TINY_DENSE
from megatron_gspo.training.old_logprobs import StepSettings, old_logprobs_source
from megatron_gspo.training.packing import Response
from megatron_gspo.training.setup import build_policy

SHAPE = TINY_DENSE

RECOMPUTE = old_logprobs_source(GSPOConfig(old_logprobs="recompute"), routing=None)
"""pi_old recomputed (fused) for a model whose routing is not tracked."""
FROM_ROLLOUT = old_logprobs_source(GSPOConfig(old_logprobs="rollout"), routing=None)
"""pi_old = the responses' rollout log-probs."""


def steps(loss, num_minibatches: int = 1, max_tokens_per_microbatch: int = 8192,
          pack_sequences: bool = False, correction: CorrectionConfig = CorrectionConfig()) -> StepSettings:
    """StepSettings with the sizes these tests use unless they say otherwise."""
    return StepSettings(loss, num_minibatches=num_minibatches, max_tokens_per_microbatch=max_tokens_per_microbatch,
                        pack_sequences=pack_sequences, correction=correction)


def parallel_layout(**sizes: int) -> ParallelConfig:
    """A ParallelConfig with these sizes (tp, pp, cp, ep, ...) whose dp takes the rest of torchrun's world."""
    model_parallel = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    return ParallelConfig(**sizes, dp=int(os.environ["WORLD_SIZE"]) // model_parallel)


LAYOUT_KEYS = ("tp", "pp", "cp", "ep")


def worker_args(args: Sequence[str], **defaults: int | bool | str) -> tuple[ParallelConfig, SimpleNamespace]:
    """A worker's `key=value` arguments -> (its layout, its other options).

    tp, pp, cp and ep (1 where absent) make the layout, whose dp takes the rest of torchrun's world
    (`parallel_layout`). The keys of `defaults` are the worker's options: each is read as the type of
    its default (a bool as 0 or 1) and takes that default where absent. Any other key is an error that
    names it. E.g. under 4 processes `worker_args(["ep=2", "packed=1"], max_tokens=8192, packed=False)`
    gives (ParallelConfig(ep=2, dp=4), namespace(max_tokens=8192, packed=True)).
    """
    given: dict[str, str] = {}
    for arg in args:
        key, sep, text = arg.partition("=")
        if not sep:
            raise ValueError(f"worker argument {arg!r} is not key=value")
        if key not in LAYOUT_KEYS and key not in defaults:
            known = ", ".join([*LAYOUT_KEYS, *defaults])
            raise ValueError(f"unknown worker argument {key!r} ({arg!r}); known: {known}")
        if key in given:
            raise ValueError(f"worker argument {key!r} given twice")
        given[key] = text
    layout = parallel_layout(**{key: _parse(key, given[key], 1) for key in LAYOUT_KEYS if key in given})
    options = {key: _parse(key, given[key], default) if key in given else default
               for key, default in defaults.items()}
    return layout, SimpleNamespace(**options)


def _parse(key: str, text: str, default: int | bool | str) -> int | bool | str:
    """`text` read as the type of `default`."""
    if isinstance(default, bool):
        if text not in ("0", "1"):
            raise ValueError(f"worker argument {key} must be 0 or 1, got {text!r}")
        return text == "1"
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"worker argument {key} must be an integer, got {text!r}") from None
    return text


def tiny_model(layout: ParallelConfig, *, pgs, seed: int, lr: float = 1e-3, total_steps: int = 100, preset: str = "tiny_dense",
               distributed_optimizer: bool = False, **optimizer):
    """(model chunks, Adam, scheduler), initialised identically for the same seed, via training.setup."""
    config = TrainConfig(
        model=ModelConfig(preset=preset, dtype="float32"),
        parallel=dataclasses.replace(layout, distributed_optimizer=distributed_optimizer),
        gspo=GSPOConfig(num_minibatches=1, group_size=4, prompts_per_step=4),
        rollout=RolloutConfig(backend="megatron"),
        optimizer=OptimizerConfig(**{"lr": lr, "clip_grad": 0.0, **optimizer}),
        seed=seed, num_steps=total_steps)
    policy = build_policy(config, pgs)
    return policy.model, policy.optimizer, policy.scheduler


def synthetic_responses(seed: int, n: int, group_size: int = 4) -> list[Response]:
    """n responses in groups of group_size: prompts of 3-8 tokens, responses of 0-20 (one empty)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    advantages = group_advantages(rewards, group_size).advantages_R.tolist()
    responses = []
    for i in range(n):
        prompt = torch.randint(1, SHAPE.vocab_size, (int(torch.randint(3, 9, (), generator=g)),), generator=g)
        length = 0 if i == 1 else int(torch.randint(1, 21, (), generator=g))
        response = torch.randint(1, SHAPE.vocab_size, (length,), generator=g)
        responses.append(Response(prompt.tolist(), response.tolist(), advantages[i]))
    return responses


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for chunk in model for n, p in chunk.module.named_parameters()}
