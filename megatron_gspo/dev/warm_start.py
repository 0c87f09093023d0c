"""Supervised format warm starts of the demo tasks: the format is taught, the answers are random.

A randomly initialised tiny model writes no task's format, so every group would be all-zero reward (no
signal). A warm start therefore teaches the *format only*, by supervised training on responses whose
answers are random, so the reward starts at chance and everything above it is GSPO's:

- arithmetic (megatron_gspo/data/arithmetic.py): "a+b=" -> a uniformly random digit + EOS. A random
  model puts ~1.4% of its next-token mass on the ten digits; afterwards it answers with one digit, right
  about 1 time in 10.
- long_addition (megatron_gspo/data/long_addition.py): "a+b=" -> the worked column-by-column format with
  random arithmetic (`random_worked_response`) + EOS: afterwards it writes the two lines and an
  "answer: NN" line, right about 1 time in 100.
"""
from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_gspo.data.arithmetic import PAIRS
from megatron_gspo.data.long_addition import PROBLEMS, random_worked_response
from megatron_gspo.rewards import Unparsed
from megatron_gspo.rewards.verifiers import final_answer
from megatron_gspo.samples import Sample

Example = tuple[list[int], list[int]]
"""(prompt token ids, target token ids): the loss is on the target only."""


@contextlib.contextmanager
def _one_thread():
    """Torch on one thread meanwhile. The tiny model's matmuls are too small to split, and on 2 cores
    shared with other jobs a second OpenMP thread mostly waits for its turn: `tiny-model --warm-start
    arithmetic` took 137 s wall (71 s CPU) with torch's default 2 threads, 30 s (12 s CPU) with one,
    at load ~6; the weights are bitwise the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fit(model, examples: Callable[[], Example], *, steps: int, batch_size: int, lr: float, pad_id: int) -> None:
    """`steps` AdamW steps on batches of `batch_size` examples, cross-entropy on the targets only.
    Rows of unequal length are right-padded and masked. A batch of equal rows goes in without a mask, as
    the arithmetic warm start always did: a mask takes another attention path, and its weights would change."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = [examples() for _ in range(batch_size)]
        width = max(len(p) + len(t) for p, t in batch)
        ids = torch.full((batch_size, width), pad_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (prompt, target) in enumerate(batch):
            n = len(prompt) + len(target)
            ids[row, :n] = torch.tensor(prompt + target)
            labels[row, len(prompt):n] = torch.tensor(target)
            mask[row, :n] = 1
        padded = bool((mask == 0).any())
        loss = model(input_ids=ids, labels=labels, attention_mask=mask if padded else None).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@_one_thread()
def warm_start_format(hf_dir: str | Path, *, steps: int = 150, batch_size: int = 64, lr: float = 3e-3,
                      seed: int = 0) -> float:
    """Supervised format warm-start of the arithmetic task, in place: "a+b=" -> random digit + EOS.

    Returns the fraction of the 55 prompts (data/arithmetic.py PAIRS) whose greedy answer is a single digit.
    """
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def example() -> Example:
        a = rng.randint(0, 9)
        return tok(f"{a}+{rng.randint(0, 9 - a)}=")["input_ids"], [rng.choice(digits), tok.eos_token_id]

    _fit(model, example, steps=steps, batch_size=batch_size, lr=lr, pad_id=tok.eos_token_id)
    with torch.no_grad():
        prompts = torch.tensor([tok(f"{a}+{b}=")["input_ids"] for a, b in PAIRS])
        first = model(input_ids=prompts).logits[:, -1].argmax(-1)
    model.save_pretrained(hf_dir)
    return sum(int(t) in digits for t in first.tolist()) / len(first)


@_one_thread()
def warm_start_long_addition(hf_dir: str | Path, *, steps: int = 400, batch_size: int = 32, lr: float = 6e-3,
                             seed: int = 0, check_prompts: int = 64) -> tuple[float, float]:
    """Supervised format warm-start of the long_addition task, in place: "a+b=" -> the worked format with
    random arithmetic (data/long_addition.py random_worked_response) + EOS, on random problems.

    Returns (format rate, accuracy) of greedy responses to `check_prompts` seeded problems: the fraction
    that states an answer the `final_answer` verifier reads, and the fraction right (chance: ~0.01).
    """
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def example() -> Example:
        a, b = rng.choice(PROBLEMS)
        return (tok(f"{a}+{b}=")["input_ids"],
                tok(random_worked_response(rng))["input_ids"] + [tok.eos_token_id])

    _fit(model, example, steps=steps, batch_size=batch_size, lr=lr, pad_id=tok.eos_token_id)
    model.save_pretrained(hf_dir)
    problems = random.Random(seed + 1).sample(PROBLEMS, check_prompts)
    texts = greedy_responses(model, tok, [f"{a}+{b}=" for a, b in problems], max_new_tokens=96)
    scores = [_score(text, str(a + b)) for text, (a, b) in zip(texts, problems)]
    return (sum(s is not None for s in scores) / len(scores), sum(s == 1.0 for s in scores) / len(scores))


def greedy_responses(model, tok, prompts: list[str], *, max_new_tokens: int) -> list[str]:
    """The greedy response text of each prompt (prompts of equal token length: no padding)."""
    ids = torch.tensor([tok(p)["input_ids"] for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)


def _score(text: str, answer: str) -> float | None:
    """final_answer's reward, None when the response states no answer."""
    sample = Sample(group_id=0, sample_index=0, prompt_ids=[], response_ids=[], rollout_logprobs=[],
                    finish_reason="stop", response_text=text, answer=answer)
    try:
        return final_answer(sample)
    except Unparsed:
        return None
