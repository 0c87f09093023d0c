"""Train-inference mismatch on a CPU, and what correcting it does: `megatron-gspo train` runs side by side.

    python benchmarks/correction.py mismatch                    # kl_k3, ESS, weight spread: fp32 vs bf16 sampler
    python benchmarks/correction.py mismatch --config examples/tiny_moe_cpu.yaml --hf DIR --moe
    python benchmarks/correction.py train --seeds 1,2            # correction off vs token TIS vs geometric MIS
    python benchmarks/correction.py train --config examples/tiny_long_cpu.yaml --steps 40

`mismatch`: a few steps of each variant (the same model and seed), the correction/* metrics the trainer logs
whenever the sampler's log-probs mu and a recomputed pi_old both exist (docs/gspo.md): per variant the mean
over its steps' first mini-batches (before any update of the step: the pure sampler-vs-trainer gap) of
kl_k3, mean |log r|, ESS, the token TIS weight mean/max and truncated fraction at weight_cap 2, and the
share of tokens outside the band [0.5, 2]. Variants: the sampler in float32 (the trainer's dtype) and in
bfloat16 (rollout.server_dtype); with --moe also with Routing Replay of the sampler's routing (R3).

`train`: the task's reward curve and held-out mean@k under correction off, token TIS (weight=token, cap 2)
and geometric MIS (reject=geometric, band [0.5, 2]), with a bf16 sampler against the float32 trainer (the
mismatch there is to correct), for each seed; every run adopts one SGLang server, reset to the initial weights
before it (benchmarks/shared_server.py); the mean and spread over seeds of the last 10 steps' reward,
the final held-out mean@k, and the mean step time (the correction's cost).
Every number comes from the runs' metrics.jsonl, written by the trainer itself.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.shared_server import SharedServer  # noqa: E402  (needs the path above)
from megatron_gspo.training.metrics import read_metrics  # noqa: E402

MISMATCH_KEYS = ["correction/kl_k3", "correction/log_ratio_abs_mean", "correction/ess", "correction/weight_mean",
                 "correction/weight_max", "correction/truncated_fraction", "correction/rejected_fraction",
                 "train/rollout_abs_delta_token"]
CORRECTIONS = {"off": [], "token_tis": ["correction.weight=token", "correction.weight_cap=2.0"],
               "geometric_mis": ["correction.reject=geometric", "correction.reject_band=[0.5,2.0]"]}


def train(config: str, hf: Path, run_dir: Path, overrides: list[str]) -> tuple[list[dict], float]:
    """`megatron-gspo train CONFIG` with the overrides; (metrics.jsonl records, wall seconds)."""
    args = [sys.executable, "-m", "megatron_gspo.cli", "train", config, f"model.hf_path={hf}",
            f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir / 'ckpt'}", "logging.progress_bar=false",
            *overrides]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stdout[-4000:]}")
    return read_metrics(run_dir), time.perf_counter() - start


def first_minibatches(records: list[dict]) -> list[dict]:
    """The first mini-batch's record of each rollout step (its pi_old is the weights that sampled)."""
    first: dict[int, dict] = {}
    for r in records:
        if "loss/value" in r and r["rollout_step"] not in first:
            first[r["rollout_step"]] = r
    return [first[k] for k in sorted(first)]


def mismatch(args, hf: Path, tmp: Path) -> None:
    variants = {"fp32 sampler": [], "bf16 sampler": ["rollout.server_dtype=bfloat16"]}
    if args.moe:
        variants.update({"fp32 sampler, R3": ["gspo.routing_replay=rollout"],
                         "bf16 sampler, R3": ["rollout.server_dtype=bfloat16", "gspo.routing_replay=rollout"]})
    base = [f"num_steps={args.steps}", "eval.interval=0", "gspo.dynamic_sampling=false", "model.dtype=float32",
            "correction.weight_cap=2.0", "correction.reject_band=[0.5,2.0]", *args.override]
    rows = {}
    for name, extra in variants.items():
        print(f"running {args.steps} steps: {name} ...", flush=True)
        records, _ = train(args.config, hf, tmp / name.replace(" ", "_").replace(",", ""), [*base, *extra])
        firsts = first_minibatches(records)
        rows[name] = {k: statistics.mean(r[k] for r in firsts if r.get(k) is not None) for k in MISMATCH_KEYS
                      if any(r.get(k) is not None for r in firsts)}
    print(f"\nsampler vs float32 trainer, first mini-batch of {args.steps} steps ({args.config}):")
    labels = ["kl_k3", "|log r|", "ess", "w mean", "w max", "truncated", "rejected", "|delta| tok"]
    print(f"{'variant':22s}" + "".join(f"{label:>12s}" for label in labels))
    for name, row in rows.items():
        print(f"{name:22s}" + "".join(f"{row.get(k, float('nan')):12.3g}" for k in MISMATCH_KEYS))


