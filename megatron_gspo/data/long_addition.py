"""A task with long responses: two-digit addition worked column by column, scored on its final line.

A prompt "37+45" (rendered "37+45=" by the tiny tokenizer's chat template) has the worked response

    ones: 7+5+0=12, write 2, carry 1
    tens: 3+4+1=8, write 8, carry 0
    answer: 82

74 tokens with the tiny tokenizer, EOS included (the same for every problem of the task). The verifier
(`final_answer`, rewards/verifiers.py) reads only the last "answer: N" line: the steps are the policy's
own business, and a response that states no answer scores 0 and is counted as unparsed.

The problems are every (a, b) with two digits each and a two-digit sum (10 <= a, b and a + b <= 99):
3240, split once by a seeded shuffle into disjoint train and test files. The answer always has two
digits, so a model that knows only the format and writes random digits (the warm start,
`random_worked_response`) is right 1 time in 100: low, but GSPO still sees a right answer now and then.
"""
from __future__ import annotations

import random
from pathlib import Path

from megatron_gspo.data.splits import shuffled_split, write_shuffled_split

PROBLEMS = tuple((a, b) for a in range(10, 100) for b in range(10, 100 - a))
"""The 3240 (a, b) with 10 <= a, b and a + b <= 99."""

COLUMNS = ("ones", "tens")
"""The names of the worked lines, least significant digit first."""


def column_line(name: str, x: int, y: int, carry_in: int, total: int) -> str:
    """One worked line: "ones: 7+5+0=12, write 2, carry 1" (the written digit and the carry follow from
    `total`, whether or not `total` is x + y + carry_in)."""
    return f"{name}: {x}+{y}+{carry_in}={total}, write {total % 10}, carry {total // 10}"


def worked_response(a: int, b: int) -> str:
    """The correct response to "a+b": one line per column (COLUMNS), then "answer: a+b"."""
    if not (0 <= a and 0 <= b and a + b <= 99):
        raise ValueError(f"worked_response: need 0 <= a, b and a + b <= 99, got {a}+{b}")
    lines, carry = [], 0
    for name, x, y in zip(COLUMNS, reversed(f"{a:02d}"), reversed(f"{b:02d}")):
        total = int(x) + int(y) + carry
        lines.append(column_line(name, int(x), int(y), carry, total))
        carry = total // 10
    return "\n".join(lines + [f"answer: {a + b}"])


def random_worked_response(rng: random.Random) -> str:
    """A response in the worked format whose arithmetic is random: the warm start's target.

    The digits that addition decides are drawn uniformly: each column's two digits, the ones column's
    written digit and carry, the tens column's written digit (its carry is 0, as in every answer of the
    task). What the format itself decides is kept: the written digit and carry follow from the stated
    total, the ones carry is the tens line's carry-in, and the answer is the written digits. The stated
    answer is therefore a uniform random two-digit string ("05" included): right 1 time in 100.
    """
    ones_write, ones_carry, tens_write = rng.randrange(10), rng.randrange(2), rng.randrange(10)
    lines = [column_line("ones", rng.randrange(10), rng.randrange(10), 0, 10 * ones_carry + ones_write),
             column_line("tens", rng.randrange(10), rng.randrange(10), ones_carry, tens_write)]
    return "\n".join(lines + [f"answer: {tens_write}{ones_write}"])


def long_addition_row(a: int, b: int) -> dict:
    """One prompt row: {"prompt": [{"role": "user", "content": "a+b"}], "answer": "a+b's value"}."""
    return {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b)}


def write_long_addition_data(out_dir: str | Path, *, seed: int = 0, test_problems: int = 200) -> tuple[Path, Path]:
    """Write train.jsonl (3240 - test_problems rows) and test.jsonl (test_problems rows) into `out_dir`.

    The same seed gives byte-identical files; files are written under a temporary name and renamed.
    Returns (train path, test path).
    """
    return write_shuffled_split(out_dir, PROBLEMS, long_addition_row, test_count=test_problems, seed=seed, what="test_problems")


def split_problems(*, seed: int = 0, test_problems: int = 200) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train, test) problems exactly as write_long_addition_data writes them for the same arguments (the
    committed examples/data/long_addition/ is seed 0, 200 test problems)."""
    return shuffled_split(PROBLEMS, test_count=test_problems, seed=seed, what="test_problems")
