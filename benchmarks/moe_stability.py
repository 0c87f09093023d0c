"""The GSPO paper's MoE comparison (arXiv 2507.18071, section 4.3, Fig. 3), scaled to a CPU, in one command.

    python benchmarks/moe_stability.py                      # 3 arms x 100 rollout steps (~15 min on 2 cores)
    python benchmarks/moe_stability.py --steps 20 --arms gspo,grpo_replay
    python benchmarks/moe_stability.py --arms gspo,grpo,grpo_replay,gspo_replay,grpo_rollout_logprobs

The paper: on Qwen3-30B-A3B (48 layers), ~10% of the experts activated for the same response change after
each gradient update, so GRPO's token ratios compare different networks and GRPO needs Routing Replay to
converge; GSPO's sequence ratio trains without it, and clips about two orders of magnitude more tokens
(its band is 3e-4/4e-4 against GRPO's 0.2/0.27) while learning better. Here: a tiny but deeper Qwen3-MoE
(8 layers, 8 experts, top-2, format-warm-started on the arithmetic task so rewards start at chance),
examples/paper_moe/config.yaml (in-process rollouts on two processes with expert parallelism, G=8,
16 prompts per step, K=4 mini-batches, dynamic sampling off so every arm reads the same prompts),
the same initial weights and seed for every arm:

  gspo                   GSPO, band 3e-4 / 4e-4
  grpo                   GRPO, band 0.2 / 0.27 (the paper's), no replay
  grpo_replay            GRPO + Routing Replay (gspo.routing_replay=old: pi_old's routing replayed)
  gspo_replay            GSPO + Routing Replay (optional)
  grpo_rollout_logprobs  GRPO with the sampler's log-probs as pi_old (gspo.old_logprobs=rollout; optional)

Per arm it prints and writes (OUT/results.md, OUT/moe_stability.png): train reward (10-step means at the
start and the end), held-out mean@16 (first and last eval), the clipped fraction by token, the MoE routing
changed fraction and the spreads of log w_t (token ratios) and log s_i (sequence ratios) over the
mini-batches after the first (the first is on-policy: 0 by construction), the median step and train
times, and the replay's time overhead (GRPO + replay vs GRPO). Every number comes from the arms'
metrics.jsonl, written by the trainer itself.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_gspo.training.metrics import read_metrics  # noqa: E402  (needs the path above)

CONFIG = REPO / "examples" / "paper_moe" / "config.yaml"
ARMS: dict[str, list[str]] = {
    "gspo": ["gspo.algorithm=gspo"],
    "grpo": ["gspo.algorithm=grpo"],
    "grpo_replay": ["gspo.algorithm=grpo", "gspo.routing_replay=old"],
    "gspo_replay": ["gspo.algorithm=gspo", "gspo.routing_replay=old"],
    "grpo_rollout_logprobs": ["gspo.algorithm=grpo", "gspo.old_logprobs=rollout"],
}
EVAL_KEY = "eval/held_out/mean@16"


def make_model(out: Path, seed: int) -> Path:
    """OUT/hf: the tiny deep Qwen3-MoE, format-warm-started (answers one digit, reward at chance)."""
    from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
    from megatron_gspo.dev.warm_start import warm_start_format

    hf = out / "hf"
    if not (hf / "config.json").is_file():
        spec = TinyQwen3Spec(seed=seed, num_layers=8, num_experts=8, num_experts_per_tok=2)
        make_tiny_qwen3(hf, spec)
        print(f"format warm-start: {warm_start_format(hf, seed=seed):.0%} of greedy answers are one digit", flush=True)
    return hf


def run_arm(name: str, hf: Path, out: Path, steps: int, extra: list[str]) -> float:
    run_dir = out / name
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), f"model.hf_path={hf}",
           f"logging.run_dir={run_dir}", f"num_steps={steps}", *ARMS[name], *extra]
    print(f"== {name}: {' '.join(ARMS[name])}", flush=True)
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"arm {name} failed (exit {done.returncode}): see {out / f'{name}.log'}")
    print(f"   {wall:.0f} s", flush=True)
    return wall


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else float("nan")


def _per_step(records: list[dict], key: str) -> list[float]:
    steps: dict[int, list] = {}
    for r in records:
        if r.get(key) is not None:
            steps.setdefault(r["rollout_step"], []).append(r[key])
    return [statistics.fmean(steps[s]) for s in sorted(steps)]


def _smooth(values: list[float], window: int = 10) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def summarize(name: str, run_dir: Path, wall_s: float) -> dict:
    records = read_metrics(run_dir)
    train = [r for r in records if "loss/value" in r]
    first_of_step = {}
    for r in train:
        first_of_step.setdefault(r["rollout_step"], r)
    rewards = [first_of_step[s]["reward/mean"] for s in sorted(first_of_step)]
    k = len(train) // max(len(first_of_step), 1)
    later = [r for r in train if (r["step"] - 1) % k != 0]  # mini-batches 2..K: after an update
    evals = [r[EVAL_KEY] for r in records if r.get(EVAL_KEY) is not None]
    return {
        "arm": name,
        "reward_first10": _mean(rewards[:10]), "reward_last10": _mean(rewards[-10:]),
        "eval_first": evals[0] if evals else float("nan"), "eval_last": evals[-1] if evals else float("nan"),
        "clipped_token": _mean(r["loss/clipped_fraction_token"] for r in train),
        "clipped_token_later": _mean(r["loss/clipped_fraction_token"] for r in later),
        "routing_changed": _mean(r.get("moe/routing_changed_fraction") for r in later),
        "log_w_std": _mean(r["loss/log_ratio_token_std"] for r in later),
        "log_s_std": _mean(r["loss/log_ratio_seq_std"] for r in later),
        "step_s": statistics.median(first_of_step[s]["time/step_s"] for s in first_of_step),
        "train_s": statistics.median(first_of_step[s]["time/train_s"] for s in first_of_step),
        "response_length": _mean(first_of_step[s]["rollout/response_length_mean"] for s in first_of_step),
        "wall_s": wall_s,
        # per rollout step: the mean over its mini-batches (all K for clipping, 2..K for the rest)
        "series": {"reward": rewards,
                   "clipped_token": _per_step(train, "loss/clipped_fraction_token"),
                   "routing_changed": _per_step(later, "moe/routing_changed_fraction"),
                   "log_w_std": _per_step(later, "loss/log_ratio_token_std"),
                   "log_s_std": _per_step(later, "loss/log_ratio_seq_std"),
                   "eval": [(r["rollout_step"], r[EVAL_KEY]) for r in records if r.get(EVAL_KEY) is not None]},
    }


COLUMNS = [("arm", "arm", "{}"), ("reward_first10", "reward 1-10", "{:.3f}"), ("reward_last10", "reward last 10", "{:.3f}"),
           ("eval_first", "eval mean@16 first", "{:.3f}"), ("eval_last", "eval last", "{:.3f}"),
           ("clipped_token", "clipped tokens", "{:.2e}"), ("routing_changed", "routing changed (mb 2-K)", "{:.3f}"),
           ("log_w_std", "std log w_t", "{:.4f}"), ("log_s_std", "std log s_i", "{:.4f}"),
           ("step_s", "step s (median)", "{:.2f}"), ("train_s", "train s", "{:.2f}")]


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(fmt.format(row[key]) for key, _, fmt in COLUMNS) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def overheads(rows: list[dict]) -> list[str]:
    by = {r["arm"]: r for r in rows}
    lines = []
    for base, replay in (("grpo", "grpo_replay"), ("gspo", "gspo_replay")):
        if base in by and replay in by:
            lines.append(f"{replay} / {base}: train time {by[replay]['train_s'] / by[base]['train_s']:.3f}x, "
                         f"step time {by[replay]['step_s'] / by[base]['step_s']:.3f}x (medians; the arms train "
                         "on different responses, so this is indicative only: benchmarks/routing_replay.py "
                         "measures the replay alone on identical batches)")
    if "gspo" in by and "grpo" in by and by["grpo"]["clipped_token"] > 0:
        lines.append(f"clipped tokens gspo / grpo: {by['gspo']['clipped_token'] / by['grpo']['clipped_token']:.1f}x")
    return lines


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure")
        return
    fig, axes = plt.subplots(2, 3, figsize=(14, 6.5))
    for i, row in enumerate(rows):
        s, color = row["series"], f"C{i}"
        axes[0, 0].plot(range(1, len(s["reward"]) + 1), _smooth(s["reward"]), color=color, label=row["arm"])
        if s["eval"]:
            axes[0, 1].plot(*zip(*s["eval"]), marker="o", color=color, label=row["arm"])
        axes[0, 2].plot(_smooth(s["clipped_token"]), color=color, label=row["arm"])
        if s["routing_changed"]:
            axes[1, 0].plot(_smooth(s["routing_changed"]), color=color, label=row["arm"])
        axes[1, 1].plot(_smooth(s["log_w_std"]), color=color, label=row["arm"])
        axes[1, 2].plot(_smooth(s["log_s_std"]), color=color, label=row["arm"])
    axes[0, 0].set(title="train reward", xlabel="rollout step")
    axes[0, 1].set(title="held-out mean@16 (10 prompts)", xlabel="rollout step")
    axes[0, 2].set(title="clipped fraction of tokens", xlabel="rollout step", yscale="log")
    axes[1, 0].set(title="MoE routing changed vs pi_old", xlabel="rollout step")
    axes[1, 1].set(title="std of log w_t (token ratios)", xlabel="rollout step")
    axes[1, 2].set(title="std of log s_i (sequence ratios)", xlabel="rollout step")
    fig.suptitle("10-step means; routing and ratio spreads over mini-batches 2-K (after an update)", fontsize=9)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="rollout steps per arm")
    p.add_argument("--arms", default="gspo,grpo,grpo_replay", help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--out", default=str(REPO / "runs" / "paper_moe"), help="model, runs and results")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--only-model", action="store_true", help="make OUT/hf and stop")
    p.add_argument("--no-train", action="store_true", help="summarize the arms' runs already in OUT")
    p.add_argument("overrides", nargs="*", help="config overrides for every arm (key.sub=value)")
    args = p.parse_args()
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    hf = make_model(out, args.seed)
    if args.only_model:
        print(hf)
        return 0
    rows = []
    for arm in arms:
        wall = 0.0 if args.no_train else run_arm(arm, hf, out, args.steps, [f"seed={args.seed}", *args.overrides])
        rows.append(summarize(arm, out / arm, wall))
    results = out / "results"
    results.mkdir(exist_ok=True)
    text = "\n".join([f"{args.steps} rollout steps per arm, examples/paper_moe/config.yaml, seed {args.seed}", "",
                      table(rows), "", *overheads(rows)])
    print("\n" + text)
    (results / "results.md").write_text(text + "\n")
    (results / "results.json").write_text(json.dumps(rows, indent=1))
    plot(rows, results / "moe_stability.png")
    print(f"\nwritten: {results / 'results.md'}, {results / 'moe_stability.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
