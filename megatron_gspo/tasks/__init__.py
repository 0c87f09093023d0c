"""Synthetic verifiable tasks: a prompt stream with reference answers and a reward function, by name."""
from __future__ import annotations

from megatron_gspo.tasks.arithmetic import ArithmeticTask

TASKS = {"arithmetic": ArithmeticTask}


def load_task(name: str, encode, seed: int):
    """The task `name` (see TASKS) with prompts encoded by `encode(text) -> ids`."""
    if name not in TASKS:
        raise ValueError(f"rollout.task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](encode=encode, seed=seed)
