"""Benchmark: rollout client overhead and weight-sync cost on one CPU SGLang server (tiny Qwen3).

Side by side in one run, on the same server and the same requests (P prompts, n = G, ignore_eos so
every response has exactly max_new_tokens tokens):
  client   megatron_gspo.rollout.sglang.client.RolloutClient (validation, Sample objects, failover logic)
  raw      plain concurrent httpx POSTs of the same /generate payloads, JSON parsed, nothing else
Rounds alternate raw / client (--rounds each) after one warm-up; reported: median tokens/s of each and
client / raw (target >= 0.9). Then one update per weight-sync path (disk, tensor, broadcast): seconds
and bytes moved. Needs .venv-sglang (scripts/setup_sglang.sh); runs in the trainer's .venv.

    python benchmarks/rollout.py              # 32 prompts x G=8 x 64 tokens, 3 rounds
    python benchmarks/rollout.py --quick      # smoke size
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402

from megatron_gspo.config import RolloutConfig

from megatron_gspo.config import SamplingConfig  # noqa: E402
from megatron_gspo.dev.tiny_model import make_tiny_qwen3  # noqa: E402
from megatron_gspo.rollout.sglang.client import RolloutClient, sglang_sampling_params  # noqa: E402
from megatron_gspo.rollout.sglang.server import ServerConfig, launch_servers  # noqa: E402
from megatron_gspo.samples import Prompt  # noqa: E402


def _ignoring_eos(sampling: SamplingConfig, n: int) -> dict:
    return {**sglang_sampling_params(sampling, n), "ignore_eos": True}


async def raw_rollout(url, payloads, concurrency):
    slots = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as http:
        async def one(payload):
            async with slots:
                response = await http.post(f"{url}/generate", json=payload)
                response.raise_for_status()
                return sum(len(item["output_ids"]) for item in response.json())
        start = time.monotonic()
        tokens = sum(await asyncio.gather(*(one(p) for p in payloads)))
    return tokens / (time.monotonic() - start)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.rounds = 8, 16, 1

    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    model_dir = make_tiny_qwen3(work / "model")
    prompts = [Prompt(group_id=i, prompt_ids=[(7 * i + j) % 500 + 1 for j in range(8)]) for i in range(args.prompts)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens)
    payloads = [{"input_ids": pr.prompt_ids, "sampling_params": _ignoring_eos(sampling, args.n), "return_logprob": True,
                 "logprob_start_len": -1} for pr in prompts]
    config = ServerConfig(model_path=str(model_dir), settings=RolloutConfig(), device="cpu",
                          dtype="float32", log_dir=str(work / "logs"))
    with launch_servers(config, 1) as servers:
        url = servers[0].url
        print(f"server ready in {servers[0].ready_after_s:.1f} s; {args.prompts} prompts x n={args.n} x "
              f"{args.max_new_tokens} tokens, concurrency {args.concurrency}")
        client = RolloutClient([url], RolloutConfig(concurrency=args.concurrency))
        asyncio.run(client.generate(prompts[: max(1, args.prompts // 4)], args.n, sampling))  # warm-up
        raw, ours = [], []
        for _ in range(args.rounds):
            raw.append(asyncio.run(raw_rollout(url, payloads, args.concurrency)))
            _, stats = asyncio.run(client.generate(prompts, args.n, sampling))
            ours.append(stats.tokens_per_s)
        raw_m, ours_m = statistics.median(raw), statistics.median(ours)
        print(f"| path | tokens/s (median of {args.rounds}) |\n|---|---|\n| raw HTTP | {raw_m:.0f} |\n"
              f"| client | {ours_m:.0f} |\n| client / raw | {ours_m / raw_m:.2f}x |")

        from transformers import AutoModelForCausalLM

        from megatron_gspo.rollout.sglang.weight_sync import (BroadcastSync, connected, sync_by_tensor, sync_from_disk,
                                                             write_hf_checkpoint)
        state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        rows = []
        start = time.monotonic()
        folder = write_hf_checkpoint(state.items(), work / "export", model_dir)
        written = time.monotonic()
        with connected([url]) as admins:
            sync_from_disk(admins, folder, "disk")
        rows.append(("disk (write + load)", written - start, time.monotonic() - written))
        start = time.monotonic()
        with connected([url]) as admins:
            sync_by_tensor(admins, state.items(), "tensor")
        rows.append(("tensor", 0.0, time.monotonic() - start))
        broadcast = BroadcastSync([url])
        start = time.monotonic()
        broadcast.connect()
        connected = time.monotonic()
        broadcast.push(state.items(), "broadcast")
        rows.append(("broadcast (connect + sync)", connected - start, time.monotonic() - connected))
        broadcast.close()
        print(f"\nweight sync of {len(state)} tensors, {nbytes / 2**20:.2f} MiB (float32):")
        print("| path | setup s | update s | MiB/s |\n|---|---|---|---|")
        for name, setup_s, update_s in rows:
            print(f"| {name} | {setup_s:.3f} | {update_s:.3f} | {nbytes / 2**20 / update_s:.1f} |")


if __name__ == "__main__":
    main()
