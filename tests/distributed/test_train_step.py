"""train_on_batch on two gloo processes (tests/distributed/workers/train_step.py has the checks):
the gradient does not depend on the micro-batch split, mini-batch 1 after a recompute has s == 1
exactly and clips nothing, an injected train-vs-rollout gap is measured, the loss falls, and the
fused recompute trains like the per-mini-batch one, and packed rows train like one response per row."""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks

WORKER = Path(__file__).parent / "workers" / "train_step.py"

# name: the worker's key=value arguments (tp, pp, cp, ep 1 and model dense where absent; dp = the other ranks)
LAYOUTS = {
    "dp2": "",
    "tp2": "tp=2",
    "pp2": "pp=2",
    "cp2": "cp=2",
    "ep2_moe": "ep=2 model=moe",
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", [
    "dp2", *(pytest.param(n, marks=pytest.mark.slow) for n in ("tp2", "pp2", "cp2", "ep2_moe"))])
def test_train_on_batch(name):
    # microbatch invariance, on-policy first mini-batch, train-rollout gap, loss decreases, entropy,
    # fused recompute = per-mini-batch recompute, packed rows = one response per row, correction
    run_checks(WORKER, 2, *LAYOUTS[name].split(), checks=8, timeout=240)
