"""Processes that end with the process that started them, however it ended (Linux).

A run is a tree of processes: `megatron-gspo train` (torchrun's agent, training/launch.py) -> one process
per rank -> rank 0's SGLang servers (and SGLang's scheduler and detokenizer), reward workers, and the
process Megatron-Core forks to write an async checkpoint. SIGTERM and SIGINT travel down the tree through
handlers; SIGKILL (`kill -9`, the OOM killer) cannot be handled, and the children of a killed process
are reparented and run on: two ranks training to the last step and an SGLang server holding its port.

The kernel's parent-death signal closes that gap: a process that asks for it with
prctl(PR_SET_PDEATHSIG, SIGKILL) is SIGKILLed when the *thread* that created it ends (prctl(2)). The
setting is the child's own and a fork does not inherit it, so each process asks for it itself:

- a torchrun rank, first of all (training/loop.py, training/launch.py `end_with_launcher`): `die_with_parent`;
- what a rank forks (os.fork, multiprocessing's "fork", which Megatron's async checkpoint writer uses):
  `die_with_parent_in_forks`, an at-fork hook that runs in every forked child;
- subprocess.Popen children (SGLang servers, reward workers): `preexec_fn=parent_death_preexec()`
  (subprocess forks without running at-fork hooks when there is no preexec_fn).

Start a child from a thread that lives as long as the child should: the main thread, or the thread that
also stops it. SGLang's own children ask for it themselves (sglang/srt/utils/common.py
`kill_itself_when_parent_died`). Elsewhere than on Linux these functions do nothing.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1
"""prctl option: the signal this process gets when its parent thread ends (linux/prctl.h)."""
PARENT_GONE_EXIT_CODE = 1
"""How a process that finds its parent already gone exits (it cannot have meant to outlive it)."""

_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
"""libc's prctl, looked up once here: a forked child then only calls it (no dlopen after a fork)."""


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGKILL this process when the thread that started it ends; if the parent is already gone, exit now.

    `parent_pid`: the parent's pid as the one that started this process knows it (it may have died before
    this call; then this process was reparented and os.getppid() differs). None: the caller knows no pid to
    compare with, and a parent that died before this call goes unnoticed (PID 1 may be the real parent, in
    a container).
    """
    if _prctl is None:
        return
    if _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if parent_pid is not None and os.getppid() != parent_pid:
        os.write(2, f"process {os.getpid()}: its parent {parent_pid} is gone; exiting\n".encode())
        os._exit(PARENT_GONE_EXIT_CODE)


def parent_death_preexec() -> Callable[[], None]:
    """A subprocess.Popen `preexec_fn`: the child is SIGKILLed when the calling thread ends (and exits at
    once if this process died between the fork and the prctl)."""
    parent = os.getpid()
    return lambda: die_with_parent(parent)


_forking_pid: int | None = None
"""The pid of the process that is forking (set just before the fork; read by the child)."""


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    die_with_parent(_forking_pid)


_fork_hook_registered = False


def die_with_parent_in_forks() -> None:
    """From now on, every process this one forks (os.fork, multiprocessing's "fork") is SIGKILLed when the
    thread that forked it ends, and so on down (the hook is inherited with the Python state). Idempotent."""
    global _fork_hook_registered
    if _prctl is None or _fork_hook_registered:
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _fork_hook_registered = True
