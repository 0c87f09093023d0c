"""Converted HF checkpoints load into this project's Megatron model under every layout and match transformers.

Three tiny checkpoints made by transformers (tests/tiny_hf.py): Qwen3-MoE with norm_topk_prob
True (4 layers, saved in shards) and False, and a dense Qwen3 with tied embeddings. Each is converted
once here; transformers' float32 per-token log-probs on 2 x 128 random tokens are the reference.
Per (checkpoint, layout) the worker loads the converted checkpoint with `dist_checkpointing.load`,
checks log-probs within 1e-4 (measured ~2e-6) and that `iter_hf_tensors` gives back the HF tensors
bitwise, on every rank and with `dst=` on one rank only (tests/distributed/workers/convert_load.py). The 4-process launch also has Megatron save
the model itself at TP2xEP2 and exports that checkpoint bitwise. ~15 s and ~20 s on a quiet machine.
Not covered: dense_tied at PP2 (Megatron's tied-embedding set-up calls .cuda() under PP,
language_module.py:244, which the CPU patches do not cover).
"""
from pathlib import Path

import pytest
import torch

from devtools.torchrun import run_checks
from megatron_gspo.convert import convert_hf_to_mcore
from tests.tiny_hf import hf_logprobs, save_tiny

WORKER = Path(__file__).parent / "workers" / "convert_load.py"
KINDS = {"moe": "100KB", "moe_no_norm_topk": None, "dense_tied": None}  # kind: max_shard_size

# processes: {the worker's step (KIND[:key=value,...]): its checks}. Loading (check=load, the default): log-probs,
# export on every rank, export to one rank; resave=1: one more; check=parity: one.
LAUNCHES = {
    2: {"moe": 3, "moe:tp=2": 3, "moe:ep=2": 3, "moe:pp=2": 3, "moe_no_norm_topk:ep=2": 3, "moe_no_norm_topk:tp=2": 3,
        "dense_tied": 3, "dense_tied:tp=2": 3, "moe:tp=2,check=parity": 1},
    4: {"moe_no_norm_topk:tp=2,ep=2": 3, "moe:tp=2,ep=2,resave=1": 4},
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_load")
    tokens = torch.randint(0, 300, (2, 128), generator=torch.Generator().manual_seed(1))
    for kind, shard in KINDS.items():
        save_tiny(root / kind / "hf", kind, max_shard_size=shard)
        # Small data files for "moe" (DCP files cut mid-layer), one file for the others.
        convert_hf_to_mcore(root / kind / "hf", root / kind / "mcore", progress=False,
                            group_bytes=100_000 if kind == "moe" else 1 << 30)
        torch.save({"tokens": tokens, "logprobs": hf_logprobs(root / kind / "hf", tokens)}, root / kind / "ref.pt")
    return root


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: ~60 CPU-s
def test_converted_checkpoint_loads_and_matches_transformers(workdir, nproc):
    steps = LAUNCHES[nproc]
    run_checks(WORKER, nproc, workdir, *steps, checks=sum(steps.values()), timeout=300)
