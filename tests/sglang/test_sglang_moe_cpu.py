"""SGLang on CPU serving a tiny Qwen3-MoE (written by transformers, float32): its log-probs and its routed
experts are those of transformers' own float32 forward, and the trainer replaying those routed experts
(gspo.routing_replay=rollout, R3) routes and scores every response token as SGLang did.

SGLang 0.5.23 runs a MoE on a CPU without AMX on pure-torch paths (TopK.forward_native ->
fused_topk_torch_native, layers/moe/topk.py; UnquantizedFusedMoEMethod.forward_native = forward_cpu ->
moe_forward_native, layers/moe/fused_moe_native.py). Those need no patch: the log-prob test passes on stock
SGLang and fails when the router's top-k renormalisation is broken on purpose (measured, 1.5-4.0 max delta).
One server for both tests, started with --enable-return-routed-experts, which on CPU needs the plugin's
unpinned host buffer (platform/sglang_cpu_stubs/megatron_gspo_sglang_cpu_routing.py; without it the
server dies at start-up and every test here errors). The last test trains on it and pushes its weights there:
nothing after it may use the server.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from devtools.torchrun import torchrun
from megatron_gspo.config import RolloutConfig, SamplingConfig
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, arithmetic_corpus, make_tiny_qwen3
from megatron_gspo.rollout.sglang.client import RolloutClient
from megatron_gspo.rollout.sglang.routed_experts import RoutingSpec, decode_routed_experts
from megatron_gspo.rollout.sglang.server import ServerConfig, cpu_plugin, launch_servers
from megatron_gspo.samples import Prompt
from tests.tiny_hf import hf_routing

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]
# The demo's tiny model (2 layers, hidden 64, vocab 512 of the tiny tokenizer) with 8 experts of width 48,
# top-2: 28 possible expert pairs per position, so a routing array off by one position cannot match.
SPEC = TinyQwen3Spec(num_experts=8, num_experts_per_tok=2)
TEMPERATURE = 0.7
LOGPROB_TOLERANCE = 1e-4
"""Max |SGLang - transformers| of a log-prob. Measured on this model (float32 on both sides, CPU), two runs
at 1, 4 and 16 prompts per request: up to 2.1e-6 (prompt tokens) and 6.7e-6 (response tokens)."""
ROUTER_TIE = 1e-4
"""Router logits closer than this at the top-k boundary may pick either expert (float32 rounding differs
between the two implementations); measured: no such position in this test."""


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_moe"), SPEC)


@pytest.fixture(scope="module")
def moe_server(moe_dir, tmp_path_factory):
    config = ServerConfig(model_path=str(moe_dir), settings=RolloutConfig(server_startup_timeout_s=240), device="cpu",
                          dtype="float32", return_routed_experts=True,
                          log_dir=str(tmp_path_factory.mktemp("sglang_moe_logs")))
    with launch_servers(config, num_servers=1) as servers:
        print(f"\nSGLang MoE server ready after {servers[0].ready_after_s:.1f} s")
        yield servers[0]


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def moe_tokenizer(moe_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(moe_dir)


def ragged_prompts(tokenizer, k: int, seed: int) -> list[list[int]]:
    """k prompts of 1 to 3 arithmetic lines ("12+7=19 5*3="), 4 to ~20 tokens: a ragged batch."""
    lines = arithmetic_corpus(3 * k, seed)
    return [tokenizer(" ".join(lines[3 * i: 3 * i + 1 + i % 3]).rsplit("=", 1)[0] + "=")["input_ids"]
            for i in range(k)]


def generate(server, prompts: list[list[int]], **body) -> list[dict]:
    """One /generate request for all `prompts` (SGLang's batch form); the answers, prompt-major."""
    response = httpx.post(f"{server.url}/generate", json={"input_ids": prompts, **body}, timeout=120)
    response.raise_for_status()
    return response.json()


def logprobs_of(entries) -> torch.Tensor:
    """SGLang's [[logprob, token id, text], ...] -> the log-probs; a NaN arrives as null and stays NaN."""
    return torch.tensor([float("nan") if e[0] is None else e[0] for e in entries], dtype=torch.float64)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_logprobs_equal_transformers_float32(moe_server, hf_moe, moe_tokenizer, batch):
    """Response log-probs are log_softmax(logits / T), prompt log-probs (logprob_start_len=0) are
    log_softmax(logits), not temperature-scaled (PLATFORM facts, SGLang 0.5.23)."""
    prompts = ragged_prompts(moe_tokenizer, batch, seed=batch)
    answers = generate(moe_server, prompts, return_logprob=True, logprob_start_len=0,
                       sampling_params={"max_new_tokens": 8, "temperature": TEMPERATURE})
    assert len(answers) == batch
    prompt_deltas, response_deltas = [], []
    for prompt, answer in zip(prompts, answers):
        P, response = len(prompt), answer["output_ids"]
        meta = answer["meta_info"]
        with torch.no_grad():
            logits = hf_moe(torch.tensor([prompt + response])).logits[0].double()
        targets = torch.tensor(prompt[1:] + response)[:, None]
        expected_prompt = torch.log_softmax(logits[:P - 1], -1).gather(1, targets[:P - 1])[:, 0]
        expected_response = torch.log_softmax(logits[P - 1:-1] / TEMPERATURE, -1).gather(1, targets[P - 1:])[:, 0]
        # The first prompt token has no log-prob (nothing predicts it).
        prompt_deltas.append((logprobs_of(meta["input_token_logprobs"][1:]) - expected_prompt).abs())
        response_deltas.append((logprobs_of(meta["output_token_logprobs"]) - expected_response).abs())
    prompt_delta, response_delta = torch.cat(prompt_deltas), torch.cat(response_deltas)
    print(f"\n{batch} prompts: max |SGLang - transformers fp32| prompt {prompt_delta.max():.1e} "
          f"({prompt_delta.numel()} tokens), response {response_delta.max():.1e} ({response_delta.numel()} tokens)")
    assert prompt_delta.isfinite().all() and response_delta.isfinite().all(), "NaN log-probs from the server"
    assert prompt_delta.max() < LOGPROB_TOLERANCE and response_delta.max() < LOGPROB_TOLERANCE


def test_routed_experts_are_transformers_top_k(moe_server, moe_dir, hf_moe, moe_tokenizer):
    """meta_info.routed_experts ([P + R - 1, L, k], rollout/routed_experts.py) holds, at every input
    position and layer, the expert set transformers routes that token to; the same array read one
    position off does not."""
    assert cpu_plugin("megatron_gspo_sglang_cpu_routing").INSTALLED in moe_server.log_path.read_text(errors="replace")
    spec = RoutingSpec.from_hf_config(moe_dir)
    prompts = ragged_prompts(moe_tokenizer, 4, seed=7)
    answers = generate(moe_server, prompts, return_routed_experts=True,
                       sampling_params={"max_new_tokens": 8, "temperature": 1.0, "n": 2})
    assert len(answers) == 2 * len(prompts)
    aligned, shifted, ties = [], [], 0
    for i, answer in enumerate(answers):
        prompt, response = prompts[i // 2], answer["output_ids"]
        served = np.sort(decode_routed_experts(answer["meta_info"]["routed_experts"], prompt_len=len(prompt),
                                               response_len=len(response), spec=spec), axis=-1)
        expected, tie = hf_routing(hf_moe, prompt + response[:-1], ROUTER_TIE)  # the last response token: never fed back
        assert served.shape == expected.shape == (len(prompt) + len(response) - 1, SPEC.num_layers, 2)
        aligned.append((served == expected).all(-1) | tie)
        shifted.append((served[1:] == expected[:-1]).all(-1) | tie[:-1])
        ties += int(tie.sum())
    aligned, shifted = np.concatenate(aligned).ravel(), np.concatenate(shifted).ravel()
    print(f"\n(position, layer) expert sets equal to transformers': {aligned.mean():.3f} of {aligned.size}; "
          f"one position off: {shifted.mean():.3f}; near-tied routers excused: {ties}")
    assert aligned.all()
    assert not shifted.all()


REPLAY_WORKER = REPO / "tests" / "distributed" / "workers" / "replay_sglang_routing.py"


def test_the_trainer_replays_sglang_routing_position_by_position(moe_server, moe_dir, moe_tokenizer, tmp_path):
    """Real samples through the trainer's client (routed experts decoded into Sample.routed_experts), replayed
    by the trainer's recompute pass (a 1-process Megatron model loaded from the same HF weights; the worker
    says how): SGLang's arrays as sent give its log-probs within float32 noise and a routing the trainer's
    routers agree with everywhere; the same arrays one position late, or with layers 0 and 1 exchanged, replay
    other experts (the changed fraction says so) and move the log-probs far beyond that noise. So a routing
    bound to the wrong positions or layers cannot pass this test."""
    spec = RoutingSpec.from_hf_config(moe_dir)
    client = RolloutClient([moe_server.url], RolloutConfig(), routed_experts=spec)
    prompts = [Prompt(group_id=i, prompt_ids=ids) for i, ids in enumerate(ragged_prompts(moe_tokenizer, 4, seed=11))]
    groups, _ = client.generate_sync(prompts, 4, SamplingConfig(temperature=TEMPERATURE, max_new_tokens=8))
    samples = [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "rollout_logprobs": s.rollout_logprobs,
                "routed_experts": s.routed_experts} for group in groups for s in group]
    torch.save(samples, tmp_path / "samples.pt")
    torchrun(REPLAY_WORKER, 1, tmp_path, moe_dir, TEMPERATURE, timeout=300)
    results = json.loads((tmp_path / "results.json").read_text())
    print("\n" + "\n".join(f"{name}: routing changed {r['changed_fraction']:.3f}, |train - SGLang| log-prob mean "
                            f"{r['gap_mean']:.1e} max {r['gap_max']:.1e} over {r['tokens']} response tokens"
                            for name, r in results.items()))
    aligned = results["aligned"]
    assert aligned["changed_fraction"] == 0.0
    assert aligned["gap_max"] < LOGPROB_TOLERANCE
    for name in ("shifted", "layers_swapped"):
        assert results[name]["changed_fraction"] > MISALIGNED_CHANGED, (name, results[name])
        assert results[name]["gap_mean"] > 100 * aligned["gap_max"], (name, results[name])


MISALIGNED_CHANGED = 0.3
"""Least changed fraction of a misaligned routing: with 28 expert pairs per position two different positions
(or layers) rarely pick the same pair. Measured: shifted 0.90, layers swapped 0.97 (128 response tokens)."""


@pytest.mark.slow  # the replay itself is checked position by position above; this is the whole run
def test_train_ep2_replays_sglang_routing(moe_server, moe_dir, tmp_path):
    """`megatron-gspo train` of the MoE example at EP2 (2 processes, 4 experts each) on this server with
    gspo.routing_replay=rollout: 2 rollout steps of 2 mini-batches. Every step's recompute (before its
    updates, on the weights SGLang sampled with: at step 2 those the run synced to it) routes as SGLang did and
    matches its log-probs; the routing the updated weights would pick, moe/routing_changed_fraction, is logged
    for every mini-batch (0 for the first: its weights sampled). Runs last: it changes the server's weights."""
    run_dir = tmp_path / "run"
    overrides = [f"model.hf_path={moe_dir}", f"rollout.server_urls={moe_server.url}", "rollout.backend=sglang",
                 "gspo.routing_replay=rollout", f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir / 'ckpt'}",
                 "num_steps=2", "eval.interval=0", "gspo.prompts_per_step=4", "gspo.group_size=4",
                 "gspo.num_minibatches=2", "gspo.dynamic_sampling=false", "reward.workers=1",
                 "reward.fn=reward_fns:first_token_odd"]  # varies within a group: the updates move the weights
    proc = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "train", str(REPO / "examples/tiny_moe_cpu.yaml"),
                           *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests' / 'unit'}"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss/value" in r]
    print("\nstep, weight version, routing vs SGLang's, |train - SGLang| log-prob, routing changed by updates: "
          + "; ".join(f"{r['step']} {r['rollout/weight_version']} {r['moe/routing_rollout_changed_fraction']} "
                      f"{r['train/rollout_abs_delta_token']:.1e} {r['moe/routing_changed_fraction']:.3f}"
                      for r in records))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    versions = [r["rollout/weight_version"] for r in records]  # the server's own, then the run's first push
    assert versions[0] == versions[1] != "1" and versions[2:] == ["1", "1"], versions
    assert any(r["train/grad_norm"] > 0 for r in records)
    for r in records:
        assert r["moe/routing_rollout_changed_fraction"] == 0.0, r
        assert r["train/rollout_abs_delta_token"] < LOGPROB_TOLERANCE, r
        assert 0.0 <= r["moe/routing_changed_fraction"] <= 1.0
    assert records[0]["moe/routing_changed_fraction"] == records[2]["moe/routing_changed_fraction"] == 0.0
