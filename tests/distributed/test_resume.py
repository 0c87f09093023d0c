"""Exact resume: interrupted after step 2 and resumed, the run ends where an uninterrupted run ends,
bit for bit (tests/distributed/workers/resume.py has the scenario and the checks)."""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks

WORKER = Path(__file__).parent / "workers" / "resume.py"

# name: the worker's key=value arguments after WORKDIR PHASE
CASES = {
    "tp2": "tp=2",
    "dp2_distributed_optimizer": "distributed_optimizer=1",
    "ep2_moe_routing_replay": "ep=2 model=moe",
    "tp2_async_save": "tp=2 async_save=1",
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", [pytest.param("tp2", marks=pytest.mark.slow), "ep2_moe_routing_replay", "tp2_async_save",
                                  pytest.param("dp2_distributed_optimizer", marks=pytest.mark.slow)])
def test_interrupted_run_resumes_exactly(tmp_path, name):
    run_checks(WORKER, 2, tmp_path, "run", *CASES[name].split(), checks=3 if name.endswith("async_save") else 1,
               timeout=240)
    assert (tmp_path / "checkpoints" / "iter_0000003.tmp").exists()        # the crashed save's leftover
    run_checks(WORKER, 2, tmp_path, "resume", *CASES[name].split(), checks=5, timeout=240)
