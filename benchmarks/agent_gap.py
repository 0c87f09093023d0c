"""Measure: the token-in/token-out gap of multi-turn episodes per model turn, on a trained checkpoint.

Samples episodes of a config's tools / episode (examples/tiny_agent_cpu.yaml by default) from one SGLang server
on the checkpoint's weights, at the training sampling settings, then recomputes every response token's log-prob
with the same weights in Hugging Face transformers, float32, logits divided by sampling.temperature (what the
trainer computes). Per model turn k it prints |sampler - recompute| per token (mean, max) and the mean signed
difference over the turn's tokens; environment tokens (loss_mask 0) are left out, as everywhere in training. A
gap that grew with k would mean the context ids the sampler saw were not the trajectory's (a re-tokenisation,
or markup appended twice); equal small gaps per turn are the sampler's own numerics.

    python benchmarks/agent_gap.py --checkpoint runs/tiny_agent_cpu/checkpoints   # Megatron or HF directory
    python benchmarks/agent_gap.py --config C --checkpoint D --prompts 30 --samples 8 [key=value ...]

Needs .venv-sglang (scripts/setup_sglang.sh); run with the trainer's .venv python.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_gspo.config import load_config  # noqa: E402  (needs the path above)


def turn_gaps(samples, model, temperature: float) -> list[list[torch.Tensor]]:
    """Per turn index k, the per-token sampler - recompute differences of every sample's k-th turn."""
    gaps: list[list[torch.Tensor]] = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        P = len(s.prompt_ids)
        recomputed = torch.log_softmax(logits[P - 1:-1] / temperature, dim=-1).gather(
            1, torch.tensor(s.response_ids)[:, None])[:, 0].double()
        delta = torch.tensor(s.rollout_logprobs, dtype=torch.float64) - recomputed
        mask = torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids), dtype=torch.bool)
        for k, t in enumerate(s.turns or ()):
            while len(gaps) <= k:
                gaps.append([])
            gaps[k].append(delta[t.start:t.end][mask[t.start:t.end]])
    return gaps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "examples/tiny_agent_cpu.yaml"))
    p.add_argument("--checkpoint", required=True, help="a Megatron checkpoint directory (checkpoint.dir) or an HF one")
    p.add_argument("--prompts", type=int, default=30, help="training prompts to sample episodes for")
    p.add_argument("--samples", type=int, default=8, help="episodes per prompt")
    p.add_argument("overrides", nargs="*", help="config key=value")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from megatron_gspo.convert.mcore_to_hf import convert_mcore_to_hf
    from megatron_gspo.rollout.backend import SGLangBackend
    from megatron_gspo.training.preflight import open_datasets

    config = load_config(args.config, args.overrides)
    if not config.rollout.episodes:
        raise SystemExit(f"{args.config}: not an episode config (rollout.tools / rollout.episode_fn are empty)")
    checkpoint = Path(args.checkpoint)
    with tempfile.TemporaryDirectory(prefix="agent-gap-") as tmp:
        hf_dir = checkpoint
        if not (checkpoint / "config.json").is_file():
            hf_dir = Path(tmp) / "hf"
            convert_mcore_to_hf(checkpoint, config.model.hf_path, hf_dir, progress=False)
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, hf_path=str(hf_dir)),
            rollout=dataclasses.replace(config.rollout, server_urls=(), weight_sync="disk"),
            logging=dataclasses.replace(config.logging, run_dir=tmp))
        prepared = open_datasets(config)
        prompts = prepared.dataset.eval_prompts(args.prompts)  # the first ones of data.train, in file order
        backend = SGLangBackend(config, tokenizer=prepared.tokenizer)
        try:
            groups, stats = asyncio.run(backend.generate(prompts, n=args.samples, sampling=config.sampling))
        finally:
            backend.close()
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        samples = [s for g in groups for s in g]
        gaps = turn_gaps(samples, model, config.sampling.temperature)
    print(f"{len(samples)} episodes of {len(prompts)} prompts, {stats.turns / max(stats.episodes, 1):.2f} turns and "
          f"{stats.tool_calls / max(stats.episodes, 1):.2f} tool calls each; sampler (SGLang, "
          f"{config.rollout.server_dtype or config.model.dtype}) - recompute (transformers, float32), per model token:")
    print(f"{'turn':>6s}{'turns':>8s}{'tokens':>8s}{'mean |d|':>12s}{'max |d|':>12s}{'mean d':>12s}")
    for k, per_sample in enumerate(gaps):
        d = torch.cat(per_sample)
        if d.numel():
            print(f"{k + 1:6d}{len(per_sample):8d}{d.numel():8d}{d.abs().mean():12.2e}{d.abs().max():12.2e}"
                  f"{d.mean():12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
