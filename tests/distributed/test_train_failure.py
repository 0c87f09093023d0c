"""A failure inside the ranks of `megatron-gspo train` ends with its cause, in one line (training/launch.py),
and the launch leaves no torchrun log folder behind."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.data import write_arithmetic_data
from tests.tiny_hf import fake_hf_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
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
