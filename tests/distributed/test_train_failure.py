"""A failure inside the ranks of `megatron-gspo train` ends with its cause, in one line (training/launch.py),
and the launch leaves no torchrun log folder behind; a reward function that always hangs ends a real run
within about two of its timeouts."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_gspo.data import write_arithmetic_data
from megatron_gspo.dev.tiny_model import make_tiny_qwen3
from tests.tiny_hf import fake_hf_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.e2e
def test_the_first_failing_ranks_exception_is_the_last_line(tmp_path):
    # 2 ranks, in-process rollouts (no SGLang); the reward module fails to import on rank 1 only, in its
    # preflight: the launcher's preflight passed, rank 0 goes on into Megatron's set-up and is stopped.
    fake_hf_dir(tmp_path / "hf")
    train, test = write_arithmetic_data(tmp_path / "data")
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", "train", str(REPO / "examples/tiny_moe_cpu.yaml"),
         "rollout.backend=megatron", f"model.hf_path={tmp_path / 'hf'}", "parallel.ep=1",
         f"logging.run_dir={tmp_path / 'run'}",
         f"checkpoint.dir={tmp_path / 'run' / 'ckpt'}", f"data.train={train}", f"eval.datasets.held_out={test}",
         "reward.fn=tests.distributed.workers.fails_on_rank_1:score"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path / "tmp")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-6000:]
    assert proc.stdout.splitlines()[-1] == (
        "megatron-gspo train: rank 1 failed: ValueError: reward.fn: reward 'tests.distributed.workers.fails_on_rank_1"
        ":score': cannot import module 'tests.distributed.workers.fails_on_rank_1': RuntimeError: deliberate "
        "failure on rank 1"), proc.stdout[-6000:]
    assert "ChildFailedError" not in proc.stdout
    # torchrun's log folder (the ranks' error files) was this launch's own and is gone; no torchelastic_* either
    left = [p.name for p in (tmp_path / "tmp").iterdir()]
    assert not [name for name in left if name.startswith(("torchelastic_", "megatron-gspo-torchrun-"))], left


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_reward_function_that_always_hangs_stops_the_run_within_two_timeouts(tmp_path):
    # The demo config on one process sampling with the model it trains (no SGLang). Its step-0 eval (10 held-out
    # prompts x 16 samples) is scored by a function that never returns, 2 workers, 1 s each. Before: 160 x 1 s /
    # 2 workers = 80 s of silence, then "failed on 160 of 160 samples".
    hf = make_tiny_qwen3(tmp_path / "hf")
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_gspo.cli", "train", str(REPO / "examples/tiny_cpu.yaml"), f"model.hf_path={hf}",
         "parallel.tp=1", "rollout.backend=megatron", f"logging.run_dir={run}", f"checkpoint.dir={run / 'ckpt'}",
         "reward.fn=tests.unit.reward_fns:hangs", "reward.workers=2", "reward.timeout_s=1"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)
    lines: list[tuple[float, str]] = []   # (when, line)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line.rstrip("\n")) for line in proc.stdout))
    reader.start()
    try:
        proc.wait(timeout=300)
    finally:
        proc.kill()
        reader.join()
    output = "\n".join(line for _, line in lines)
    assert proc.returncode == 1, output[-6000:]
    # From the line the rollout opens with (the reward pool is up) to rank 0's traceback: the eval's generation,
    # 2 timeouts of 1 s and a replacement worker's start (~0.2 s): 2.5 s measured on a loaded machine. (The ranks'
    # and torchrun's teardown after it take another ~6 + ~9 s there, as for any failure.)
    opened = next(when for when, line in lines if line.startswith("data: "))
    failed = next(when for when, line in lines if "RewardError: " in line)
    assert failed - opened < 10.0, (failed - opened, output[-6000:])
    assert lines[-1][1].startswith(
        "megatron-gspo train: rank 0 failed: RewardError: reward function 'tests.unit.reward_fns:hangs' failed on its "
        "first 4 samples in a row (4 timed out after 1 s): is it broken?"), output[-6000:]
