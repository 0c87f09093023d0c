"""Single-digit addition, the CPU demo's verifiable task: prompt "3+4=", answer "7".

Reward: exact match of the response text before EOS with the answer digit ("7" -> 1.0; "7+1",
"12" or an empty response -> 0.0). Prompts are drawn uniformly from the 55 pairs whose sum is one
digit, which the tiny model can learn in about a hundred GSPO steps.

A randomly initialised tiny model puts ~1.4% of its next-token mass on the ten digits, so almost
every group would be all-zero reward (no signal); the demo therefore warm-starts the *format only*
first (megatron_gspo/dev/warm_start.py): afterwards the model answers with one digit, right about 1
time in 10 (chance). Everything above chance is GSPO's.
"""
from __future__ import annotations

import random
from typing import Callable, Iterator

from megatron_gspo.rollout.rewards import exact_match
from megatron_gspo.samples import Prompt, Sample


PAIRS = tuple((a, b) for a in range(10) for b in range(10 - a))
"""The 55 (a, b) with a + b <= 9."""


def problem(seed: int, index: int) -> tuple[str, str]:
    """The index-th ("a+b=", "a+b") of the stream: a pure function, so resuming needs only `index`.

    Uniform over the 55 pairs. (Drawing a, then b <= 9 - a, would make "9+0=" ten times as frequent as
    "0+5=", and "9" the answer of 29% of prompts: the policy then learns the frequent prompts and
    settles on a frequent answer for the rare ones, and the reward mostly measures the frequent ones.)
    """
    a, b = random.Random(seed * 1_000_003 + index).choice(PAIRS)
    return f"{a}+{b}=", str(a + b)


class ArithmeticTask:
    def __init__(self, encode: Callable[[str], list[int]], seed: int):
        self.encode = encode
        self.seed = seed

    def prompts(self, start: int) -> Iterator[Prompt]:
        """Prompts from stream position `start` on; group_id is the position (unique over the run)."""
        index = start
        while True:
            text, answer = problem(self.seed, index)
            yield Prompt(group_id=index, prompt_ids=self.encode(text), prompt=text, answer=answer)
            index += 1

    @staticmethod
    def reward(sample: Sample) -> float:
        return exact_match(sample)
