"""Rollouts from real SGLang servers on CPU: groups, log-probs vs a float32 recompute, failover, errors."""
import asyncio
import json
import subprocess
import sys

import pytest
import torch

from megatron_gspo.config import RolloutConfig

from megatron_gspo.config import SamplingConfig
from megatron_gspo.rollout.sglang.client import RolloutClient, RolloutError
from megatron_gspo.rollout.sglang.server import SHM_DIR, cpu_plugin, shm_files_of_group
from sglang_test_utils import API_KEY, make_prompts, recompute_logprobs

pytestmark = pytest.mark.sglang
INSTALLED = cpu_plugin().INSTALLED  # what the CPU plugin prints to a server's log when SGLang loads it
G = 4


def client(servers, **overrides):
    return RolloutClient([s.url for s in servers], RolloutConfig(api_key=API_KEY, **overrides))


@pytest.mark.parametrize("temperature, parallel_sampling, groups_per_request",
                         [(1.0, "n", 1), (0.7, "copies", 1), (1.0, "n", 4), (1.0, "copies", 4)])
def test_groups_with_logprobs_match_float32_recompute(servers, tokenizer, hf_model, temperature, parallel_sampling,
                                                      groups_per_request):
    """Also: the servers run the CPU plugin's batched attention (platform/sglang_cpu_stubs/), whose
    log-probs are the ones checked here; both ways of asking for a group's samples, one group per request
    or several (SGLang's batch form: a sample given to the wrong prompt fails the recompute)."""
    assert all(INSTALLED in s.log_path.read_text(errors="replace") for s in servers)
    prompts = make_prompts(tokenizer, 6)
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=24)
    groups, stats = client(servers, parallel_sampling=parallel_sampling,
                           groups_per_request=groups_per_request).generate_sync(prompts, G, sampling)
    assert [g[0].group_id for g in groups] == list(range(6))
    deltas = []
    for prompt, group in zip(prompts, groups):
        assert [s.sample_index for s in group] == list(range(G))
        for s in group:
            assert s.prompt_ids == prompt.prompt_ids and s.weight_version == "default"
            assert 1 <= len(s.response_ids) == len(s.rollout_logprobs) <= 24
            assert s.finish_reason in ("stop", "length")
            ref = recompute_logprobs(hf_model, s, temperature)
            deltas.append((torch.tensor(s.rollout_logprobs) - ref).abs())
        assert len({tuple(s.response_ids) for s in group}) > 1  # sampled, not G copies
    delta = torch.cat(deltas)
    print(f"\nT={temperature}: {delta.numel()} tokens, {stats.tokens_per_s:.0f} tok/s; "
          f"|server - transformers fp32| mean {delta.mean():.2e} max {delta.max():.2e}")
    assert delta.mean() < 1e-4 and delta.max() < 1e-3


def test_greedy_matches_transformers_generate(servers, tokenizer, hf_model):
    prompts = make_prompts(tokenizer, 3, seed=1)
    groups, _ = client(servers).generate_sync(prompts, 2, SamplingConfig(temperature=0.0, max_new_tokens=16))
    for prompt, group in zip(prompts, groups):
        expected = hf_model.generate(torch.tensor([prompt.prompt_ids]), max_new_tokens=16, do_sample=False,
                                     eos_token_id=None)[0, len(prompt.prompt_ids):].tolist()
        assert group[0].response_ids == group[1].response_ids == expected


def test_idle_servers_leave_the_cpu_to_the_trainer(servers):
    """Between rollouts the trainer needs every core: an idle server must not poll in a busy loop
    (without --sleep-on-idle SGLang's CPU scheduler burns ~1.0 CPU-second per second, measured)."""
    import time

    import psutil

    trees = [[psutil.Process(s.process.pid)] + psutil.Process(s.process.pid).children(recursive=True)
             for s in servers]

    def cpu_seconds():
        return sum(t.user + t.system for tree in trees for p in tree for t in [p.cpu_times()])

    time.sleep(1)  # let the previous test's requests drain
    before, start = cpu_seconds(), time.monotonic()
    time.sleep(4)
    per_server = (cpu_seconds() - before) / (time.monotonic() - start) / len(servers)
    assert per_server < 0.25, f"an idle server used {per_server:.2f} CPU-seconds per second"


def test_wrong_api_key_and_unreachable_server(servers, tokenizer):
    prompts = make_prompts(tokenizer, 2)
    bad_key = RolloutClient([servers[0].url], RolloutConfig(api_key="wrong"))
    with pytest.raises(RolloutError, match="HTTP 401.*API key"):
        bad_key.generate_sync(prompts, G, SamplingConfig(max_new_tokens=4))
    unreachable = RolloutClient(["http://127.0.0.1:9"], RolloutConfig(api_key=API_KEY, retry_backoff_s=0.01))
    with pytest.raises(RolloutError, match=r"all 1 servers failed.*127\.0\.0\.1:9.*ConnectError"):
        unreachable.generate_sync(prompts, G, SamplingConfig(max_new_tokens=4))


def test_cli_rollout_with_reward(servers, tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "12+7=", "answer": "19"}\n{"prompt_ids": [259, 11], "answer": "3"}\n')
    out = tmp_path / "samples.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.cli", "rollout", "--servers", ",".join(s.url for s in servers),
         "--api-key", API_KEY, "--tokenizer", str(tiny_model_dir), "--prompts", str(prompts), "--n", "3",
         "--max-new-tokens", "8", "--reward", "math", "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "2 groups x 3 = 6 samples" in result.stdout
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(d["group_id"], d["sample_index"]) for d in lines] == [(g, i) for g in range(2) for i in range(3)]
    assert all(d["reward"] in (0.0, 1.0) and len(d["rollout_logprobs"]) == len(d["response_ids"]) for d in lines)


@pytest.mark.kills_server
def test_server_killed_mid_rollout_every_group_still_has_G(servers, tokenizer):
    # ~6k response tokens: several seconds on two CPU servers, so the kill at 1 s lands mid-rollout
    # with requests in flight on the killed server.
    prompts = make_prompts(tokenizer, 16, seed=2)
    rollout = client(servers, concurrency=4, retry_backoff_s=0.1)
    # what SGLang leaves in /dev/shm when it dies: removed by kill() (and stop()), rollout/sglang/server.py
    leftovers = shm_files_of_group(servers[1].process.pid)
    assert sorted(name.split("-")[0] if name.startswith("sem.") else name[:13] for name in leftovers) == [
        "sem.mp", "sglang_loads_"], leftovers

    async def main():
        generate = asyncio.create_task(rollout.generate(prompts, 8, SamplingConfig(max_new_tokens=48)))
        await asyncio.sleep(1.0)
        await asyncio.get_running_loop().run_in_executor(None, servers[1].kill)
        return await generate

    groups, stats = asyncio.run(main())
    assert [g[0].group_id for g in groups] == list(range(16))
    assert all([s.sample_index for s in g] == list(range(8)) for g in groups)
    assert sum(stats.requests_ok.values()) == 16
    assert stats.failures, "the kill happened after the rollout finished: nothing was tested"
    assert servers[1].url in stats.retired
    assert not [name for name in leftovers if (SHM_DIR / name).exists()]
    print(f"\nkilled {servers[1].url} mid-rollout: {len(stats.failures)} failed requests re-sent, "
          f"requests per server {stats.requests_ok}, {stats.elapsed_s:.1f} s")
