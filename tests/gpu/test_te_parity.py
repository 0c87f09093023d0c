"""Transformer Engine layer spec vs the local spec on one GPU: per-token log-probs of the tiny Qwen3-MoE.

On a GPU `model.gpt.layer_spec` gives the TE spec (fused norm + linear, TE's attention, grouped-GEMM
experts); on CPU every test runs the local spec, whose parity with transformers tests/distributed/
test_convert_load.py checks to 1e-4. Here both specs load the same converted checkpoint on the GPU
(tests/gpu/workers/te_parity.py) and score 2 x 256 random tokens; transformers' float32 log-probs on CPU
are the reference.

Tolerances, per token log-prob |difference| (the values are ~ -6):
  float32 parameters, TF32 off (NVIDIA_TF32_OVERRIDE=0, so no GEMM rounds its inputs to 10 bits): TE vs
    local and each vs transformers max <= 1e-3, mean <= 1e-4 (float32 reassociation gives ~1e-5; a wrong
    norm, rotary or routing gives >= 1e-1).
  bf16 parameters: each spec's own bf16 error against the float32 reference is ~1e-2 (bf16 keeps 8
    bits); TE's mean error must be at most 1.5x the local spec's (or 0.02), TE vs local mean <= 0.1, and
    the bf16 TE model's argmax next token equals its float32 one at >= 90% of the positions.
Not yet run on a GPU: the thresholds are derived, not measured.

Skipped without CUDA or without Transformer Engine. Run: python -m pytest tests/gpu/test_te_parity.py -m gpu -s
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpu_requirements import cuda_missing, skip_unless, te_missing
from devtools.torchrun import run_checks
from megatron_gspo.convert import convert_hf_to_mcore
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
from tests.tiny_hf import hf_logprobs

pytestmark = [pytest.mark.gpu, *skip_unless(cuda_missing(), te_missing())]
WORKER = Path(__file__).parent / "workers" / "te_parity.py"
# Head size 64 and expert width 128: sizes every fused attention and grouped-GEMM kernel accepts. A
# smaller init than the demo's 0.2 keeps the logits moderate, so bf16 rounding stays ~1e-2.
SPEC = TinyQwen3Spec(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_layers=3,
                     intermediate_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                     initializer_range=0.1)


@pytest.fixture(scope="module")
def scores(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("te_parity")
    make_tiny_qwen3(workdir / "hf", SPEC)
    convert_hf_to_mcore(workdir / "hf", workdir / "mcore", progress=False)
    tokens = torch.randint(0, SPEC.vocab_size, (2, 256), generator=torch.Generator().manual_seed(0))
    torch.save({"tokens": tokens, "logprobs": hf_logprobs(workdir / "hf", tokens)}, workdir / "ref.pt")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NVIDIA_TF32_OVERRIDE", "0")  # inherited by the worker (see the tolerances above)
        out = run_checks(WORKER, 1, workdir, checks=4, timeout=300)
    line = next(line for line in out.splitlines() if line.startswith("TE_PARITY "))
    results = {k: {"logprobs": torch.tensor(v["logprobs"]), "argmax": torch.tensor(v["argmax"]),
                   "te_modules": v["te_modules"]} for k, v in json.loads(line.removeprefix("TE_PARITY ")).items()}
    results["hf_fp32"] = {"logprobs": torch.load(workdir / "ref.pt")["logprobs"]}
    print(f"\nTE modules in the TE build: {results['te_fp32']['te_modules']}")
    return results


def diff(scores, a: str, b: str) -> tuple[float, float]:
    d = (scores[a]["logprobs"].double() - scores[b]["logprobs"].double()).abs()
    print(f"|{a} - {b}|: max {d.max():.2e} mean {d.mean():.2e}")
    return d.max().item(), d.mean().item()


def test_fp32_te_matches_local_and_transformers(scores):
    for a, b in (("te_fp32", "local_fp32"), ("te_fp32", "hf_fp32"), ("local_fp32", "hf_fp32")):
        worst, mean = diff(scores, a, b)
        assert worst <= 1e-3 and mean <= 1e-4, (a, b, worst, mean)


def test_bf16_te_is_no_worse_than_local(scores):
    _, te_error = diff(scores, "te_bf16", "hf_fp32")
    _, local_error = diff(scores, "local_bf16", "hf_fp32")
    _, between = diff(scores, "te_bf16", "local_bf16")
    assert te_error <= max(1.5 * local_error, 0.02), (te_error, local_error)
    assert between <= 0.1, between
    agree = (scores["te_bf16"]["argmax"] == scores["te_fp32"]["argmax"]).double().mean().item()
    print(f"bf16 vs fp32 TE argmax agreement {agree:.3f}")
    assert agree >= 0.9, agree
