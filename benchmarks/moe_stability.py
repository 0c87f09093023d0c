"""The GSPO paper's MoE comparison (arXiv 2507.18071, section 4.3, Fig. 3), scaled to a CPU, in GSPO's regime.

    python benchmarks/moe_stability.py                         # 5 arms x 3 seeds x --steps rollout steps
    python benchmarks/moe_stability.py --arms gspo,grpo --seeds 2 --steps 8
    python benchmarks/moe_stability.py --preset smoke          # 2 arms x 1 seed x 2 steps (the test's)
    python benchmarks/moe_stability.py --no-train              # summarize the runs already in OUT
    python benchmarks/moe_stability.py --only-model            # make OUT/hf (the cold start) and stop
    python benchmarks/moe_stability.py --task long_addition_mixed --results examples/paper_moe/results_mixed
                                                               # responses of 42-148 tokens: the trend with length

The paper: on Qwen3-30B-A3B, ~10% of the experts activated for the same response change after each
gradient update, so GRPO's token ratios w_t compare different networks and GRPO needs Routing Replay to
converge; GSPO's sequence ratio s_i (the geometric mean of a response's token ratios) trains without it,
and clips about two orders of magnitude more tokens (band 3e-4/4e-4 against GRPO's 0.2/0.27).

Here (examples/paper_moe/config.yaml): a tiny but deeper Qwen3-MoE (8 layers, 8 experts, top-2) cold-
started on task long_addition (responses of ~74 tokens; a third of the held-out answers right when sampled,
as the paper starts from a cold-started model: from the format-only warm start, at chance, no arm learned
anything in the budgets that fit on a CPU), SGLang rollouts on
CPU, EP2 on two processes, G=8 x 16 prompts, K=4 mini-batches, the same initial weights for every arm and
every seed, and for a given seed the same prompts in the same order:

  gspo      GSPO, band 3e-4 / 4e-4
  grpo      GRPO, band 0.2 / 0.27, no routing replay
  grpo_r2   GRPO + Routing Replay of pi_old's routing            (gspo.routing_replay=old)
  grpo_r3   GRPO + replay of the sampler's (SGLang's) routing   (gspo.routing_replay=rollout)
  gspo_r3   GSPO + replay of the sampler's routing

One SGLang server (started with --enable-return-routed-experts, which the R3 arms need and the others do
not ask for) serves every run: before each run it reloads the initial weights from OUT/hf as weight
version 0 (/update_weights_from_disk, KV cache flushed), so each run starts where a freshly launched server
would; --server-per-run launches one per run instead (~100 s each on CPU).

--task long_addition_mixed runs the same arms on sums of two 1- to 4-digit numbers (TASKS: correct responses of
42, 74, 111 and 148 tokens, 192 new tokens allowed; its own cold start in OUT/hf, default OUT runs/paper_moe_mixed),
so that the ratio spreads by response length span four buckets instead of one (measured: docs/benchmarks.md,
"What grows with response length"; examples/paper_moe/results_mixed/).

Runs go seed by seed (every arm of seed 1, then seed 2, ...), so a budget cut short still compares arms;
a finished run (its run dir has wall_s) is not run again, so `--seeds 3` after `--seeds 2` adds seed 3.
Every number in OUT/results/ (results.md, results.json, moe_stability.png) is read from the runs'
metrics.jsonl, written by the trainer; per arm: mean and spread (sample std, and min..max) over seeds.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.shared_server import SharedServer  # noqa: E402  (needs the path above)
from megatron_gspo.training.metrics import read_metrics  # noqa: E402

CONFIG = REPO / "examples" / "paper_moe" / "config.yaml"
ARMS: dict[str, list[str]] = {
    "gspo": ["gspo.algorithm=gspo"],
    "grpo": ["gspo.algorithm=grpo"],
    "grpo_r2": ["gspo.algorithm=grpo", "gspo.routing_replay=old"],
    "grpo_r3": ["gspo.algorithm=grpo", "gspo.routing_replay=rollout"],
    "gspo_r3": ["gspo.algorithm=gspo", "gspo.routing_replay=rollout"],
}
PRESETS = {"smoke": {"arms": "gspo,grpo_r3", "seeds": 1, "steps": 2,
                     "overrides": ["eval.max_prompts=8", "eval.samples_per_prompt=2", "gspo.prompts_per_step=4"]}}
EVAL_KEY = re.compile(r"^eval/held_out/mean@(\d+)$")
TOKEN_STD, SEQ_STD, SEQS = "loss/log_ratio_token_std/", "loss/log_ratio_seq_std/", "loss/sequences/"
CLIPPED = "loss/clipped_fraction_token/"
MIN_BUCKET_SEQUENCES = 10
"""The length table and figure show a bucket of an arm only where its runs hold at least this many sequences
on average (mini-batches 2..K): a spread over one or two responses is noise (results.json keeps them all)."""


def bucket_order(bucket: str) -> int:
    """Sort key of a length bucket's name ("len_64-95" -> 64): by length, not by name."""
    return int(re.match(r"len_(\d+)", bucket).group(1))


