"""Running torchrun for `megatron-gspo train`, and saying in one line which rank failed first, and why.

torchrun runs inside the calling process (`torch.distributed.run.run`, what `python -m torch.distributed.run`
calls), not as a child: SIGTERM/SIGINT reach torchrun's own handlers exactly as when the CLI exec'd it, and it
passes them to the ranks (training/preemption.py). A child would need them forwarded, and where every process
gets the signal anyway (Slurm signals all processes of a step, a terminal all of its foreground group) torchrun
would get it twice: the second interrupts its wait for the ranks to stop
(torch/distributed/elastic/agent/server/api.py:752, multiprocessing/api.py:1040) while they save a checkpoint.

Each rank's entry point (training/loop.py `main`) is wrapped in torch's `@record`, which writes an uncaught
exception (type, message, traceback, time) to the rank's TORCHELASTIC_ERROR_FILE under torchrun's log folder.
When ranks fail, torchrun raises ChildFailedError with them; instead of its summary, which ends 60-150 lines
below the cause, the earliest recorded exception is printed last:

    megatron-gspo train: rank 1 failed: ValueError: ...

The log folder is this launch's own temporary folder, removed when torchrun returns (torchrun would otherwise
leave a /tmp/torchelastic_* folder behind per run).

A signal that cannot be handled (`kill -9` of this process, the OOM killer) takes the whole run with it:
each rank's first act is `end_with_launcher` (the kernel SIGKILLs it when torchrun's agent ends, and every
process it forks or starts follows it the same way: platform/lifetime.py).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile

from megatron_gspo.platform.lifetime import die_with_parent, die_with_parent_in_forks

LAUNCHER_PID_ENV = "MEGATRON_GSPO_LAUNCHER_PID"
"""Set by `run_torchrun` for the ranks: the pid of torchrun's agent, their parent (this process)."""


def run_torchrun(torchrun_args: list[str], *, prog: str = "megatron-gspo train", env: dict[str, str] | None = None) -> int:
    """torchrun with `torchrun_args` (e.g. ["--nproc-per-node", "2", "-m", "megatron_gspo.training.loop", ...])
    in this process: 0 when every rank succeeded; else 1, torchrun's code, after one line saying why (the first
    failure, or the signal that stopped the run). `env`: more environment variables for the ranks."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    log_dir = tempfile.mkdtemp(prefix="megatron-gspo-torchrun-")
    # The ranks' environment is this process's (torchrun copies it when it starts them).
    saved = {k: os.environ.get(k) for k in [LAUNCHER_PID_ENV, *(env or {})]}
    os.environ.update({LAUNCHER_PID_ENV: str(os.getpid()), **(env or {})})
    try:
        run(parse_args(["--log-dir", log_dir, *torchrun_args]))
    except ChildFailedError as e:
        print(f"{prog}: {first_failure(e.failures)}", file=sys.stderr, flush=True)
        return 1
    except SignalException as e:  # torchrun passed it to the ranks and waited for them (they checkpoint)
        print(f"{prog}: stopped by {e.sigval.name}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return 0


def first_failure(failures: dict) -> str:
    """One line for the rank that failed first: `failures` maps global ranks to torchrun's ProcessFailure.

    Ranks that recorded an exception come before ranks that died without one (a signal, os._exit), and among
    them the earliest error file written wins (its modification time: the recorded timestamps are whole
    seconds). The other ranks failed later, often because of the first (their tracebacks are above).
    """
    def order(rank: int):
        failure = failures[rank]
        try:
            return 0, os.stat(failure.error_file).st_mtime_ns, rank
        except OSError:  # no error file ("<N/A>")
            return 1, failure.timestamp * 10**9, rank

    first = min(failures, key=order)
    failure = failures[first]
    if order(first)[0] == 0:
        message = failure.message  # the error file's {"message": "Type: text", "extraInfo": {...}}
        lines = (message["message"] if isinstance(message, dict) else message).splitlines() or ["(no message)"]
        what = lines[0] + (f" [{len(lines) - 1} more lines in its traceback above]" if len(lines) > 1 else "")
        # Every rank raises RolloutFailed with rank 0's error together: name rank 0 and its error.
        from megatron_gspo.rollout.protocol import relayed_error  # (torch: imported only when ranks failed)
        first, what = relayed_error(what) or (first, what)
    elif failure.exitcode < 0:
        try:
            what = f"killed by signal {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            what = f"killed by signal {-failure.exitcode}"
    else:
        what = f"exited with code {failure.exitcode} without recording an exception (see its output above)"
    return f"rank {first} failed: {what}"


def end_with_launcher() -> None:
    """A rank's first act (training/loop.py): the kernel SIGKILLs this process when torchrun's agent ends,
    however it ends, and every process it forks from here on when this one ends; if the agent is already
    gone, exit at once. Launched by `megatron-gspo train`, the agent's pid is known (LAUNCHER_PID_ENV); by
    plain torchrun it is not, and an agent that died in the ~0.1 s between starting this rank and this call
    goes unnoticed here."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    die_with_parent(int(launcher) if launcher else None)
    die_with_parent_in_forks()
