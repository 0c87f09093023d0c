"""Run a Python script under torchrun on this machine (gloo, CPU), for tests and benchmarks.

Each launch costs ~10 s (Python start + `import megatron.core`), so a worker script should run
several checks per launch and exit non-zero on the first failure.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | os.PathLike, nproc: int, *args: str, timeout: float = 600) -> str:
    """Run `script` on `nproc` local processes; return its combined output.

    Raises RuntimeError carrying the output's tail when a rank fails or the run times out.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(nproc), "--nnodes", "1",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(script), *map(str, args),
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # Workers import the package from this checkout even without an editable install.
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise RuntimeError(f"{Path(script).name} x{nproc} timed out after {timeout}s\n{out[-6000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(script).name} x{nproc} {' '.join(map(str, args))} failed "
                           f"(exit {proc.returncode})\n{_worker_errors(proc.stdout)}")
    return proc.stdout


def _worker_errors(output: str, limit: int = 8000) -> str:
    """The workers' own tracebacks, without the launcher's (which say only 'ChildFailedError')."""
    first = output.find("Traceback (most recent call last)")
    launcher = output.find("failed (exitcode", max(first, 0))
    if 0 <= first < launcher:
        return output[first:launcher][:limit]
    return output[-limit:]
