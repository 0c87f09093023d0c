"""The tiny MoE built with Transformer Engine's layer spec and with the local spec, on one GPU, scored alike.

usage: torchrun --nproc-per-node 1 te_parity.py WORKDIR

WORKDIR holds `hf/` (a tiny Qwen3-MoE), `mcore/` (our conversion of it) and `ref.pt` (tokens [B, S] and
transformers' float32 per-token log-probs of tokens[:, 1:]). Both specs load the same checkpoint
(`load_weights`: one name table serves both, convert/mapping.py) in float32 and in bf16 parameters (the
trainer's model.dtype), and score the tokens with the trainer's log-probs (convert/parity.py
megatron_scores: Megatron's forward schedule, then vocab_parallel_logprobs). The results are printed on
one line tagged TE_PARITY (JSON) for the test; the checks here are only that each build is what it claims.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatron_gspo.config import ParallelConfig
from megatron_gspo.convert import read_hf_config
from megatron_gspo.convert.load import load_weights
from megatron_gspo.convert.parity import megatron_scores
from megatron_gspo.model import gpt
from megatron_gspo.model.spec import local_layer_spec
from megatron_gspo.parallel.groups import init_megatron
from tests.distributed.workers.checks import check, done

TE_MODULES = "megatron.core.extensions.transformer_engine"


def build(shape, pgs, spec: str, dtype: torch.dtype, mcore: Path):
    """build_model with the TE spec (what layer_spec gives on a GPU) or the local one, weights loaded."""
    if spec == "te":
        model = gpt.build_model(shape, gpt.transformer_config(shape, ParallelConfig(), params_dtype=dtype),
                                pgs=pgs, wrap_ddp=False)
    else:
        # build_model takes its spec from gpt.layer_spec, which picks TE whenever CUDA is available; the
        # local spec runs as SequentialMLP experts (no grouped GEMM), as on CPU.
        config = gpt.transformer_config(shape, ParallelConfig(), params_dtype=dtype, moe_grouped_gemm=False)
        chosen, gpt.layer_spec = gpt.layer_spec, lambda s: local_layer_spec(
            num_experts=s.num_experts, moe_grouped_gemm=False, qk_layernorm=True)
        try:
            model = gpt.build_model(shape, config, pgs=pgs, wrap_ddp=False)
        finally:
            gpt.layer_spec = chosen
    load_weights(model, mcore)
    for chunk in model:
        chunk.eval()
    return model


def main(workdir: Path) -> None:
    shape = read_hf_config(workdir / "hf")
    pgs = init_megatron(ParallelConfig())
    ref = torch.load(workdir / "ref.pt")
    tokens = ref["tokens"].cuda()
    results = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for spec in ("te", "local"):
            model = build(shape, pgs, spec, dtype, workdir / "mcore")
            te_modules = sorted({type(m).__name__ for m in model[0].modules() if type(m).__module__ == TE_MODULES})
            with check(f"{spec} {dtype_name} build uses {'only' if spec == 'te' else 'no'} TE layers"):
                assert bool(te_modules) == (spec == "te"), te_modules
                assert next(model[0].parameters()).dtype == dtype
            logprobs, argmax = megatron_scores(model, tokens, shape.vocab_size, pgs=pgs)
            results[f"{spec}_{dtype_name}"] = {"logprobs": logprobs.float().cpu().tolist(),
                                               "argmax": argmax.cpu().tolist(), "te_modules": te_modules}
            del model
            torch.cuda.empty_cache()
    print("TE_PARITY " + json.dumps(results), flush=True)
    done()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
