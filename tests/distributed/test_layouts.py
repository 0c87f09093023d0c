"""The master test of the loss plumbing: one checkpoint, many parallel layouts, the same GSPO step.

A tiny Qwen3-MoE-like GPTModel (4 experts top-2, GQA, qk-norm, sequence-level aux loss) is saved once
at TP1; every layout loads it, recomputes old log-probs, and runs one GSPO step with SGD. Per-token
log-probs must agree within 1e-5, and the loss, grad norm and parameter update must match the TP1
reference (tests/distributed/workers/layouts.py has the checks).
"""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks

WORKER = Path(__file__).parent / "workers" / "layouts.py"

# name: (processes, the worker's key=value arguments: tp, pp, cp, ep and micro-batches per DP rank, 1 where
# absent); the reference is TP1, 1 micro-batch.
LAYOUTS = {
    "tp2": (2, "tp=2"),
    "ep2": (2, "ep=2"),
    "pp2": (2, "pp=2 microbatches=2"),
    "cp2": (2, "cp=2"),
    "dp2": (2, ""),
    "tp2xep2": (4, "tp=2 ep=2"),
    "tp2xpp2": (4, "tp=2 pp=2 microbatches=4"),
    "dp2xcp2": (4, "cp=2 microbatches=2"),
    "microbatches4": (1, "microbatches=4"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("layouts")
    run_checks(WORKER, 1, workdir, "reference", checks=1, timeout=300)
    return workdir


@pytest.mark.distributed
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_tp1_reference(reference, name):
    nproc, args = LAYOUTS[name]
    run_checks(WORKER, nproc, reference, name, *args.split(), checks=5, timeout=300)


@pytest.fixture(scope="module")
def corrected_reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("layouts_correction")
    run_checks(WORKER, 1, workdir, "reference", "correction=1", checks=1, timeout=300)
    return workdir


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dp2", "tp2", "cp2", "pp2", "ep2"])
def test_layout_with_correction_matches_tp1_reference(corrected_reference, name):
    """The same with train-inference correction on (loss/correction.py: capped geometric weights, a token
    rejection): loss, grad norm and update of every layout equal TP1's."""
    nproc, args = LAYOUTS[name]
    run_checks(WORKER, nproc, corrected_reference, name, *args.split(), "correction=1", checks=5, timeout=300)


@pytest.fixture(scope="module")
def episodes_reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("layouts_episodes")
    run_checks(WORKER, 1, workdir, "reference", "episodes=1", "algorithm=gspo_token", checks=1, timeout=300)
    return workdir


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["dp2xcp2", pytest.param("tp2", marks=pytest.mark.slow)])
def test_layout_with_multi_turn_episodes_matches_tp1_reference(episodes_reference, name):
    """Multi-turn episodes (rollout/agent/): environment tokens with loss mask 0 inside each response and per-token
    advantages per turn (gspo_token): every layout's loss, grad norm and update equal TP1's (the mask and the
    advantages split with the rows over DP and CP ranks). TP2 (the mask is not split over TP) is in the slow
    tier: each layout costs ~40 s of the default suite."""
    nproc, args = LAYOUTS[name]
    run_checks(WORKER, nproc, episodes_reference, name, *args.split(), "episodes=1", "algorithm=gspo_token",
               checks=5, timeout=300)
