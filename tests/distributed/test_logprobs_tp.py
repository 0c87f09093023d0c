"""vocab_parallel_logprobs over TP 1, 2 and 4 gloo ranks vs a float64 reference: values, gradients."""
from pathlib import Path

import pytest

from devtools.torchrun import run_checks

WORKER = Path(__file__).parent / "workers" / "logprobs_tp.py"


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes
def test_logprobs_tp_matches_single_process(tp):
    # 3 checks per case (copy, inplace, inplace == copy); 8 cases, 12 with an all-padding last shard
    run_checks(WORKER, tp, checks=3 * (8 if tp == 1 else 12), timeout=180)
