"""Stock SGLang on CUDA: a tiny dense and a tiny MoE Qwen3 served with log-probs, and weight sync into them
by CUDA-IPC tensors and by NCCL broadcast.

The CPU tier (tests/sglang/) cannot check either model kind on a GPU build (its MoE runs SGLang's native-torch
CPU paths: tests/sglang/test_sglang_moe_cpu.py), nor the two GPU transports.
Servers run in bf16, the production dtype, so log-probs are compared with transformers' float32
recompute within bf16 tolerance (mean |diff| < 0.1 over the sampled tokens: bf16 keeps 8 bits, the
log-probs are ~ -1..-10; a float32 CPU server gives ~3e-6; not yet measured on a GPU), and a sync is shown to deliver the new weights the way
tests/sglang/test_weight_sync_sglang.py shows it on CPU:
  - the served log-probs now match the perturbed model's recompute, and the old model's at least twice
    as badly (a float32 CPU server: 3e-6 against 4.0);
  - greedy outputs change;
  - syncing the original weights back restores the original greedy outputs exactly (the same bf16
    weights: the originals rounded once, as when the server loaded them).
Transports (megatron_gspo/rollout/sglang/weight_sync.py):
  - tensor: the tensors are on this process's GPU, so the ForkingPickler dump carries CUDA IPC handles and
    the server maps this process's memory (colocated servers: one GPU is enough);
  - broadcast: NCCL from this process (rank 0, GPU 0) to the server's rank (GPU 1). NCCL refuses two
    ranks of one communicator on one GPU ("Duplicate GPU detected"), so this one needs two GPUs.

Skipped without CUDA or without SGLang's CUDA build ($MEGATRON_GSPO_SGLANG_PYTHON, else .venv-sglang).
Run: python -m pytest tests/gpu/test_sglang_cuda.py -m gpu -s
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from gpu_requirements import cuda_missing, gpus_missing, sglang_cuda_missing, skip_unless
from megatron_gspo.config import RolloutConfig
from megatron_gspo.config import SamplingConfig
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
from megatron_gspo.rollout.sglang.client import RolloutClient
from megatron_gspo.rollout.sglang.server import ServerConfig, launch_servers
from megatron_gspo.samples import Prompt
from megatron_gspo.rollout.sglang.weight_sync import (BroadcastSync, ServerAdmin, TensorSync, connected, sync_by_tensor,
                                                     write_hf_checkpoint)
from tests.sglang.sglang_test_utils import push_during_rollout, recompute_logprobs
from tests.tiny_hf import read_all

pytestmark = [pytest.mark.gpu, *skip_unless(cuda_missing(), sglang_cuda_missing())]
# Head size 64, MLP and expert widths multiples of 128: sizes every CUDA attention / fused-MoE kernel accepts.
# A smaller init than the demo's 0.2 keeps the logits moderate, so bf16 rounding stays ~1e-2.
DENSE = TinyQwen3Spec(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_layers=2,
                      intermediate_size=512, initializer_range=0.1)
SPECS = {"dense": DENSE,
         "moe": dataclasses.replace(DENSE, num_layers=3, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=128)}
# A quarter of the GPU for the KV cache (the default takes ~90%, leaving nothing to this process's
# tensors); no CUDA graphs: their capture costs start-up time and nothing is measured here.
SERVER_ARGS = ("--mem-fraction-static", "0.25", "--disable-cuda-graph")
PROMPTS = [Prompt(0, [259, 11, 23, 29]), Prompt(1, [300, 12]), Prompt(2, [45, 46, 47])]
BF16_MEAN_TOLERANCE = 0.1


def server_config(model_dir, log_dir) -> ServerConfig:
    return ServerConfig(model_path=str(model_dir), settings=RolloutConfig(server_args=SERVER_ARGS, server_startup_timeout_s=300),
                        device="cuda", dtype="bfloat16", weight_version="0", log_dir=str(log_dir))


@pytest.fixture(scope="module", params=list(SPECS))
def served(request, tmp_path_factory):
    """One server on GPU 0 per model kind (module scope: dense's tests, then MoE's)."""
    root = tmp_path_factory.mktemp(f"sglang_cuda_{request.param}")
    model_dir = make_tiny_qwen3(root / "hf", SPECS[request.param])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with launch_servers(server_config(model_dir, root / "logs"), num_servers=1, gpu_ids=[0]) as servers:
        print(f"\nSGLang CUDA server ({request.param}) ready after {servers[0].ready_after_s:.0f} s")
        yield SimpleNamespace(kind=request.param, dir=model_dir, url=servers[0].url, hf=hf, root=root)


@pytest.fixture(scope="module")
def perturbed(served):
    """The checkpoint's tensors (float32, CPU), a perturbed copy, and transformers' model of the copy."""
    from transformers import AutoModelForCausalLM

    original = read_all(served.dir)
    g = torch.Generator().manual_seed(0)
    changed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    folder = write_hf_checkpoint(changed.items(), served.root / "perturbed", served.dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return SimpleNamespace(original=original, changed=changed, model=model)


def rollout(url: str, temperature: float, n: int = 1):
    groups, _ = RolloutClient([url], RolloutConfig()).generate_sync(
        PROMPTS, n, SamplingConfig(temperature=temperature, max_new_tokens=12))
    return [s for g in groups for s in g]


def logprob_error(samples, model) -> float:
    """Mean |server log-prob - transformers' float32 recompute| over every sampled token."""
    return torch.cat([(torch.tensor(s.rollout_logprobs) - recompute_logprobs(model, s, 1.0)).abs()
                      for s in samples]).mean().item()


