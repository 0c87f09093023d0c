"""MoE Routing Replay (gspo.routing_replay=old) through train_on_batch at the layouts of the issue.

A hook at every router checks that each training forward used exactly the routing recorded in the
recompute pass (mode old) or routed freely (off); mini-batch 1's ratios are exactly 1 either way; the
routing-changed fraction is 0 before any update and > 0 after it, the same with and without replay;
GRPO + replay gives the TP1 reference's loss, grad norm and update at every layout
(tests/distributed/workers/routing_replay.py has the checks and their tolerances).
"""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks

WORKER = Path(__file__).parent / "workers" / "routing_replay.py"
CHECKS = 13  # per rank, reference included: 9 in each run's own checks + 4 comparisons

# name: (processes, the worker's key=value arguments: tp, pp, cp, ep (1 where absent), max tokens per
# micro-batch (8192 where absent; 64 tokens: 3-4 micro-batches per mini-batch), packed=1: packed rows).
LAYOUTS = {
    "microbatches4": (1, "max_tokens=64"),
    "ep2": (2, "ep=2"),
    "ep2_microbatches4": (2, "ep=2 max_tokens=64"),
    "tp2xep2": (4, "tp=2 ep=2"),
    "pp2": (2, "pp=2 max_tokens=64"),
    "cp2": (2, "cp=2"),
    "packed_microbatches4": (1, "max_tokens=64 packed=1"),
    "packed_ep2": (2, "ep=2 max_tokens=64 packed=1"),
    "packed_cp2": (2, "cp=2 max_tokens=64 packed=1"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("routing_replay")
    run_checks(WORKER, 1, workdir, "reference", checks=CHECKS - 4, timeout=300)
    return workdir


SLOW = {"packed_microbatches4", "packed_cp2", "microbatches4"}
"""In the slow tier (-m slow): packed-row layouts beyond EP2 (each path of packed rows with replay runs in the
default suite at EP2) and one process with 4 micro-batches (EP2 with 4 micro-batches stays). ~25-40 CPU-s a
launch."""
ROLLOUT_SLOW = {"packed", "tp2", "pp2"}
"""In the slow tier: one packed process, and TP2 and PP2 of R3 with the Megatron sampler (EP2, CP2 and packed
EP2 stay; TP (TP2xEP2) and PP replay run in the default suite with `old`)."""


def layouts(names, slow):
    return [pytest.param(n, marks=pytest.mark.slow) if n in slow else n for n in names]


@pytest.mark.distributed
@pytest.mark.parametrize("name", layouts(LAYOUTS, SLOW))
def test_routing_replay_matches_tp1_reference(reference, name):
    nproc, args = LAYOUTS[name]
    packed = "packed=1" in args.split()  # one more check: responses are packed several to a row
    run_checks(WORKER, nproc, reference, name, *args.split(), checks=CHECKS + packed, timeout=300)


ROLLOUT_WORKER = Path(__file__).parent / "workers" / "rollout_routing.py"
ROLLOUT_LAYOUTS = {  # name: (processes, the worker's key=value arguments: tp, pp, cp, ep, packed=1: packed rows)
    "tp2": (2, "tp=2"),
    "cp2": (2, "cp=2"),
    "pp2": (2, "pp=2"),
    "ep2": (2, "ep=2"),
    "packed": (1, "packed=1"),
    "packed_ep2": (2, "ep=2 packed=1"),
}


@pytest.fixture(scope="module")
def rollout_reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("rollout_routing")
    run_checks(ROLLOUT_WORKER, 1, workdir, "reference", checks=5, timeout=300)
    return workdir


@pytest.mark.distributed
@pytest.mark.parametrize("name", layouts(ROLLOUT_LAYOUTS, ROLLOUT_SLOW))
def test_rollout_routing_replay_with_the_megatron_sampler(rollout_reference, name):
    """gspo.routing_replay=rollout: the sampler's recorded routing (same at every layout), replayed by the trainer."""
    nproc, args = ROLLOUT_LAYOUTS[name]
    packed = "packed=1" in args.split()  # one more check: responses are packed several to a row
    run_checks(ROLLOUT_WORKER, nproc, rollout_reference, name, *args.split(), checks=5 + packed, timeout=300)
