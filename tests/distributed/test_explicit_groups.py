"""Process groups come only from init_megatron's collection: with Megatron's global parallel_state
getters made to raise (tests/distributed/workers/explicit_groups.py, which also lists the reads
megatron-core 0.16.1 itself still makes), a recompute + train step, compute_logprobs and
MegatronGenerator.generate run and give the numbers an identical model gives with the globals."""
import pytest

from devtools.torchrun import run_checks

WORKER = "tests/distributed/workers/explicit_groups.py"
CHECKS = ("getters forbidden", "train step", "compute_logprobs", "generate")

# name: the worker's key=value arguments (tp, pp, cp, ep 1 and model dense where absent)
LAYOUTS = {
    "tp2": "tp=2",
    "pp2": "pp=2",
    "cp2": "cp=2",
    "tp2_moe": "tp=2 model=moe",
    "ep2_moe": "ep=2 model=moe",
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", [
    "tp2", *(pytest.param(n, marks=pytest.mark.slow) for n in ("pp2", "cp2", "tp2_moe", "ep2_moe"))])
def test_no_global_process_groups(name):
    run_checks(WORKER, 2, *LAYOUTS[name].split(), checks=len(CHECKS), timeout=240)
