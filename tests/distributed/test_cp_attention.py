"""Context-parallel core attention and a tiny GPTModel under CP, on real gloo processes.

Each launch checks, at cp = world size, values and gradients against a single-process full-sequence
reference (see the worker's docstring for the list). ~13 s at cp=2, ~20 s at cp=4.
"""
from pathlib import Path

import pytest

from megatron_gspo.parallel.launch import torchrun

WORKER = Path(__file__).parent / "workers" / "cp_attention_worker.py"


@pytest.mark.distributed
@pytest.mark.parametrize("cp_size", [2, 4])
def test_cp_attention_matches_full_sequence_reference(cp_size):
    out = torchrun(WORKER, cp_size, timeout=180)
    assert out.count(f"cp={cp_size} checks passed") == cp_size
