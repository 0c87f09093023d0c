"""One run per run directory (training/run_lock.py): a second trainer is refused at once, naming the holder;
the lock dies with its holder, even one killed with SIGKILL; a lock file left behind blocks nothing."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.training.run_lock import HELD_BY_LAUNCHER_ENV, LOCK_FILE, DirLock, RunDirInUse, lock_run, rank_lock

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import sys, time
from megatron_gspo.config import load_config
from megatron_gspo.training.run_lock import lock_run
with lock_run(load_config(None, ["model.hf_path=hf", *sys.argv[1:]])):
    print("locked", flush=True)
    time.sleep(300)
"""


@pytest.fixture
def holder():
    """holder(*overrides): a process holding the locks of the run these config overrides describe."""
    started = []

    def start(*overrides):
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, *overrides], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        started.append(proc)
        assert proc.stdout.readline() == "locked\n"
        return proc
    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_second_trainer_is_refused_at_once_naming_the_holder_until_the_holder_is_killed(tmp_path, holder):
    run_dir = tmp_path / "run"
    first = holder(f"logging.run_dir={run_dir}")
    start = time.monotonic()
    with pytest.raises(RunDirInUse) as refused:
        DirLock(run_dir, "logging.run_dir").acquire()
    assert time.monotonic() - start < 1.0  # no waiting for the lock
    assert str(refused.value).startswith(f"logging.run_dir={run_dir} is in use by pid {first.pid} on host "
                                         f"{socket.gethostname()} since ")
    assert str(refused.value).endswith("; stop that run or use another logging.run_dir")
    first.kill()  # SIGKILL: no handler, no cleanup; the kernel releases its lock
    first.wait()
    with DirLock(run_dir, "logging.run_dir"):
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_lock_file_without_a_live_holder_blocks_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "gone", "since": "yesterday"}) + "\n")
    with DirLock(run_dir, "logging.run_dir"):
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())


def test_checkpoint_dir_is_locked_too_and_a_refused_run_keeps_no_lock(tmp_path, holder):
    shared = tmp_path / "ckpt"
    first = holder(f"logging.run_dir={tmp_path / 'a'}", f"checkpoint.dir={shared}")
    second = load_config(None, ["model.hf_path=hf", f"logging.run_dir={tmp_path / 'b'}", f"checkpoint.dir={shared}"])
    with pytest.raises(RunDirInUse, match=f"^checkpoint.dir={shared} is in use by pid {first.pid} on host .*; "
                                          "stop that run or use another checkpoint.dir$"):
        with lock_run(second):
            pass
    # run_dir b was locked before checkpoint.dir was refused: released again, another process can take it
    holder(f"logging.run_dir={tmp_path / 'b'}")


def test_a_rank_locks_only_as_global_rank_0_of_a_run_its_launcher_does_not_hold(tmp_path, monkeypatch):
    config = load_config(None, ["model.hf_path=hf", f"logging.run_dir={tmp_path / 'run'}"])
    lock_file = tmp_path / "run" / LOCK_FILE
    with rank_lock(config, rank=1):
        assert not lock_file.exists()
    monkeypatch.setenv(HELD_BY_LAUNCHER_ENV, str(os.getppid()))  # `megatron-gspo train`, this rank's parent
    with rank_lock(config, rank=0):
        assert not lock_file.exists()
    monkeypatch.setenv(HELD_BY_LAUNCHER_ENV, "0")  # no parent of a rank, e.g. left in the environment
    with rank_lock(config, rank=0):
        assert json.loads(lock_file.read_text())["pid"] == os.getpid()
