"""platform/lifetime.py: a process tree shaped like a run's ends within seconds of its launcher's SIGKILL.

launcher (torchrun's agent) -> "rank" (its own session, like torchrun's ranks) -> a forked "checkpoint
writer" (multiprocessing fork, like Megatron's async save) -> a fork of it, and a Popen'ed "reward worker".
Pure Python: no torch, no Megatron.
"""
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
RANK = r"""
import multiprocessing, os, subprocess, sys, time
from megatron_gspo.platform.lifetime import die_with_parent, die_with_parent_in_forks, parent_death_preexec
die_with_parent(int(sys.argv[1]))
die_with_parent_in_forks()
fork = multiprocessing.get_context("fork")

def sleep():
    os.write(1, f"{os.getpid()}\n".encode())  # one write: the four processes share the pipe
    time.sleep(300)

def writer():
    fork.Process(target=sleep).start()  # a grandchild of the rank
    sleep()

fork.Process(target=writer).start()
subprocess.Popen([sys.executable, "-c", "import os, time; os.write(1, (str(os.getpid()) + os.linesep).encode()); time.sleep(300)"],
                 preexec_fn=parent_death_preexec())
sleep()
"""
LAUNCHER = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], start_new_session=True)
time.sleep(300)
"""


def read_pids(stream, n: int, timeout_s: float = 60) -> list[int]:
    """The first n lines of `stream` (unbuffered), each a pid; fails after timeout_s (a process that died at
    start-up)."""
    pids, deadline = [], time.monotonic() + timeout_s
    while len(pids) < n:
        assert select.select([stream], [], [], max(deadline - time.monotonic(), 0))[0], f"only {pids} printed"
        pids.append(int(stream.readline()))
    return pids


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_every_process_of_the_tree_ends_within_seconds_of_a_sigkilled_launcher():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK], stdout=subprocess.PIPE, bufsize=0,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    pids = []
    try:
        pids = read_pids(launcher.stdout, 4)  # rank, writer, its fork, reward worker
        assert {p.pid for p in psutil.Process(launcher.pid).children(recursive=True)} == set(pids)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        start = time.monotonic()
        while any(alive(pid) for pid in pids) and time.monotonic() - start < 5:
            time.sleep(0.05)
        left = {pid: " ".join(psutil.Process(pid).cmdline())[:60] for pid in pids if alive(pid)}
        assert not left, f"still running {time.monotonic() - start:.1f} s after the launcher's SIGKILL: {left}"
    finally:
        for pid in [launcher.pid, *pids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def test_a_process_whose_parent_is_already_gone_exits_at_once():
    # die_with_parent(P) where P is not (or no longer) the parent: it exits instead of running on as an orphan
    proc = subprocess.run([sys.executable, "-c", "from megatron_gspo.platform.lifetime import die_with_parent\n"
                           "die_with_parent(0)\nprint('ran on')"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stdout) == (1, ""), proc
    assert "its parent 0 is gone" in proc.stderr