def _summary(records: list[dict], wall: float) -> dict:
    """One run's numbers: reward over its first and last 10 steps, held-out mean@k first and last, kl_k3."""
    steps = first_minibatches(records)
    evals = [r for r in records if any(k.startswith("eval/") and "/mean@" in k for k in r)]
    eval_key = next((k for r in evals for k in r if k.startswith("eval/") and "/mean@" in k), None)
    return {"last10": statistics.mean(r["reward/mean"] for r in steps[-10:]),
            "first10": statistics.mean(r["reward/mean"] for r in steps[:10]),
            "eval": evals[-1][eval_key] if eval_key else float("nan"),
            "eval0": evals[0][eval_key] if eval_key else float("nan"),
            "step_s": statistics.median(r["time/step_s"] for r in steps[1:]),
            "kl_k3": statistics.mean(r.get("correction/kl_k3", 0.0) for r in steps),
            "ess": statistics.mean(r.get("correction/ess", 1.0) for r in steps),
            "rejected": statistics.mean(r.get("correction/rejected_fraction", 0.0) for r in steps),
            "truncated": statistics.mean(r.get("correction/truncated_fraction", 0.0) for r in steps),
            "wall": wall}


def comparison(args, hf: Path, tmp: Path) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    base = [f"num_steps={args.steps}", "model.dtype=float32", "rollout.server_dtype=bfloat16", *args.override]
    results: dict[str, list[dict]] = {name: [] for name in CORRECTIONS}
    with SharedServer(args.config, hf, tmp / "server", base) as server:  # every run adopts it, reset before each
        for seed in seeds:
            for name, extra in CORRECTIONS.items():
                print(f"training {args.steps} steps, seed {seed}: correction {name} ...", flush=True)
                server.reset()
                records, wall = train(args.config, hf, tmp / f"{name}-{seed}",
                                      [*base, *server.overrides, f"seed={seed}", *extra])
                results[name].append(_summary(records, wall))
    print(f"\n{args.config}, {args.steps} steps, bf16 sampler vs float32 trainer, seeds {seeds} (mean +- std over seeds):")
    print(f"{'correction':16s}{'reward first 10':>18s}{'reward last 10':>18s}{'held-out first':>16s}{'held-out last':>16s}"
          f"{'kl_k3':>10s}{'ess':>8s}{'truncated':>11s}{'rejected':>10s}{'step s (median)':>18s}")
    for name, runs in results.items():
        def cell(key, width):
            values = [r[key] for r in runs]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            return f"{statistics.mean(values):.3f} +- {spread:.3f}".rjust(width)
        mean = lambda key: statistics.mean(r[key] for r in runs)  # noqa: E731
        print(f"{name:16s}{cell('first10', 18)}{cell('last10', 18)}{cell('eval0', 16)}{cell('eval', 16)}"
              f"{mean('kl_k3'):10.2e}{mean('ess'):8.3f}{mean('truncated'):11.2e}{mean('rejected'):10.2e}{cell('step_s', 18)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("mismatch", "train"))
    p.add_argument("--config", default=str(REPO / "examples/tiny_cpu.yaml"))
    p.add_argument("--hf", help="HF model directory (default: a fresh format-warm-started tiny dense Qwen3)")
    p.add_argument("--moe", action="store_true", help="mismatch: also the variants with Routing Replay (R3)")
    p.add_argument("--steps", type=int, default=None, help="rollout steps per run (mismatch 6, train 60)")
    p.add_argument("--seeds", default="1,2", help="train: comma-separated seeds")
    p.add_argument("--override", action="append", default=[], help="config key=value for every run")
    args = p.parse_args(argv)
    args.steps = args.steps or (6 if args.what == "mismatch" else 60)
    with tempfile.TemporaryDirectory(prefix="bench-correction-") as tmp:
        hf = Path(args.hf) if args.hf else Path(tmp) / "hf"
        if not args.hf:
            from megatron_gspo.dev.tiny_model import make_tiny_qwen3
            from megatron_gspo.dev.warm_start import warm_start_format
            make_tiny_qwen3(hf)
            warm_start_format(hf)
        (mismatch if args.what == "mismatch" else comparison)(args, hf, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