def shown_buckets(by_length: dict[str, dict]) -> dict[str, dict]:
    """An arm's buckets the length table and figure show (MIN_BUCKET_SEQUENCES), in length order."""
    return {b: by_length[b] for b in sorted(by_length, key=bucket_order)
            if (by_length[b]["sequences"]["mean"] or 0) >= MIN_BUCKET_SEQUENCES}


COLLAPSE_DROP = 0.2
COLLAPSE_WINDOW = 3
COLLAPSE_DEFINITION = (f"the {COLLAPSE_WINDOW}-step running mean of the training reward falls more than "
                       f"{COLLAPSE_DROP} below its running peak and is still below (peak - {COLLAPSE_DROP}) at "
                       "the last step (no recovery)")


# ------------------------------------------------------------------------------------------- runs

COLD_START_STEPS = 250
"""Supervised steps of the cold start (warm_start_long_addition with correct_fraction=1.0): on the tiny MoE
(seed 1234) 200 steps leave it at 3.5% sampled held-out accuracy, 250 at 32.5%, 300 at 56% (T=1, the 200 test
problems); from the format warm start (1%) no arm learned anything in the budgets that fit here."""

COLD_START_STEPS_MIXED = 800
"""The same for --task long_addition_mixed. On the tiny MoE (seed 1234), held-out (20 problems per width, 4
samples each at T=1 / greedy): 300 steps: 7.5% / 10% of width 1, nothing wider; 800 steps: width 1 68% / 75%,
width 2 29% / 40%, width 3 1% / 5%, width 4 0% / 0% (24% / 30% overall). Wider sums stay mostly wrong: their
groups are mostly all-zero (no signal), but their ratios are measured all the same."""

MIXED = "examples/data/long_addition_mixed"
TASKS: dict[str, dict] = {
    "long_addition": {"cold_start_steps": COLD_START_STEPS, "check_prompts": 200, "overrides": []},
    "long_addition_mixed": {
        "cold_start_steps": COLD_START_STEPS_MIXED, "check_prompts": 80,
        "overrides": [f"data.train=[{MIXED}/train.jsonl]", f"eval.datasets={{held_out: {MIXED}/test.jsonl}}",
                      "sampling.max_new_tokens=192"]},
}
"""--task: the cold start's steps and the config overrides of each task (long_addition: the config as it is)."""


def make_model(out: Path, seed: int, task: str = "long_addition") -> Path:
    """OUT/hf: the tiny deep Qwen3-MoE, cold-started on long_addition: COLD_START_STEPS supervised steps on the
    correct worked responses of training problems (never the test split), the paper's starting point (a model
    that already solves some problems; here about a third of the held-out ones when sampled)."""
    from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
    from megatron_gspo.dev.warm_start import warm_start_long_addition

    hf = out / "hf"
    if not (hf / "config.json").is_file():
        spec = TinyQwen3Spec(seed=seed, num_layers=8, num_experts=8, num_experts_per_tok=2)
        make_tiny_qwen3(hf, spec)
        steps, check = TASKS[task]["cold_start_steps"], TASKS[task]["check_prompts"]
        fmt, acc = warm_start_long_addition(hf, seed=seed, correct_fraction=1.0, steps=steps, check_prompts=check,
                                            task=task)
        print(f"cold start ({task}, {steps} steps): {fmt:.0%} of greedy responses to the {check} held-out problems "
              f"state an answer, {acc:.1%} right", flush=True)
    return hf


