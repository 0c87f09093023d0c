"""Named checks for the torchrun workers: the worker's half (the launcher's is devtools/check_report.py).

A worker runs each check under a name, as a block or a function:

    with check("loss matches the reference"):
        assert torch.isclose(loss, ref_loss), (loss, ref_loss)

    @check("grad norm matches the reference")
    def grad_norm_matches(...): ...

and calls `done()` at its end. A failing check raises `CheckFailed` ("check 'loss matches the
reference' failed on rank 1: AssertionError: ... (layouts.py:97)"), so the process exits non-zero, and
first prints that sentence on one tagged line. `done()` prints "N checks passed" for this rank.
devtools/torchrun.py reads both from the launch's output (`failures`, `passed_counts` of
devtools/check_report.py, which defines the lines' format): a failed launch names its failed checks,
and a test asserts how many checks each rank passed, so a worker that skipped some fails too. One
launch runs many checks (a launch costs ~10 s); the first failure ends it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path

from devtools.check_report import failed_line, passed_line

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
        _report(failed_line(message))  # one line for the launcher; the full text is in the traceback
        raise CheckFailed(message) from error
    _passed.append(name)


def done() -> None:
    """Report how many checks this rank passed (the test compares it with what it expects)."""
    _report(passed_line(_rank(), len(_passed)))


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

