"""Writing a task's train/test prompt files (the demo tasks: arithmetic.py, long_addition.py, multiplication.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path
import random
from typing import Callable, Iterable, Sequence


def write_split(out_dir: str | Path, train_rows: Iterable[dict], test_rows: Iterable[dict]) -> tuple[Path, Path]:
    """OUT_DIR/train.jsonl and OUT_DIR/test.jsonl, one JSON row per line; returns (train path, test path).

    Each file is written under a temporary name and renamed, so a reader never sees half a file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "test.jsonl"
    for path, rows in zip(paths, (train_rows, test_rows)):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(tmp, path)
    return paths


def shuffled_split(items: Sequence, *, test_count: int, seed: int, what: str) -> tuple[list, list]:
    """`items` shuffled once by `seed`: (the rest, the first `test_count`), i.e. (train, test). The split
    write_shuffled_split writes, for code that needs the problems themselves (a warm start that must not see
    the test problems). `what` names the count in errors."""
    if not 0 < test_count < len(items):
        raise ValueError(f"{what} must be in [1, {len(items) - 1}], got {test_count}")
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    return shuffled[test_count:], shuffled[:test_count]


def write_shuffled_split(out_dir: str | Path, items: Sequence, row: Callable[..., dict], *, test_count: int,
                         seed: int, what: str) -> tuple[Path, Path]:
    """shuffled_split's train and test items to OUT_DIR/train.jsonl and test.jsonl, each as `row(*item)`
    (write_split). The same seed gives byte-identical files. `what` names the count in errors."""
    train, test = shuffled_split(items, test_count=test_count, seed=seed, what=what)
    return write_split(out_dir, [row(*item) for item in train], [row(*item) for item in test])