def weights_digest(hf: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(hf.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def run_one(arm: str, seed: int, hf: Path, out: Path, steps: int, overrides: list[str],
            server: SharedServer | None) -> float:
    run_dir = out / "runs" / arm / f"seed{seed}"
    if (run_dir / "wall_s").exists():  # finished: its numbers are reused (a budget is run in pieces)
        done = summarize_run(run_dir)["steps"]
        if done != steps:
            raise SystemExit(f"{run_dir} ran {done} rollout steps, not --steps {steps}: move it away, or --out another")
        print(f"== {arm} seed {seed}: done already ({run_dir})", flush=True)
        return float((run_dir / "wall_s").read_text())
    if (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} holds an unfinished run: move it away, or --no-train to summarize the others")
    extra = []
    if server is not None:
        server.reset()
        extra = server.overrides
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(CONFIG), f"model.hf_path={hf}",
           f"logging.run_dir={run_dir}", f"num_steps={steps}", f"eval.interval={steps}", f"seed={seed}",
           *ARMS[arm], *extra, *overrides]
    print(f"== {arm} seed {seed}: {' '.join(ARMS[arm])}", flush=True)
    start = time.perf_counter()
    log_path = out / "runs" / f"{arm}_seed{seed}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        done = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{arm} seed {seed} failed (exit {done.returncode}): see {log_path}")
    print(f"   {wall:.0f} s", flush=True)
    (run_dir / "wall_s").write_text(f"{wall:.1f}\n")
    return wall


# ------------------------------------------------------------------------------------ one run's numbers

