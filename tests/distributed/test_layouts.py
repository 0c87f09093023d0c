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
# absent; the variants of the step each launch runs, one after the other on the same processes). The reference is
# TP1, 1 micro-batch, every variant.
LAYOUTS = {
    "tp2": (2, "tp=2 variants=plain+correction"),
    "ep2": (2, "ep=2 variants=plain+correction"),
    "pp2": (2, "pp=2 microbatches=2 variants=plain+correction"),
    "cp2": (2, "cp=2 variants=plain+correction"),
    "dp2": (2, "variants=plain+correction"),
    "tp2xep2": (4, "tp=2 ep=2"),
    "tp2xpp2": (4, "tp=2 pp=2 microbatches=4"),
    "dp2xcp2": (4, "cp=2 microbatches=2 variants=plain+episodes"),
    "microbatches4": (1, "microbatches=4"),
}
"""Variants: plain (the batch as it is, GSPO); correction (train-inference correction on: capped geometric
weights and a token rejection, loss/correction.py); episodes (multi-turn responses: environment tokens with loss
mask 0 inside each response and per-token advantages per turn, gspo_token; the mask and the advantages split
with the rows over DP and CP ranks)."""
CHECKS = 5  # per rank and variant


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("layouts")
    run_checks(WORKER, 1, workdir, "reference", "variants=plain+correction+episodes", checks=3, timeout=300)
    return workdir


@pytest.mark.distributed
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_tp1_reference(reference, name):
    """Every variant's per-token log-probs, loss, clipped sequences, grad norm and update equal TP1's."""
    nproc, args = LAYOUTS[name]
    variants = next((a for a in args.split() if a.startswith("variants=")), "variants=plain")
    run_checks(WORKER, nproc, reference, name, *args.split(), checks=CHECKS * len(variants.split("+")), timeout=300)


@pytest.mark.distributed
@pytest.mark.slow
def test_multi_turn_episodes_at_tp2(reference):
    """Episodes at TP2 (the mask is not split over TP; DP2xCP2 runs them in the default suite)."""
    run_checks(WORKER, 2, reference, "tp2", "tp=2", "variants=episodes", checks=CHECKS, timeout=300)
