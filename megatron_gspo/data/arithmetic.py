"""The CPU demo's prompt files: single-digit addition ("3+4" -> "7") as chat-message JSONL rows.

The 55 pairs with a one-digit sum are split once, by a seeded shuffle, into disjoint train and test
files, so held-out accuracy measures generalisation to unseen pairs, not recall.
"""
from __future__ import annotations

from pathlib import Path

from megatron_gspo.data.splits import write_shuffled_split

PAIRS = tuple((a, b) for a in range(10) for b in range(10 - a))
"""The 55 (a, b) with a + b <= 9."""


def arithmetic_row(a: int, b: int) -> dict:
    """One prompt row: {"prompt": [{"role": "user", "content": "a+b"}], "answer": "a+b's value"}."""
    return {"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b)}


def write_arithmetic_data(out_dir: str | Path, *, seed: int = 0, test_pairs: int = 10) -> tuple[Path, Path]:
    """Write train.jsonl (55 - test_pairs rows) and test.jsonl (test_pairs rows) into `out_dir`.

    The same seed gives byte-identical files. Each file is written under a temporary name and renamed,
    so a reader never sees half a file. Returns (train path, test path).
    """
    return write_shuffled_split(out_dir, PAIRS, arithmetic_row, test_count=test_pairs, seed=seed, what="test_pairs")
