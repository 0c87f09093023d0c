"""Exact resume: interrupted after step 2 and resumed, the run ends where an uninterrupted run ends,
bit for bit (tests/distributed/workers/resume.py has the scenario and the checks)."""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks

WORKER = Path(__file__).parent / "workers" / "resume.py"

# name: worker arguments after WORKDIR PHASE (TP, optimizer)
CASES = {"tp2": ("2",), "dp2_distributed_optimizer": ("1", "distopt"), "ep2_moe_routing_replay": ("1", "moe_replay"),
         "tp2_async_save": ("2", "async")}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tp2", "ep2_moe_routing_replay", "tp2_async_save",
                                  pytest.param("dp2_distributed_optimizer", marks=pytest.mark.slow)])
def test_interrupted_run_resumes_exactly(tmp_path, name):
    run_checks(WORKER, 2, tmp_path, "run", *CASES[name], checks=3 if name.endswith("async_save") else 1,
               timeout=240)
    assert (tmp_path / "checkpoints" / "iter_0000003.tmp").exists()        # the crashed save's leftover
    run_checks(WORKER, 2, tmp_path, "resume", *CASES[name], checks=5, timeout=240)
