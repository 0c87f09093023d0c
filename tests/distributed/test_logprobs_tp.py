"""vocab_parallel_logprobs over TP 1, 2 and 4 gloo ranks vs a float64 reference: values, gradients."""
from pathlib import Path

import pytest

from megatron_gspo.parallel.launch import torchrun

WORKER = Path(__file__).parent / "workers" / "logprobs_tp.py"


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_logprobs_tp_matches_single_process(tp):
    out = torchrun(WORKER, tp, timeout=180)
    assert out.count(f"OK logprobs tp={tp} rank") == tp, out[-2000:]