def test_serves_with_logprobs(served):
    samples = rollout(served.url, 1.0, n=4)
    assert len(samples) == 4 * len(PROMPTS)
    for s in samples:
        assert 0 < len(s.response_ids) == len(s.rollout_logprobs) <= 12
        assert all(lp <= 0 and lp > float("-inf") for lp in s.rollout_logprobs), s.rollout_logprobs
        assert s.weight_version == "0"
    error = logprob_error(samples, served.hf)
    print(f"{served.kind}: |SGLang bf16 - transformers fp32| mean {error:.3e} over the sampled tokens")
    assert error < BF16_MEAN_TOLERANCE, error


def check_sync_delivers_and_restores(url, sync, served, perturbed, name: str):
    """sync(tensors, version) the perturbed weights, check the server serves them, sync the originals back."""
    before = [s.response_ids for s in rollout(url, 0.0)]
    sync(perturbed.changed, f"{name}-1")
    assert ServerAdmin(url).weight_version() == f"{name}-1"
    sampled = rollout(url, 1.0, n=2)
    assert all(s.weight_version == f"{name}-1" for s in sampled)
    new_error, old_error = logprob_error(sampled, perturbed.model), logprob_error(sampled, served.hf)
    print(f"{served.kind} {name} sync: |server - recompute| perturbed model {new_error:.3e}, "
          f"original model {old_error:.3e}")
    assert new_error < BF16_MEAN_TOLERANCE and new_error < 0.5 * old_error, (new_error, old_error)
    assert [s.response_ids for s in rollout(url, 0.0)] != before
    sync(perturbed.original, f"{name}-0")
    assert [s.response_ids for s in rollout(url, 0.0)] == before


def test_tensor_sync_by_cuda_ipc(served, perturbed):
    def sync(state, version):
        on_gpu = [(k, v.cuda()) for k, v in state.items()]  # CUDA tensors: the pickle holds IPC handles
        with connected([served.url]) as admins:
            sync_by_tensor(admins, on_gpu, version, bucket_bytes=1 << 20)  # several buckets
    check_sync_delivers_and_restores(served.url, sync, served, perturbed, "ipc")


@pytest.mark.skipif(gpus_missing(2) is not None, reason=f"{gpus_missing(2)}: NCCL refuses two ranks of one "
                    "group on one GPU ('Duplicate GPU detected'), so trainer and server need a GPU each")
def test_broadcast_sync_by_nccl(served, perturbed):
    with launch_servers(server_config(served.dir, served.root / "logs_gpu1"), num_servers=1, gpu_ids=[1]) as servers:
        url = servers[0].url
        broadcast = BroadcastSync([url], backend="nccl", timeout_s=120)
        broadcast.connect()
        try:
            def sync(state, version):
                broadcast.push([(k, v.to("cuda:0")) for k, v in state.items()], version, bucket_bytes=1 << 20)
            check_sync_delivers_and_restores(url, sync, served, perturbed, "nccl")
        finally:
            broadcast.close()


def test_partial_rollout_push_into_requests_in_flight(served, perturbed):
    """rollout.partial_rollout on CUDA: a CUDA-IPC push while 6 long requests generate pauses them (retract),
    loads the new weights and continues them; the tokens after each response's stale prefix carry the new
    weights' log-probs (tests/sglang/test_partial_rollout_sglang.py checks the same on CPU in float32)."""
    client = RolloutClient([served.url], RolloutConfig(partial_rollout=True, max_staleness=1))
    pushes = TensorSync([served.url], bucket_bytes=1 << 20, pause_generation=True)
    prompts = [Prompt(i, [40 + i, 41, 42]) for i in range(6)]
    on_gpu = [(k, v.cuda()) for k, v in perturbed.changed.items()]
    try:
        samples, _ = push_during_rollout(client, prompts, 1, SamplingConfig(temperature=1.0, max_new_tokens=1000),
                                         lambda: pushes.push(on_gpu, "partial-1"))
        cut = [s for s in samples if s.stale_prefix]
        print(f"{served.kind} partial: {len(cut)} of {len(samples)} responses cut by the push, stale prefixes "
              f"{[s.stale_prefix for s in cut]} of {[len(s.response_ids) for s in cut]} tokens")
        assert cut, "no response was in flight at the push (responses ended early?)"
        for s in cut:
            assert s.weight_version == "partial-1"
            tail = dataclasses.replace(s, prompt_ids=s.prompt_ids + s.response_ids[:s.stale_prefix],
                                       response_ids=s.response_ids[s.stale_prefix:],
                                       rollout_logprobs=s.rollout_logprobs[s.stale_prefix:], stale_prefix=0)
            new_error, old_error = logprob_error([tail], perturbed.model), logprob_error([tail], served.hf)
            assert new_error < BF16_MEAN_TOLERANCE and new_error < 0.5 * old_error, (new_error, old_error)
    finally:
        pushes.push([(k, v.cuda()) for k, v in perturbed.original.items()], "0")
        pushes.close()
