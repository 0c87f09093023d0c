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

Task long_addition_mixed spreads the response length: sums of two operands of the same width, 1 to 4 digits
(MIXED_PROBLEMS: the 100 one-digit pairs 0..9 and 300 seeded pairs of each wider width), worked the same way
with one line per column ("hundreds", "thousands" follow "tens"; a carry out of the last column is the
answer's extra digit). A correct response is 42, 74, 110-111 or 148-149 tokens for widths 1-4, so the ratio
spreads by response length (loss/log_ratio_*_std/len_A-B) have several buckets to compare. Its test split
holds out `test_per_width` problems of each width.
"""
from __future__ import annotations

import random
from pathlib import Path

from megatron_gspo.data.splits import shuffled_split, write_shuffled_split, write_split

PROBLEMS = tuple((a, b) for a in range(10, 100) for b in range(10, 100 - a))
"""The 3240 (a, b) with 10 <= a, b and a + b <= 99."""

COLUMNS = ("ones", "tens", "hundreds", "thousands")
"""The names of the worked lines, least significant digit first (long_addition uses the first two)."""

MIXED_WIDTHS = (1, 2, 3, 4)
MIXED_PER_WIDTH = 300
"""long_addition_mixed: operand widths, and the problems drawn of each width wider than 1 (width 1 has 100)."""


def _mixed_problems() -> tuple[tuple[int, int], ...]:
    """Width 1: every (a, b) with 0 <= a, b <= 9; width w > 1: MIXED_PER_WIDTH distinct (a, b) of two w-digit
    numbers, drawn by random.Random(w) (fixed: the problems are the task, the split seed only splits them)."""
    problems = [(a, b) for a in range(10) for b in range(10)]
    for width in MIXED_WIDTHS[1:]:
        low, high = 10 ** (width - 1), 10 ** width
        rng, drawn = random.Random(width), set()
        while len(drawn) < MIXED_PER_WIDTH:
            drawn.add((rng.randrange(low, high), rng.randrange(low, high)))
        problems += sorted(drawn)
    return tuple(problems)


MIXED_PROBLEMS = _mixed_problems()
"""long_addition_mixed's 1000 problems, by width (100 of width 1, MIXED_PER_WIDTH of each other)."""


def mixed_width(a: int, b: int) -> int:
    """The number of columns of "a+b" in long_addition_mixed: the wider operand's digits."""
    return max(len(str(a)), len(str(b)))


def column_line(name: str, x: int, y: int, carry_in: int, total: int) -> str:
    """One worked line: "ones: 7+5+0=12, write 2, carry 1" (the written digit and the carry follow from
    `total`, whether or not `total` is x + y + carry_in)."""
    return f"{name}: {x}+{y}+{carry_in}={total}, write {total % 10}, carry {total // 10}"


def worked_response(a: int, b: int) -> str:
    """The correct response to "a+b": one line per column (COLUMNS), then "answer: a+b"."""
    if not (0 <= a and 0 <= b and a + b <= 99):
        raise ValueError(f"worked_response: need 0 <= a, b and a + b <= 99, got {a}+{b}")
    return column_response(a, b, 2)


def column_response(a: int, b: int, width: int) -> str:
    """The correct worked response to "a+b" over `width` columns (operands zero-padded): one line per column,
    least significant first, then "answer: a+b" (a carry out of the last column is the answer's extra digit)."""
    if not (1 <= width <= len(COLUMNS) and 0 <= a < 10 ** width and 0 <= b < 10 ** width):
        raise ValueError(f"column_response: need 0 <= a, b < 10**width and 1 <= width <= {len(COLUMNS)}, "
                         f"got {a}+{b} over {width} columns")
    lines, carry = [], 0
    for name, x, y in zip(COLUMNS, reversed(f"{a:0{width}d}"), reversed(f"{b:0{width}d}")):
        total = int(x) + int(y) + carry
        lines.append(column_line(name, int(x), int(y), carry, total))
        carry = total // 10
    return "\n".join(lines + [f"answer: {a + b}"])


def mixed_worked_response(a: int, b: int) -> str:
    """long_addition_mixed's correct response: column_response over mixed_width(a, b) columns."""
    return column_response(a, b, mixed_width(a, b))


def random_column_response(rng: random.Random, width: int) -> str:
    """long_addition_mixed's format warm-start target over `width` columns: per column, uniform digits, a
    uniform written digit and a uniform carry (the next line's carry-in); the answer is the last carry (when
    1) and the written digits. Right 1 time in 2 * 10**width."""
    lines, written, carry_in = [], [], 0
    for name in COLUMNS[:width]:
        x, y, write, carry = rng.randrange(10), rng.randrange(10), rng.randrange(10), rng.randrange(2)
        lines.append(column_line(name, x, y, carry_in, 10 * carry + write))
        written.append(str(write))
        carry_in = carry
    return "\n".join(lines + [f"answer: {'1' if carry_in else ''}{''.join(reversed(written))}"])


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


def split_mixed_problems(*, seed: int = 0, test_per_width: int = 20
                         ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """long_addition_mixed's (train, test): `test_per_width` problems of each width held out (shuffled_split of
    that width's problems), then each list shuffled by `seed`, so the first rows of test.jsonl mix widths."""
    train, test = [], []
    for width in MIXED_WIDTHS:
        of_width = [p for p in MIXED_PROBLEMS if mixed_width(*p) == width]
        rest, held = shuffled_split(of_width, test_count=test_per_width, seed=seed, what="test_per_width")
        train += rest
        test += held
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def write_long_addition_mixed_data(out_dir: str | Path, *, seed: int = 0, test_per_width: int = 20
                                   ) -> tuple[Path, Path]:
    """long_addition_mixed's train.jsonl (1000 - 4 * test_per_width rows) and test.jsonl into `out_dir`
    (split_mixed_problems; rows as long_addition_row; byte-identical for the same seed, written whole)."""
    train, test = split_mixed_problems(seed=seed, test_per_width=test_per_width)
    return write_split(out_dir, [long_addition_row(*p) for p in train], [long_addition_row(*p) for p in test])
