"""Context-parallel core attention and a tiny GPTModel under CP, on real gloo processes.

Each launch checks, at cp = world size, values and gradients against a single-process full-sequence
reference (see the worker's docstring for the list). ~13 s at cp=2, ~20 s at cp=4.
"""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks

WORKER = Path(__file__).parent / "workers" / "cp_attention_worker.py"


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_attention_matches_full_sequence_reference(cp_size):
    # cp=1 vs Megatron, the module alone (MHA, GQA, GQA + padding), packed rows at cp=1 and cp=world,
    # GPTModel (rotary, logits, grads), refusals
    run_checks(WORKER, cp_size, checks=10, timeout=180)
