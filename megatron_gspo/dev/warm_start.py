"""Supervised format warm-start of the arithmetic demo (megatron_gspo/data/arithmetic.py).

A randomly initialised tiny model puts ~1.4% of its next-token mass on the ten digits, so almost
every group would be all-zero reward (no signal). `warm_start_format` therefore teaches it the
*format only* by supervised training on "a+b=" -> a uniformly random digit + EOS: afterwards it
answers with one digit, right about 1 time in 10 (chance). Everything above chance is GSPO's.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_gspo.data.arithmetic import PAIRS


def warm_start_format(hf_dir: str | Path, *, steps: int = 150, batch_size: int = 64, lr: float = 3e-3,
                      seed: int = 0) -> float:
    """Supervised format warm-start, in place: "a+b=" -> random digit + EOS (see module doc).

    Returns the fraction of the 55 prompts (data/arithmetic.py PAIRS) whose greedy answer is a single digit.
    """
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
        prompts = torch.tensor([tok(f"{a}+{b}=")["input_ids"] for a, b in PAIRS])
        first = model(input_ids=prompts).logits[:, -1].argmax(-1)
    model.save_pretrained(hf_dir)
    return sum(int(t) in digits for t in first.tolist()) / len(first)
