"""Run a Python script under torchrun on this machine (gloo, CPU), for tests and benchmarks.

Each launch costs ~10 s (Python start + `import megatron.core`), so a worker script runs several
named checks per launch (tests/distributed/workers/checks.py) and exits non-zero on the first failure;
`run_checks` launches one and fails with the names of the checks that failed, on which ranks (read
from the output in the format of devtools/check_report.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from devtools.check_report import failures, passed_counts
from megatron_gspo.net import free_port

REPO = Path(__file__).resolve().parents[1]


class LaunchFailed(RuntimeError):
    """A rank failed or the launch timed out; the message says which checks failed, or the worker's error."""


def torchrun(script: str | os.PathLike, nproc: int, *args, timeout: float = 600) -> str:
    """Run `script` on `nproc` local processes; return its combined output.

    Raises LaunchFailed naming the failed checks (or carrying the worker's traceback when no check
    failed) when a rank fails or the run times out.
    """
    __tracebackhide__ = True  # pytest: the failure names the check; this function's source adds nothing
    what = _describe(script, nproc, args)
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(script), *map(str, args),
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # Workers import the package (and devtools.*, tests.*) from this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise LaunchFailed(_explain(f"{what} timed out after {timeout}s", out)) from None
    if proc.returncode != 0:
        raise LaunchFailed(_explain(f"{what} failed (exit {proc.returncode})", proc.stdout))
    return proc.stdout


def run_checks(script: str | os.PathLike, nproc: int, *args, checks: int, timeout: float = 600) -> str:
    """torchrun(), then require that every rank reported exactly `checks` passed checks; return the output."""
    __tracebackhide__ = True
    out = torchrun(script, nproc, *args, timeout=timeout)
    counts = passed_counts(out)
    expected = dict.fromkeys(range(nproc), checks)
    assert counts == expected, (f"{_describe(script, nproc, args)} exited 0, but the checks passed per rank "
                                f"are {counts}, expected {expected}")
    return out


def _describe(script, nproc: int, args) -> str:
    return " ".join([Path(script).name, f"x{nproc}", *map(str, args)])


def _explain(what: str, output: str) -> str:
    """The failed checks, one per line, the first to fail first; or else what happened and the
    workers' own tracebacks."""
    failed = failures(output)
    if failed:  # in the order they happened: later ones are often a peer's collective failing in turn
        return "\n".join([failed[0], *(f"then {f}" for f in failed[1:]), f"({what})"])
    return f"{what}\n{_worker_errors(output)}"


def _worker_errors(output: str, limit: int = 8000) -> str:
    """The workers' own tracebacks, without the launcher's (which say only 'ChildFailedError')."""
    first = output.find("Traceback (most recent call last)")
    launcher = output.find("failed (exitcode", max(first, 0))
    if 0 <= first < launcher:
        return output[first:launcher][:limit]
    return output[-limit:]
