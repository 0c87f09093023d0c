"""The in-process Megatron sampler (rollout/megatron/generator.py) under TP2, EP2 (x DP2), PP2 and CP2 samples
what one process samples: the same tokens, log-probs within 1e-5, the same finish reasons.

tests/distributed/workers/megatron_rollout.py runs the checks of one layout (including, in the
one-process reference, log-probs against a float64 log_softmax of the model's logits and EOS cuts).
"""
import json
from pathlib import Path

import pytest

from devtools.torchrun import run_checks
from tests.tiny_hf import save_tiny

WORKER = Path(__file__).parent / "workers" / "megatron_rollout.py"
LAYOUTS = {"tp2": "tp=2", "ep2": "ep=2", "pp2": "pp=2", "cp2": "cp=2"}  # the worker's key=value arguments


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("megatron_rollout")
    save_tiny(path / "hf", "moe")
    # the 4 checks of every layout, and the log-probs against the model's logits
    run_checks(WORKER, 1, path, "reference", checks=5, timeout=240)
    return path


@pytest.mark.distributed
def test_reference_logprobs_are_the_models(workdir):
    result = json.loads((workdir / "reference.json").read_text())
    assert result["max_abs_logprob_error"] < 1e-5
    finishes = [s[2] for group in result["c"] for s in group]
    assert "stop" in finishes and "length" in finishes


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["tp2", "ep2", pytest.param("pp2", marks=pytest.mark.slow),
                                  pytest.param("cp2", marks=pytest.mark.slow)])
def test_layout_samples_like_one_process(workdir, name):
    run_checks(WORKER, 2, workdir, name, *LAYOUTS[name].split(), checks=4, timeout=240)
    reference = json.loads((workdir / "reference.json").read_text())
    result = json.loads((workdir / f"{name}.json").read_text())
    for run in ("a", "b", "c"):
        for group_ref, group in zip(reference[run], result[run], strict=True):
            for (ids_ref, lp_ref, finish_ref, _), (ids, lp, finish, _) in zip(group_ref, group, strict=True):
                assert ids == ids_ref and finish == finish_ref, (run, ids_ref, ids)
                assert max(abs(x - y) for x, y in zip(lp, lp_ref)) < 1e-5, (run, lp_ref, lp)
