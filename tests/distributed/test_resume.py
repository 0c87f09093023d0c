"""Exact resume: interrupted after step 2 and resumed, the run ends where an uninterrupted run ends,
bit for bit (tests/distributed/workers/resume.py has the scenario and the checks)."""
import pytest

from megatron_gspo.parallel.launch import torchrun

WORKER = "tests/distributed/workers/resume.py"

# name: worker arguments after WORKDIR PHASE (TP, optimizer)
CASES = {"tp2": ("2",), "dp2_distributed_optimizer": ("1", "distopt")}


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tp2", pytest.param("dp2_distributed_optimizer", marks=pytest.mark.slow)])
def test_interrupted_run_resumes_exactly(tmp_path, name):
    out = torchrun(WORKER, 2, tmp_path, "run", *CASES[name], timeout=240)
    assert out.count("OK interrupted rank") == 2, out[-3000:]
    assert (tmp_path / "checkpoints" / "iter_0000003.tmp").exists()        # the crashed save's leftover
    out = torchrun(WORKER, 2, tmp_path, "resume", *CASES[name], timeout=240)
    assert out.count("OK resumed rank") == 2, out[-3000:]
    assert "bitwise identical" in out, out[-3000:]
