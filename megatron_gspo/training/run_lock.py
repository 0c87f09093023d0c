"""One run at a time per run directory: a lock held for the life of the run.

Two trainers writing one logging.run_dir (metrics.jsonl, the converted initial weights, the disk-sync
weights) or one checkpoint.dir (`latest`, pruning) corrupt each other's files, so the second one is refused
at once:

    megatron-gspo train: error: logging.run_dir=runs/tiny_cpu is in use by pid 4242 on host n1 since
    2025-01-01 12:00:00 UTC; stop that run or use another logging.run_dir

The lock is a POSIX record lock (fcntl.lockf, which NFS supports too) on LOCK_FILE in the directory: the
kernel (or the NFS lock manager) releases it when its holder ends, however it ends, so a run killed with
SIGKILL leaves no stale lock behind; the file stays, and only names the last holder. `megatron-gspo train`
takes it on node rank 0 before anything starts and holds it until it exits; a rank started by plain torchrun
takes it on global rank 0 (`rank_lock`), unless its launcher holds it already (HELD_BY_LAUNCHER_ENV).

POSIX locks belong to a process, not to a file descriptor: closing any descriptor of the lock file in the
holder releases it (never open LOCK_FILE elsewhere), a second lock in the holder's own process succeeds,
and a forked child does not inherit it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from megatron_gspo.config import TrainConfig

LOCK_FILE = "megatron-gspo.lock"
HELD_BY_LAUNCHER_ENV = "MEGATRON_GSPO_RUN_LOCK_HELD_BY"
"""Set by `megatron-gspo train` for its ranks: its pid, when it holds the run's locks."""


class RunDirInUse(RuntimeError):
    """Another live process holds the lock of a run directory; the message names it."""


class DirLock:
    """The lock of one directory (created if missing), held from `acquire` to `release` (or the process's end).

    `setting` is the config key the directory comes from, for the messages (e.g. "logging.run_dir")."""

    def __init__(self, directory: str | os.PathLike, setting: str):
        self.directory, self.setting = Path(directory), setting
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "DirLock":
        """Take the lock now or raise RunDirInUse naming its holder (ValueError if the file cannot be made)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: it names the holder
        except OSError as e:
            raise ValueError(f"{self.setting}: cannot create the lock file {self.path} ({e.strerror or e})") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EAGAIN / EACCES: held by another process
            os.close(fd)
            raise RunDirInUse(f"{self.setting}={self.directory} is in use by {self.holder()}; stop that run or "
                              f"use another {self.setting}") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def holder(self) -> str:
        """'pid P on host H since T', as the holder wrote it in the lock file."""
        try:
            h = json.loads(self.path.read_text())
            return f"pid {h['pid']} on host {h['host']} since {h['since']}"
        except (OSError, ValueError, KeyError, TypeError):  # written in the instant after the lock was taken
            return f"another process (its lock file {self.path} does not name it yet)"

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock goes with it
            self._fd = None

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def run_directories(config: TrainConfig) -> list[tuple[str, Path]]:
    """(setting, directory) of every directory a run writes and no other run may: logging.run_dir, and
    checkpoint.dir when it is set and another directory."""
    found = [("logging.run_dir", Path(config.logging.run_dir))]
    c = config.checkpoint.dir
    if c is not None and Path(c).resolve() != Path(config.logging.run_dir).resolve():
        found.append(("checkpoint.dir", Path(c)))
    return found


@contextlib.contextmanager
def lock_run(config: TrainConfig) -> Iterator[None]:
    """Hold the locks of the run's directories (`run_directories`) while inside; RunDirInUse at once if
    another process holds one of them."""
    with contextlib.ExitStack() as stack:
        for setting, directory in run_directories(config):
            stack.enter_context(DirLock(directory, setting))
        yield


def rank_lock(config: TrainConfig, rank: int) -> contextlib.AbstractContextManager:
    """The run's locks for global rank `rank` of torchrun: `lock_run` on rank 0, unless the launcher (its
    parent, `megatron-gspo train`) holds them already; nothing on the other ranks."""
    if rank != 0 or os.environ.get(HELD_BY_LAUNCHER_ENV) == str(os.getppid()):
        return contextlib.nullcontext()
    return lock_run(config)
