"""policy_loss under context parallelism (CP 2 and 4) vs one process: values, gradients, metrics."""
import pytest

from megatron_gspo.parallel.launch import torchrun


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_policy_loss_cp_matches_single_process(cp):
    out = torchrun("tests/distributed/workers/policy_loss_cp.py", cp, timeout=180)
    assert out.count(f"OK policy_loss cp={cp} rank") == cp
