"""The lines a torchrun worker's named checks print, and how the launcher reads them back.

The writing half is tests/distributed/workers/checks.py (`check`, `done`); the reading half is
devtools/torchrun.py (`run_checks`, and a failed launch's message). Both take the format from here, so
it is defined once: a rank that reached its end prints

    [checks] rank 1: 7 checks passed

and a check that failed prints, on one line,

    [checks] check 'loss matches the reference' failed on rank 1: AssertionError: ... (layouts.py:97)
"""
from __future__ import annotations

import re

TAG = "[checks]"
# Found anywhere in a line: another rank's unfinished line may precede a report.
_PASSED = re.compile(rf"{re.escape(TAG)} rank (\d+): (\d+) checks passed$", re.MULTILINE)
_FAILED = re.compile(rf"{re.escape(TAG)} (check .*)$", re.MULTILINE)


def passed_line(rank: int, passed: int) -> str:
    """The line a rank prints at its end: how many checks it passed."""
    return f"{TAG} rank {rank}: {passed} checks passed"


def failed_line(message: str) -> str:
    """The one line a failed check prints: its message ("check 'NAME' failed on rank R: ..."), its lines
    joined by ' | ', cut at 2000 characters."""
    return f"{TAG} {' | '.join(line for line in message.splitlines() if line.strip())[:2000]}"


def failures(output: str) -> list[str]:
    """The failed checks' messages in a launch's output, in order, each once."""
    return list(dict.fromkeys(_FAILED.findall(output)))


def passed_counts(output: str) -> dict[int, int]:
    """rank -> number of checks it passed, from the ranks that reached `done()`."""
    return {int(rank): int(n) for rank, n in _PASSED.findall(output)}
