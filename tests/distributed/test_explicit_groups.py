"""Process groups come only from init_megatron's collection: with Megatron's global parallel_state
getters made to raise (tests/distributed/workers/explicit_groups.py, which also lists the reads
megatron-core 0.16.1 itself still makes), a recompute + train step, compute_logprobs and
MegatronGenerator.generate run and give the numbers an identical model gives with the globals."""
import pytest

from devtools.torchrun import run_checks

WORKER = "tests/distributed/workers/explicit_groups.py"
CHECKS = ("getters forbidden", "train step", "compute_logprobs", "generate")

# name: (tp, pp, cp, ep, model)
LAYOUTS = {
    "tp2": ("2", "1", "1", "1", "dense"),
    "pp2": ("1", "2", "1", "1", "dense"),
    "cp2": ("1", "1", "2", "1", "dense"),
    "tp2_moe": ("2", "1", "1", "1", "moe"),
    "ep2_moe": ("1", "1", "1", "2", "moe"),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", [
    "tp2", *(pytest.param(n, marks=pytest.mark.slow) for n in ("pp2", "cp2", "tp2_moe", "ep2_moe"))])
def test_no_global_process_groups(name):
    run_checks(WORKER, 2, *LAYOUTS[name], checks=len(CHECKS), timeout=240)
