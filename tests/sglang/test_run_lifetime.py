"""A run lives and dies with its launcher: `kill -9` of `megatron-gspo train` takes every process of the run
along (both ranks, the SGLang server and its own processes, the reward worker, a checkpoint writer if one is
writing), and while a run is going a second trainer on its run directory is refused at once.

One trainer (one SGLang start) serves both checks: the second trainer is started while the first trains.
Every process the test starts carries a marker in its environment, by which whatever a failure leaves
running is found and killed.
"""
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_gspo.rollout.sglang.server import remove_shm_files, shm_files_of_group
from megatron_gspo.training.run_lock import DirLock

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[2]
MARKER = "MEGATRON_GSPO_TEST_RUN"


def start_train(overrides: list[str], log: Path, marker: str) -> subprocess.Popen:
    """`megatron-gspo train examples/tiny_cpu.yaml OVERRIDES` in the background, its output in `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "megatron_gspo.cli", "train",
                                 str(REPO / "examples/tiny_cpu.yaml"), *overrides], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO), MARKER: marker},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked(marker: str) -> list[psutil.Process]:
    """Every live process whose environment carries `marker` (this test's, however reparented)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARKER) == marker and alive(p):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def kind(process: psutil.Process, command: str, launcher: int) -> str:
    if "megatron_gspo.training.loop" in command:
        return "rank" if process.ppid() == launcher else "process forked by a rank"
    if "megatron_gspo.rewards.worker" in command:
        return "reward worker"
    if "sglang" in command:
        return "SGLang process"
    return "multiprocessing resource tracker" if "resource_tracker" in command else "other"


def test_a_second_trainer_is_refused_and_kill_9_of_the_launcher_ends_every_process_of_the_run(tiny_model_dir, tmp_path):
    run_dir, marker = tmp_path / "run", uuid.uuid4().hex
    overrides = [f"model.hf_path={tiny_model_dir}", f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir / 'ckpt'}",
                 "checkpoint.interval=1", "num_steps=100", "eval.interval=0", "reward.workers=1",
                 "gspo.prompts_per_step=4", "gspo.group_size=4", "gspo.num_minibatches=1",
                 "gspo.dynamic_sampling=false"]  # a random model scores ~0: no extra rounds
    started = time.monotonic()
    first = start_train(overrides, tmp_path / "first.log", marker)
    leftover_shm = {}
    try:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):  # step 1 logged
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-6000:]
            assert time.monotonic() - started < 420, "step 1 never finished"
            time.sleep(0.2)
        first_step_s = time.monotonic() - started

        # A second trainer on the same run directory: refused before anything starts, naming the first.
        start = time.monotonic()
        second = start_train(overrides, tmp_path / "second.log", marker)
        try:
            second.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        refused_s, output = time.monotonic() - start, (tmp_path / "second.log").read_text()
        assert second.returncode == 1, f"the second trainer ran on for {refused_s:.0f} s:\n{output[-3000:]}"
        assert (f"megatron-gspo train: error: logging.run_dir={run_dir} is in use by pid {first.pid} on host "
                f"{socket.gethostname()} since ") in output, output
        assert "SGLang" not in output and refused_s < 10, (refused_s, output)

        # kill -9 of the launcher: every process it started, directly or not, ends within seconds.
        descendants, commands, kinds = [], {}, []
        for p in psutil.Process(first.pid).children(recursive=True):
            try:  # a process that has just ended (a checkpoint writer done) is not counted
                commands[p.pid] = " ".join(p.cmdline())
                kinds.append(kind(p, commands[p.pid], first.pid))
                descendants.append(p)
            except psutil.Error:
                commands.pop(p.pid, None)
        assert kinds.count("rank") == 2 and "SGLang process" in kinds and "reward worker" in kinds, commands
        servers = [p.pid for p in descendants if "sglang.launch_server" in commands[p.pid]]
        leftover_shm = {k: v for pid in servers for k, v in shm_files_of_group(pid).items()}  # removed below
        first.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        first.wait()
        while any(alive(p) for p in descendants) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        ended_s = time.monotonic() - killed
        left = [commands[p.pid][:160] for p in descendants if alive(p)]
        assert not left, f"{len(left)} of {len(descendants)} processes still running {ended_s:.1f} s after kill -9: {left}"
        with DirLock(run_dir, "logging.run_dir"):  # the lock died with its holder
            pass
        print(f"\nstep 1 logged after {first_step_s:.1f} s; second trainer refused in {refused_s:.1f} s; all "
              f"{len(descendants)} processes of the run ({', '.join(f'{kinds.count(k)} {k}' for k in sorted(set(kinds)))}) "
              f"ended {ended_s:.2f} s after kill -9 of the launcher")
    finally:
        for _ in range(3):  # a process may start another while the first ones are killed
            for p in marked(marker):
                p.kill()
            time.sleep(0.5)
        remove_shm_files(leftover_shm)  # SGLang's files in /dev/shm: no process of a killed run removes them
