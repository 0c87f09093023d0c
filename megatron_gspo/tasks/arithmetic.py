"""Single-digit addition, the CPU demo's verifiable task: prompt "3+4=", answer "7".

Reward: exact match of the response text before EOS with the answer digit ("7" -> 1.0; "7+1",
"12" or an empty response -> 0.0). Prompts are drawn uniformly from the 55 pairs whose sum is one
digit, which the tiny model can learn in about a hundred GSPO steps.

A randomly initialised tiny model puts ~1.4% of its next-token mass on the ten digits, so almost
every group would be all-zero reward (no signal). `warm_start_format` therefore teaches it the
*format only* by supervised training on "a+b=" -> a uniformly random digit + EOS: afterwards it
answers with one digit, right about 1 time in 10 (chance). Everything above chance is GSPO's.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Iterator

from megatron_gspo.rollout.rewards import exact_match
from megatron_gspo.types import Prompt, Sample


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


def warm_start_format(hf_dir: str | Path, *, steps: int = 150, batch_size: int = 64, lr: float = 3e-3,
                      seed: int = 0) -> float:
    """Supervised format warm-start, in place: "a+b=" -> random digit + EOS (see module doc).

    Returns the fraction of greedy answers that are a single digit afterwards.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(batch_size):
            a = rng.randint(0, 9)
            rows.append(tok(f"{a}+{rng.randint(0, 9 - a)}=")["input_ids"] + [rng.choice(digits), tok.eos_token_id])
        ids = torch.tensor(rows)  # all prompts are 4 tokens: no padding
        labels = ids.clone()
        labels[:, :4] = -100  # train the answer and EOS only
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        prompts = torch.tensor([tok(problem(seed, i)[0])["input_ids"] for i in range(200)])
        first = model(input_ids=prompts).logits[:, -1].argmax(-1)
    model.save_pretrained(hf_dir)
    return sum(int(t) in digits for t in first.tolist()) / len(first)
