"""Named checks for the torchrun workers, and how the launcher reads their results.

A worker runs each check under a name, as a block or a function:

    with check("loss matches the reference"):
        assert torch.isclose(loss, ref_loss), (loss, ref_loss)

    @check("grad norm matches the reference")
    def grad_norm_matches(...): ...

and calls `done()` at its end. A failing check raises `CheckFailed` ("check 'loss matches the
reference' failed on rank 1: AssertionError: ... (layouts.py:97)"), so the process exits non-zero, and
first prints that sentence on one tagged line. `done()` prints "N checks passed" for this rank.
tests/torchrun.py reads both from the launch's output (`failures`, `passed_counts`): a failed launch
names its failed checks, and a test asserts how many checks each rank passed, so a worker that skipped
some fails too. One launch runs many checks (a launch costs ~10 s); the first failure ends it.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from pathlib import Path

TAG = "[checks]"
# Found anywhere in a line: another rank's unfinished line may precede a report.
_PASSED = re.compile(rf"{re.escape(TAG)} rank (\d+): (\d+) checks passed$", re.MULTILINE)
_FAILED = re.compile(rf"{re.escape(TAG)} (check .*)$", re.MULTILINE)
_WORKERS = Path(__file__).resolve().parent
_passed: list[str] = []


class CheckFailed(AssertionError):
    """A named check failed; the message names the check and the rank."""


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))  # set by torchrun before the process group exists


def _where(error: BaseException) -> str:
    """file:line of the innermost worker frame of the error (the failing assert), if any."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).parent == _WORKERS]
    return f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


@contextlib.contextmanager
def check(name: str):
    """Run the block (or, as a decorator, each call of the function) as the check `name`."""
    try:
        yield
    except CheckFailed:  # a check inside this one failed: it has reported itself
        raise
    except Exception as error:
        text = f"{type(error).__name__}: {error}".strip().rstrip(":")
        message = f"check {name!r} failed on rank {_rank()}: {text}{_where(error)}"
        # One line in the output for the launcher; the full text in the traceback.
        _report(f"{TAG} {' | '.join(line for line in message.splitlines() if line.strip())[:2000]}")
        raise CheckFailed(message) from error
    _passed.append(name)


def done() -> None:
    """Report how many checks this rank passed (the test compares it with what it expects)."""
    _report(f"{TAG} rank {_rank()}: {len(_passed)} checks passed")


def shutdown() -> None:
    """Barrier, then destroy the default process group: a rank leaving with gloo's threads still up can
    abort at interpreter exit ("terminate called without an active exception", SIGABRT) after all its
    checks passed. Every worker that initialises torch.distributed ends with this (or the same two calls)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _report(line: str) -> None:
    """One write of the line and its newline, under the pipe's atomic size: the ranks share the
    launcher's output, and print() writes the newline separately, so lines of two ranks can interleave."""
    sys.stdout.flush()
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def failures(output: str) -> list[str]:
    """The failed checks' messages in a launch's output, in order, each once."""
    return list(dict.fromkeys(_FAILED.findall(output)))


def passed_counts(output: str) -> dict[int, int]:
    """rank -> number of checks it passed, from the ranks that reached `done()`."""
    return {int(rank): int(n) for rank, n in _PASSED.findall(output)}