def _fmean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _weighted(records: list[dict], key: str, weight_key: str) -> float | None:
    """Mean of `key` over records, each weighted by `weight_key` (a bucket's sequence count)."""
    pairs = [(r[key], r.get(weight_key, 1.0)) for r in records if r.get(key) is not None and r.get(weight_key, 1.0) > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else None


def collapsed(rewards: list[float]) -> bool:
    """COLLAPSE_DEFINITION on one run's per-step training rewards."""
    smooth = [statistics.fmean(rewards[max(0, i - COLLAPSE_WINDOW + 1):i + 1]) for i in range(len(rewards))]
    peak, fell = float("-inf"), False
    for value in smooth:
        peak = max(peak, value)
        fell = fell or value < peak - COLLAPSE_DROP
    return fell and bool(smooth) and smooth[-1] < peak - COLLAPSE_DROP


def summarize_run(run_dir: Path) -> dict:
    """One run's numbers from its metrics.jsonl. Mini-batch 1 of each step is on-policy (its ratios are 1 up
    to the recompute's noise), so the ratio spreads and the routing changes are read over mini-batches 2..K:
    after one or more optimizer updates."""
    records = read_metrics(run_dir)
    train = [r for r in records if "loss/value" in r]
    if not train:
        raise ValueError(f"{run_dir}: no training records")
    by_step: dict[int, list[dict]] = {}
    for r in train:
        by_step.setdefault(r["rollout_step"], []).append(r)
    steps = sorted(by_step)
    later = [r for s in steps for r in sorted(by_step[s], key=lambda r: r["step"])[1:]]
    rewards = [by_step[s][0]["reward/mean"] for s in steps]
    evals = []
    for r in records:
        for key, value in r.items():
            m = EVAL_KEY.match(key)
            if m and value is not None:
                evals.append((r["rollout_step"], value, int(m.group(1))))
    buckets = sorted({k[len(TOKEN_STD):] for r in later for k in r if k.startswith(TOKEN_STD)},
                     key=bucket_order)
    gap_token = [r.get("train/rollout_abs_delta_token") for s in steps for r in by_step[s][:1]]
    wall = run_dir / "wall_s"
    return {
        "steps": len(steps),
        "rewards": rewards,
        "reward_first": _fmean(rewards[:COLLAPSE_WINDOW]),
        "reward_final": _fmean(rewards[-COLLAPSE_WINDOW:]),
        "unparsed_final": _fmean(by_step[s][0].get("reward/unparsed_fraction") for s in steps[-COLLAPSE_WINDOW:]),
        "reward_mean": _fmean(rewards),
        "collapsed": collapsed(rewards),
        "eval": [(s, v) for s, v, _ in evals],
        "eval_k": evals[0][2] if evals else None,
        "eval_first": evals[0][1] if evals else None,
        "eval_last": evals[-1][1] if len(evals) > 1 else None,
        "clipped_token": _fmean(r["loss/clipped_fraction_token"] for r in train),
        "clipped_token_later": _fmean(r["loss/clipped_fraction_token"] for r in later),
        "clipped_token_series": [_fmean(r["loss/clipped_fraction_token"] for r in by_step[s]) for s in steps],
        "routing_changed": _fmean(r.get("moe/routing_changed_fraction") for r in later),
        "routing_changed_series": [_fmean(r.get("moe/routing_changed_fraction") for r in by_step[s][1:]) for s in steps],
        "log_w_std": _fmean(r.get("loss/log_ratio_token_std") for r in later),
        "log_s_std": _fmean(r.get("loss/log_ratio_seq_std") for r in later),
        "by_length": {b: {"log_w_std": _weighted(later, TOKEN_STD + b, SEQS + b),
                          "log_s_std": _weighted(later, SEQ_STD + b, SEQS + b),
                          "clipped_token": _weighted(later, CLIPPED + b, SEQS + b),
                          "sequences": sum(r.get(SEQS + b, 0) for r in later)} for b in buckets},
        # the recompute's (pi_old's) log-probs against the sampler's, |delta| per token, once per rollout step
        "gap_token": _fmean(gap_token),
        "gap_token_series": gap_token,
        "response_length": _fmean(by_step[s][0].get("rollout/response_length_mean") for s in steps),
        "zero_signal": _fmean(by_step[s][0].get("reward/zero_signal_group_fraction") for s in steps),
        "rollout_tokens_per_s": _fmean(by_step[s][0].get("rollout/tokens_per_s") for s in steps),
        "step_s": statistics.median(by_step[s][0]["time/step_s"] for s in steps),
        "wall_s": float(wall.read_text()) if wall.exists() else None,
    }


# ------------------------------------------------------------------------------------------ per arm

def spread(values) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


SCALARS = ("reward_first", "reward_final", "unparsed_final", "reward_mean", "eval_first", "eval_last",
           "clipped_token", "clipped_token_later", "routing_changed", "log_w_std", "log_s_std", "gap_token",
           "response_length", "zero_signal", "rollout_tokens_per_s", "step_s", "wall_s")


def summarize_arm(arm: str, runs: dict[int, dict]) -> dict:
    out = {"arm": arm, "overrides": ARMS[arm], "seeds": sorted(runs),
           "collapses": sum(r["collapsed"] for r in runs.values()),
           **{key: spread(r[key] for r in runs.values()) for key in SCALARS}}
    buckets = sorted({b for r in runs.values() for b in r["by_length"]}, key=bucket_order)
    out["by_length"] = {b: {k: spread(r["by_length"].get(b, {}).get(k) for r in runs.values())
                            for k in ("log_w_std", "log_s_std", "clipped_token", "sequences")} for b in buckets}
    length = min(len(r["rewards"]) for r in runs.values())
    out["reward_curve"] = [spread(r["rewards"][i] for r in runs.values()) for i in range(length)]
    out["runs"] = {str(s): runs[s] for s in sorted(runs)}
    return out


def ratios(arms: dict[str, dict]) -> list[str]:
    lines = []
    for gspo, grpo in (("gspo", "grpo"), ("gspo_r3", "grpo_r3"), ("gspo", "grpo_r2")):
        if gspo in arms and grpo in arms:
            a, b = arms[gspo]["clipped_token"]["mean"], arms[grpo]["clipped_token"]["mean"]
            text = f"{a / b:.0f}x" if a is not None and b else "undefined (GRPO clipped no token)"
            lines.append(f"- clipped tokens {gspo} / {grpo}: {text}")
    return lines


def _fmt(s: dict, fmt: str) -> str:
    if s["mean"] is None:
        return "-"
    return f"{fmt.format(s['mean'])} ± {fmt.format(s['std'])}"


def table(arms: dict[str, dict]) -> str:
    cols = [("reward_first", "train reward, first 3 steps", "{:.3f}"),
            ("reward_final", "train reward, last 3 steps", "{:.3f}"),
            ("eval_first", "held-out mean@k, step 0", "{:.3f}"), ("eval_last", "held-out mean@k, end", "{:.3f}"),
            ("unparsed_final", "no answer line, last 3 steps", "{:.3f}"),
            ("clipped_token", "clipped tokens", "{:.2e}"), ("routing_changed", "routing changed per update", "{:.3f}"),
            ("log_w_std", "std log w_t", "{:.4f}"), ("log_s_std", "std log s_i", "{:.4f}"),
            ("gap_token", "train-vs-rollout \\|Δ logp\\| per token", "{:.2e}")]
    head = "| arm | seeds | " + " | ".join(t for _, t, _ in cols) + " | collapses |"
    rule = "|" + "---|" * (len(cols) + 3)
    rows = [f"| {a['arm']} | {len(a['seeds'])} | " + " | ".join(_fmt(a[k], f) for k, _, f in cols)
            + f" | {a['collapses']}/{len(a['seeds'])} |" for a in arms.values()]
    return "\n".join([head, rule, *rows])


def length_table(arms: dict[str, dict]) -> str:
    """One row per arm and response-length bucket: sequences per run, std log w_t, std log s_i, their ratio
    (for independent token ratios it would grow as sqrt(length)) and the clipped fraction of the bucket's tokens
    (over mini-batches 2..K; a run without the bucket-wise metric shows -)."""
    head = ("| arm | response length | sequences per run | std log w_t | std log s_i | std log w_t / std log s_i "
            "| clipped tokens (mini-batches 2..K) |")
    rows = [head, "|---|---|---|---|---|---|---|"]
    for a in arms.values():
        for b, c in shown_buckets(a["by_length"]).items():
            if c["log_w_std"]["mean"] is None:
                continue
            w, s_ = c["log_w_std"]["mean"], c["log_s_std"]["mean"]
            rows.append(f"| {a['arm']} | {b[len('len_'):]} | {c['sequences']['mean']:.0f} | "
                        f"{_fmt(c['log_w_std'], '{:.4f}')} | {_fmt(c['log_s_std'], '{:.4f}')} | "
                        f"{f'{w / s_:.1f}' if s_ else '-'} | "
                        f"{_fmt(c.get('clipped_token', spread([])), '{:.2e}')} |")
    return "\n".join(rows)


def plot(arms: dict[str, dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure")
        return
    fig, axes = plt.subplots(2, 4, figsize=(20, 7.5))
    names = list(arms)
    shown = {name: shown_buckets(a["by_length"]) for name, a in arms.items()}
    all_buckets = sorted({b for v in shown.values() for b in v}, key=bucket_order)
    for i, (name, a) in enumerate(arms.items()):
        color = f"C{i}"
        curve = a["reward_curve"]
        x = range(1, len(curve) + 1)
        axes[0, 0].plot(x, [c["mean"] for c in curve], color=color, marker=".", label=name)
        axes[0, 0].fill_between(x, [c["min"] for c in curve], [c["max"] for c in curve], color=color, alpha=0.15)
        for run in a["runs"].values():
            if run["eval"]:
                axes[0, 1].plot(*zip(*run["eval"]), marker="o", color=color, alpha=0.6,
                                label=name if run is next(iter(a["runs"].values())) else None)
        for key, ax in (("clipped_token_series", axes[0, 2]), ("routing_changed_series", axes[1, 0]),
                        ("gap_token_series", axes[1, 2])):
            series = [r[key] for r in a["runs"].values()]
            n = min(len(s) for s in series)
            mean = [_fmean(s[j] for s in series) for j in range(n)]
            pts = [(j + 1, m) for j, m in enumerate(mean) if m is not None]
            if pts:
                ax.plot(*zip(*pts), color=color, marker=".", label=name)
        labelled = False
        for b in shown[name]:
            j, c = all_buckets.index(b), shown[name][b]
            if c["log_w_std"]["mean"] is None:
                continue
            xpos = j * (len(names) + 1) + i
            axes[1, 1].bar(xpos, c["log_w_std"]["mean"], color=color, alpha=0.9,
                           yerr=c["log_w_std"]["std"], label=None if labelled else f"{name} log w_t")
            axes[1, 1].bar(xpos, c["log_s_std"]["mean"], color="k", alpha=0.35, width=0.5,
                           label="log s_i (black)" if (i == 0 and not labelled) else None)
            labelled = True
        pts = [(all_buckets.index(b), c["clipped_token"]["mean"]) for b, c in shown[name].items()
               if c.get("clipped_token", {}).get("mean") is not None]
        if pts:
            axes[0, 3].plot(*zip(*sorted(pts)), color=color, marker="o", label=name)
        ratio = [(all_buckets.index(b), c["log_w_std"]["mean"] / c["log_s_std"]["mean"]) for b, c in shown[name].items()
                 if c["log_w_std"]["mean"] is not None and c["log_s_std"]["mean"]]
        if ratio:
            axes[1, 3].plot(*zip(*sorted(ratio)), color=color, marker="o", label=name)
    for ax in (axes[0, 3], axes[1, 3]):
        ax.set_xticks(range(len(all_buckets)), all_buckets)
    axes[0, 3].set(title="clipped tokens by response length (mini-batches 2-K)", xlabel="length bucket")
    axes[0, 3].set_yscale("symlog", linthresh=1e-4)
    axes[1, 3].set(title="std log w_t / std log s_i by response length", xlabel="length bucket")
    axes[1, 1].set_xticks([j * (len(names) + 1) + (len(names) - 1) / 2 for j in range(len(all_buckets))], all_buckets)
    axes[0, 0].set(title="train reward (mean over seeds, min..max shaded)", xlabel="rollout step")
    axes[0, 1].set(title="held-out mean@k (each seed)", xlabel="rollout step")
    axes[0, 2].set(title="clipped fraction of tokens (seed mean)", xlabel="rollout step")
    axes[0, 2].set_yscale("symlog", linthresh=1e-4)  # GRPO's may be 0
    axes[1, 0].set(title="MoE routing changed vs pi_old (mini-batches 2-K)", xlabel="rollout step")
    axes[1, 1].set(title="std log w_t (bars) vs std log s_i (black), by response length", xlabel="length bucket")
    axes[1, 2].set(title="train-vs-rollout |Δ logp| per token", xlabel="rollout step", yscale="log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report(arms: dict[str, dict], meta: dict) -> str:
    k = next((r["eval_k"] for a in arms.values() for r in a["runs"].values() if r["eval_k"]), "?")
    lines = [f"# The paper's MoE comparison on a CPU: {meta['budget']}, task {meta.get('task', 'long_addition')}", "",
             f"Config examples/paper_moe/config.yaml (+ {' '.join(meta['overrides']) or 'no overrides'}); initial "
             f"weights {meta['weights']} (sha256 prefix of OUT/hf), the same for every arm and seed. Generated by "
             "benchmarks/moe_stability.py from the runs' metrics.jsonl; mean ± sample std over seeds.", "",
             table(arms), "", f"held-out mean@k: k = {k}, at step 0 (the initial weights) and after the last step. "
             "No answer line: the fraction of training responses the verifier could not read (format lost).", "",
             "Clipped tokens: fraction of response tokens outside the band, over all K mini-batches. Routing "
             "changed, std log w_t / log s_i: over mini-batches 2..K (after an update; mini-batch 1 is "
             "on-policy). Train-vs-rollout: mean |log pi_old - log pi_sampler| per token, at the recompute.", "",
             *ratios(arms), "", f"Collapse: {COLLAPSE_DEFINITION}.", "",
             "## Ratio spreads by response length (mini-batches 2..K, weighted by the bucket's sequences; buckets "
             f"with at least {MIN_BUCKET_SEQUENCES} sequences per run)", "",
             length_table(arms), "",
             "## Per arm, other numbers", "",
             "| arm | mean response length | zero-signal groups | rollout tokens/s | step s (median) | wall s per run |",
             "|---|---|---|---|---|---|"]
    for a in arms.values():
        lines.append(f"| {a['arm']} | {_fmt(a['response_length'], '{:.1f}')} | {_fmt(a['zero_signal'], '{:.2f}')} | "
                     f"{_fmt(a['rollout_tokens_per_s'], '{:.0f}')} | {_fmt(a['step_s'], '{:.1f}')} | "
                     f"{_fmt(a['wall_s'], '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def collect(out: Path, arms: list[str], seeds: list[int]) -> dict[str, dict]:
    """The finished runs (run_one writes RUN/wall_s when one exits 0); a run cut short is named and left out."""
    result = {}
    for arm in arms:
        runs = {}
        for seed in seeds:
            run_dir = out / "runs" / arm / f"seed{seed}"
            if (run_dir / "wall_s").exists():
                runs[seed] = summarize_run(run_dir)
            elif (run_dir / "metrics.jsonl").exists():
                print(f"{run_dir}: not finished, left out")
        if runs:
            result[arm] = summarize_arm(arm, runs)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N per arm")
    p.add_argument("--steps", type=int, default=16, help="rollout steps per run (the fixed budget)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="smoke: 2 arms x 1 seed x 2 small steps")
    p.add_argument("--task", choices=sorted(TASKS), default="long_addition",
                   help="long_addition: ~74-token responses; long_addition_mixed: 42-148 tokens (the length trend)")
    p.add_argument("--out", help="model (OUT/hf) and runs (OUT/runs); default runs/paper_moe, or runs/paper_moe_mixed "
                   "for --task long_addition_mixed")
    p.add_argument("--results", help="where results.md/.json/.png go (default: OUT/results)")
    p.add_argument("--model-seed", type=int, default=1234, help="seed of OUT/hf when it is made")
    p.add_argument("--server-per-run", action="store_true", help="each run launches its own SGLang server")
    p.add_argument("--no-train", action="store_true", help="summarize the runs already in OUT")
    p.add_argument("--only-model", action="store_true", help="make OUT/hf and stop")
    p.add_argument("overrides", nargs="*", help="config overrides for every run (key.sub=value)")
    args = p.parse_args(argv)
    overrides = TASKS[args.task]["overrides"] + list(args.overrides)
    if args.preset:
        preset = PRESETS[args.preset]
        args.arms, args.seeds, args.steps = preset["arms"], preset["seeds"], preset["steps"]
        overrides = preset["overrides"] + overrides
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    seeds = list(range(1, args.seeds + 1))
    default_out = REPO / "runs" / ("paper_moe" if args.task == "long_addition" else "paper_moe_mixed")
    out = Path(args.out or default_out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    hf = make_model(out, args.model_seed, args.task)
    if args.only_model:
        print(hf)
        return 0
    start = time.perf_counter()
    if not args.no_train:
        server = None if args.server_per_run else SharedServer(CONFIG, hf, out / "server",
                                                                ["gspo.routing_replay=rollout", *overrides])
        try:
            for seed in seeds:
                for arm in arms:
                    run_one(arm, seed, hf, out, args.steps, overrides, server)
        finally:
            if server is not None:
                server.stop()
    wall = time.perf_counter() - start
    results = collect(out, arms, seeds)
    if not results:
        raise SystemExit(f"no runs under {out / 'runs'}")
    ran = {a: len(r["seeds"]) for a, r in results.items()}
    steps = sorted({run["steps"] for r in results.values() for run in r["runs"].values()})
    budget = (f"{len(results)} arms x {'/'.join(str(n) for n in sorted(set(ran.values())))} seeds x "
              f"{'/'.join(map(str, steps))} rollout steps")
    meta = {"budget": budget, "task": args.task, "overrides": overrides, "weights": weights_digest(hf),
            "wall_s": None if args.no_train else wall, "collapse": COLLAPSE_DEFINITION}
    target = Path(args.results) if args.results else out / "results"
    target.mkdir(parents=True, exist_ok=True)
    text = report(results, meta)
    print("\n" + text)
    (target / "results.md").write_text(text)
    (target / "results.json").write_text(json.dumps({"meta": meta, "arms": results}, indent=1))
    plot(results, target / "moe_stability.png")
    print(f"written: {target}/results.md, results.json, moe_stability.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
