"""A reward module whose import fails on torchrun's rank 1 only (tests/distributed/test_train_failure.py): the
launcher's preflight (no RANK) and rank 0 import it; rank 1 stops in its own preflight, before any process group."""
import os

if os.environ.get("RANK") == "1":
    raise RuntimeError("deliberate failure on rank 1")


def score(sample) -> float:
    return 0.0
