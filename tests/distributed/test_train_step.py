"""train_on_batch on two gloo processes (tests/distributed/workers/train_step.py has the checks):
the gradient does not depend on the micro-batch split, mini-batch 1 after a recompute has s == 1
exactly and clips nothing, an injected train-vs-rollout gap is measured, and the loss falls."""
import pytest

from megatron_gspo.parallel.launch import torchrun

WORKER = "tests/distributed/workers/train_step.py"
CHECKS = ("microbatch invariance", "on-policy first mini-batch", "train-rollout gap", "loss decreases", "entropy")

# name: (tp, pp, ep, model, cp)
LAYOUTS = {
    "dp2": ("1", "1", "1", "dense", "1"),
    "tp2": ("2", "1", "1", "dense", "1"),
    "pp2": ("1", "2", "1", "dense", "1"),
    "cp2": ("1", "1", "1", "dense", "2"),
    "ep2_moe": ("1", "1", "2", "moe", "1"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", [
    "dp2", *(pytest.param(n, marks=pytest.mark.slow) for n in ("tp2", "pp2", "cp2", "ep2_moe"))])
def test_train_on_batch(name):
    out = torchrun(WORKER, 2, *LAYOUTS[name], timeout=240)
    for check in CHECKS:
        assert f"OK {check}" in out, out[-3000:]
