"""Routed experts from a real SGLang server on a GPU (the CUDA kernels' routing; the CPU tier checks SGLang's
native-torch one: tests/sglang/test_sglang_moe_cpu.py): a tiny Qwen3-MoE served with
--enable-return-routed-experts; every sample's array has P + R - 1 positions of [L, k] distinct expert ids,
and they are the experts the Hugging Face model's own routers pick for the same tokens at the same
positions (an off-by-one in the positions would match only by chance).

Deselected by default (scripts/test.sh: -m "not slow and not gpu and not e2e"); skipped without CUDA
or without the SGLang environment. Run: .venv/bin/python -m pytest tests/gpu/test_routed_experts_sglang.py -m gpu
"""
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_gspo.config import RolloutConfig

from megatron_gspo.config import SamplingConfig
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, arithmetic_corpus, make_tiny_qwen3
from megatron_gspo.rollout.sglang.client import RolloutClient
from megatron_gspo.rollout.sglang.routed_experts import RoutingSpec
from megatron_gspo.rollout.sglang.server import ServerConfig, default_sglang_python, launch_servers
from megatron_gspo.samples import Prompt
from tests.tiny_hf import hf_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not Path(default_sglang_python()).exists(), reason="no SGLang environment"),
]
# Head size 64 and expert width 128: sizes every CUDA attention / fused-MoE kernel accepts.
SPEC = TinyQwen3Spec(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     num_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128)
G = 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_moe"), SPEC)


@pytest.fixture(scope="module")
def groups(moe_dir, tmp_path_factory):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(moe_dir)
    prompts = [Prompt(group_id=i, prompt_ids=tokenizer(line.split("=")[0] + "=")["input_ids"])
               for i, line in enumerate(arithmetic_corpus(4, seed=0))]
    routing = RoutingSpec.from_hf_config(moe_dir)
    config = ServerConfig(model_path=str(moe_dir), settings=RolloutConfig(server_startup_timeout_s=600), device="cuda",
                          dtype="float32", return_routed_experts=True, log_dir=str(tmp_path_factory.mktemp("sglang_logs")))
    with launch_servers(config, num_servers=1, gpu_ids=[0]) as servers:
        client = RolloutClient([servers[0].url], RolloutConfig(), routed_experts=routing)
        groups, _ = client.generate_sync(prompts, G, SamplingConfig(max_new_tokens=16))
    return groups


def test_shape_dtype_and_ids(groups):
    assert len(groups) == 4
    for sample in (s for g in groups for s in g):
        P, R = len(sample.prompt_ids), len(sample.response_ids)
        ids = sample.routed_experts
        assert ids.shape == (P + R - 1, SPEC.num_layers, SPEC.num_experts_per_tok)
        assert ids.dtype == np.uint8 and ids.max() < SPEC.num_experts
        # top-k picks k different experts for every position and layer
        assert (np.diff(np.sort(ids, axis=-1), axis=-1) > 0).all()


def test_ids_are_the_experts_hf_routes_to(groups, moe_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    aligned, shifted = [], []
    for sample in (s for g in groups for s in g):
        sglang = np.sort(sample.routed_experts, axis=-1)
        hf, _ = hf_routing(model, sample.prompt_ids + sample.response_ids[:-1])
        assert hf.shape == sglang.shape
        aligned.append((hf == sglang).all(-1).ravel())
        shifted.append((hf[1:] == sglang[:-1]).all(-1).ravel())  # what an off-by-one would give
    aligned, shifted = np.concatenate(aligned).mean(), np.concatenate(shifted).mean()
    print(f"\n(position, layer) expert sets equal to HF's: {aligned:.3f}; shifted by one: {shifted:.3f}")
    # Float32 on both sides: only near-tied router logits may differ (GPU vs CPU matmul order).
    assert aligned >= 0.95 and shifted < aligned - 0.3, (aligned, shifted)
