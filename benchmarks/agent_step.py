"""Benchmark: the step-time cost of a multi-turn episode against a single-turn response of the same length.

Side by side, same random tiny Qwen3 (no warm start: it rarely samples EOS, so every turn runs to its
max_new_tokens and the token counts are what is asked), same seed, the CPU demo's stack (examples/tiny_cpu.yaml:
TP2, one SGLang server), dynamic sampling off, repeated and interleaved (A B C A B C ...):

    single-turn, same length    one response of T = K*m + (K-1)*e tokens per sample
    multi-turn                  an episode of K model turns of m tokens with e environment tokens appended
                                between them (`fixed_turns` below): T response tokens, K*m of them trained
    single-turn, same trained   one response of K*m tokens (the multi-turn episode's trained tokens)

It prints seconds per rollout step by phase for each, and the ratio of each to the first (what the turns cost:
one /generate request per turn, the environment's tokens in every forward, the mask). The first rollout step of
each run is left out (warm-up). Uses benchmarks/step.py's runner.

    python benchmarks/agent_step.py                             # K=4 turns of m=12 tokens, e=6: T=66
    python benchmarks/agent_step.py --turns 8 --turn-tokens 8 --env-tokens 4 --repeats 3

Needs .venv-sglang (scripts/setup_sglang.sh); run with the trainer's .venv python.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

ENV = ("AGENT_BENCH_TURNS", "AGENT_BENCH_TURN_TOKENS", "AGENT_BENCH_ENV_TOKENS")
"""How `fixed_turns` learns its shape: the trainer that runs it is a subprocess of this script."""


async def fixed_turns(ep) -> None:
    """K model turns of at most m tokens, e environment tokens (a fixed observation) appended after each but
    the last: the benchmark's episode (rollout.episode_fn=benchmarks.agent_step:fixed_turns)."""
    turns, turn_tokens, env_tokens = (int(os.environ[k]) for k in ENV)
    observation = list(ep.prompt.prompt_ids[-1:]) * env_tokens
    for k in range(turns):
        await ep.generate(max_new_tokens=turn_tokens)
        if k < turns - 1:
            ep.append(observation)


PHASES = [("rollout", "time/rollout_s"), ("old log-prob recompute", "time/recompute_s"),
          ("train (fwd+bwd+optimizer)", "time/train_s"), ("weight sync", "time/sync_s"), ("step total", "step")]


def main(argv=None) -> int:
    from step import run_variant

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--turns", type=int, default=4, help="K, model turns per episode")
    p.add_argument("--turn-tokens", type=int, default=12, help="m, tokens per model turn")
    p.add_argument("--env-tokens", type=int, default=6, help="e, environment tokens between two turns")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--override", action="append", default=[], help="config key=value for every variant")
    args = p.parse_args(argv)
    if min(args.turns, args.turn_tokens, args.steps, args.repeats) < 1 or args.env_tokens < 0:
        p.error("--turns, --turn-tokens, --steps and --repeats must be >= 1, --env-tokens >= 0")
    K, m, e = args.turns, args.turn_tokens, args.env_tokens
    total = K * m + (K - 1) * e
    os.environ.update(dict(zip(ENV, map(str, (K, m, e)))))
    common = ["gspo.dynamic_sampling=false", "eval.interval=0", "gspo.algorithm=gspo_token", *args.override]
    variants = {
        f"single-turn, {total} tokens": [f"sampling.max_new_tokens={total}", "reward.fn=exact_match"],
        f"multi-turn, {K}x{m} + {K - 1}x{e} env": [
            f"sampling.max_new_tokens={m}", "rollout.episode_fn=benchmarks.agent_step:fixed_turns",
            "reward.fn=none", f"rollout.max_turns={K}"],
        f"single-turn, {K * m} tokens": [f"sampling.max_new_tokens={K * m}", "reward.fn=exact_match"],
    }
    runs: dict[str, list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        from megatron_gspo.dev.tiny_model import make_tiny_qwen3

        hf_dir = make_tiny_qwen3(Path(tmp) / "hf")
        for repeat in range(args.repeats):
            for i, (name, overrides) in enumerate(variants.items()):
                print(f"running {args.steps} steps of {name} ({repeat + 1}/{args.repeats}) ...", flush=True)
                runs[name].append(run_variant(str(REPO / "examples/tiny_cpu.yaml"), Path(hf_dir),
                                              Path(tmp) / f"v{i}-{repeat}", args.steps, 10 ** 6, [*overrides, *common]))
    results = {name: {key: statistics.mean(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
    for name, rs in runs.items():
        print(f"[{name}] step total per repeat: " + ", ".join(f"{r['step']:.2f} s" for r in rs))
    names = list(results)
    print(f"\n{'s per rollout step':28s}" + "".join(f"{n:>34s}" for n in names))
    for label, key in PHASES:
        base = results[names[0]][key]
        print(f"{label:28s}" + "".join(f"{results[n][key]:18.3f} s ({results[n][key] / base:5.2f}x)".rjust(34)
                                       if base > 0 else f"{results[n][key]:18.3f} s".rjust(34) for n in names))
    print(f"{'response tokens per sample':28s}" + "".join(
        f"{r['response_length_mean'] / (1 - r['env_token_fraction']):34.1f}" for r in results.values()))
    print(f"{'  of them trained':28s}" + "".join(f"{r['response_length_mean']:34.1f}" for r in results.values()))
    print(f"{'rollout tokens/s (SGLang)':28s}" + "".join(f"{r['rollout_tokens_per_s']:34.1f}" for r in results.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
