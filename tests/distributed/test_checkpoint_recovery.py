"""A checkpoint every rank has written is not lost when the run ends badly.

- Rank 0's rollout fails with a background checkpoint unpublished: every rank raises the same RolloutFailed
  and the checkpoint is published first (a 2-process `train` run, tests/distributed/workers/rollout_fails.py).
"""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
from megatron_gspo.training.checkpoint import complete_iterations, find_latest

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "workers" / "rollout_fails.py"


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory) -> Path:
    """The checkpoint folder of a run whose rollout failed on rank 0 at step 3: iter_0000001, iter_0000002."""
    workdir = tmp_path_factory.mktemp("rollout_fails")
    hf_dir = make_tiny_qwen3(workdir / "hf", TinyQwen3Spec(num_experts=4))
    run_checks(WORKER, 2, workdir, hf_dir, checks=2, timeout=300)
    return workdir / "run" / "ckpt"


def test_a_rollout_failure_on_rank_0_publishes_the_background_checkpoint_on_every_rank(failed_run):
    assert complete_iterations(failed_run) == [1, 2] and find_latest(failed_run) == 2  # (the worker checked it too)
