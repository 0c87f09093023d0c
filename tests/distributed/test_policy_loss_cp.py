"""policy_loss under context parallelism (CP 2 and 4) vs one process: values, gradients, metrics."""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks

WORKER = Path(__file__).parent / "workers" / "policy_loss_cp.py"


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_policy_loss_cp_matches_single_process(cp):
    # gspo, gspo_token, grpo x (response tokens spread, all in chunk 0)
    run_checks(WORKER, cp, checks=6, timeout=180)
