"""Benchmark: where a GSPO step's time goes in the CPU demo (examples/tiny_cpu.yaml), and tokens/s.

Runs `megatron-gspo train` for a few rollout steps per variant (by default the demo's disk weight
sync and the NCCL/gloo-broadcast sync; `--vary KEY` compares values of any other config key), side by
side in one run, same model, same seed, optionally repeated and interleaved, and prints
the mean seconds per rollout step of each phase, its share of the step, and the ratio between the
variants. The first rollout step (warm-up: first forward passes, first server requests) is left out.
A checkpoint is saved every --checkpoint-interval steps here; its mean time is spread over the
config's checkpoint.interval (the demo's: 10) in the table, so the shares are those of the demo.
The default model is the demo's at its start (format warm-start, reward ~0.1). `--hf DIR` takes
another, e.g. the demo's final weights (`checkpoint.export_hf`, or tools/convert_mcore_to_hf.py of
its last checkpoint): late in the run dynamic sampling rolls out many more prompts per step.

    python benchmarks/step.py                       # 8 steps x {disk, broadcast}
    python benchmarks/step.py --steps 4 --variants disk
    python benchmarks/step.py --override parallel.tp=1   # any config override, for every variant
    python benchmarks/step.py --hf runs/tiny_cpu/hf_final --variants disk   # a trained model
    python benchmarks/step.py --vary rollout.concurrency --variants 16,64 --repeats 2   # any config key
    python benchmarks/step.py --profile --variants disk   # + the parts of a step, per rank (logging.profile)
    python benchmarks/step.py --vary parallel.tp --variants 2,1+parallel.dp=2   # "+": a variant's own overrides

--profile runs with logging.profile=true (megatron_gspo/profiling.py) and prints, per variant, the
step's named parts below the phases: rank 0's seconds per step and the most any other rank spent, each
with its share of the step, a part's sub-parts indented under it, "(rest)" the part's time in no sub-part.

Needs .venv-sglang (scripts/setup_sglang.sh); run with the trainer's .venv python.
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_gspo.training.metrics import read_metrics  # noqa: E402  (needs the path above)

PHASES = [("rollout", "time/rollout_s"), ("old log-prob recompute", "time/recompute_s"),
          ("train (fwd+bwd+optimizer)", "time/train_s"), ("weight sync", "time/sync_s"),
          ("checkpoint (when saved)", "time/checkpoint_s")]


def run_variant(config: str, hf_dir: Path, workdir: Path, steps: int, interval: int, overrides: list[str]) -> dict:
    run_dir = workdir / "run"
    args = [sys.executable, "-m", "megatron_gspo.cli", "train", config, f"model.hf_path={hf_dir}",
            f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir / 'ckpt'}", f"checkpoint.interval={interval}",
            f"num_steps={steps}", "logging.progress_bar=false", "eval.interval=0", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(overrides)}):\n{proc.stdout[-4000:]}")
    wall = time.perf_counter() - start
    steps_seen: dict[int, list[dict]] = defaultdict(list)
    for record in read_metrics(run_dir):
        if "loss/value" in record:  # training records (an eval, when asked for, has its own)
            steps_seen[record["rollout_step"]].append(record)
    measured = [records for step, records in sorted(steps_seen.items()) if step > 1]
    if not measured:
        raise SystemExit("need at least 2 steps (the first is warm-up)")
    out = {key: statistics.mean(r[0][key] for r in measured) for _, key in PHASES[:-1]}
    # Steps that saved one, and the others (with checkpoint.async_save they publish the finished ones).
    saved = [r[0]["time/checkpoint_s"] for r in measured if r[0]["rollout_step"] % interval == 0]
    between = [r[0]["time/checkpoint_s"] for r in measured if r[0]["rollout_step"] % interval != 0]
    out["time/checkpoint_s"] = statistics.mean(saved) if saved else 0.0
    out["checkpoint_between_s"] = statistics.mean(between) if between else 0.0
    out["step"] = statistics.mean(r[0]["time/step_s"] for r in measured)
    out["checkpoint_amortised"] = sum(r[0]["time/checkpoint_s"] for r in measured) / len(measured)
    out["rollout_tokens_per_s"] = statistics.mean(r[0]["rollout/tokens_per_s"] for r in measured)
    # Trainer throughput: the response tokens of the step (all K mini-batches) per second of
    # recompute + training; the prompt tokens ride along in every forward but earn no gradient.
    # (The records' own train/tokens_per_s leaves the recompute out: one optimizer step's fwd+bwd+update.)
    out["recompute_train_tokens_per_s"] = statistics.mean(
        sum(m["train/response_tokens"] for m in r) / (r[0]["time/recompute_s"] + r[0]["time/train_s"]) for r in measured)
    # rollout.max_staleness > 0: generation runs in the background; "rollout" above is the trainer's wait.
    out["generate_s"] = statistics.mean(r[0].get("time/rollout_generate_s", 0.0) for r in measured)
    out["sync_wait_s"] = statistics.mean(r[0].get("time/sync_wait_s", 0.0) for r in measured)
    out["wall_s"] = wall
    out["reward_mean"] = statistics.mean(r[0]["reward/mean"] for r in measured)
    out["response_length_mean"] = statistics.mean(r[0]["rollout/response_length_mean"] for r in measured)
    out["env_token_fraction"] = statistics.mean(r[0].get("rollout/env_token_fraction", 0.0) for r in measured)
    for key in sorted({k for r in measured for k in r[0] if k.startswith("profile/")}):
        out[key] = statistics.mean(r[0].get(key, 0.0) for r in measured)  # a part absent in a step took 0
    return out


ORDER = ["rollout", "advantages", "train", "sync", "eval", "checkpoint", "log", "untracked", "background"]


def print_profile(results: dict[str, dict], interval: int) -> None:
    """Per variant: the step's parts (logging.profile) as a tree, rank 0 and the other ranks' maximum."""
    for name, r in results.items():
        seconds: dict[str, dict[str, float]] = defaultdict(dict)
        for key, value in r.items():
            if key.startswith("profile/"):
                part, column = key.removeprefix("profile/").rsplit("/", 1)
                seconds[part][column] = value
        if not seconds:
            continue
        step = r["step"]
        parts = sorted(seconds, key=lambda p: (ORDER.index(p.split("/")[0]) if p.split("/")[0] in ORDER
                                               else len(ORDER), p))
        print(f"\n[{name}] parts of a rollout step: seconds per step (mean over the measured steps; a checkpoint "
              f"every {interval} steps), share of the step ({step:.3f} s)")
        print(f"{'part':44s}{'rank 0':>10s}{'share':>7s}{'others (max)':>14s}{'share':>7s}")

        def row(label, values):
            r0, other = values.get("rank0_s", 0.0), values.get("others_max_s", 0.0)
            print(f"{label:44s}{r0:10.4f}{r0 / step:7.1%}{other:14.4f}{other / step:7.1%}")

        for part in parts:
            depth = part.count("/")
            row("  " * depth + part.rsplit("/", 1)[-1], seconds[part])
        # The time of each part with sub-parts that none of them covers, and of the step in no part.
        print(f"{'(rest: in a part, in none of its sub-parts)':44s}")
        for part in parts:
            children = [p for p in parts if p.startswith(part + "/") and p.count("/") == part.count("/") + 1]
            if children:
                rest = {c: seconds[part].get(c, 0.0) - sum(seconds[ch].get(c, 0.0) for ch in children)
                        for c in ("rank0_s", "others_max_s")}
                row(f"  {part}", rest)
        top = [p for p in parts if "/" not in p and p != "background"]
        row("step, in no part", {c: step - sum(seconds[p].get(c, 0.0) for p in top) for c in ("rank0_s", "others_max_s")})


def print_table(results: dict[str, dict], demo_interval: int) -> None:
    """Seconds per rollout step by phase, with its share of the step as the demo runs it: the
    checkpoint's measured time spread over the demo's checkpoint interval."""
    names = list(results)
    head = f"{'phase (s per rollout step)':34s}" + "".join(f"{n:>22s}" for n in names)
    if len(names) == 2:
        head += f"{'ratio 2nd/1st':>16s}"
    print(head)
    rows = [(label, key) for label, key in PHASES[:-1]] + [
        (f"checkpoint (1 per {demo_interval} steps)", "checkpoint"), ("other (batch broadcast, logs)", "other"),
        ("step total", "total")]
    shares = {}
    for label, key in rows:
        line, values = f"{label:34s}", []
        for n in names:
            r = results[n]
            measured_other = r["step"] - sum(r[k] for _, k in PHASES[:-1]) - r["checkpoint_amortised"]
            checkpoint = (r["time/checkpoint_s"] + (demo_interval - 1) * r["checkpoint_between_s"]) / demo_interval
            phase = {"checkpoint": checkpoint, "other": measured_other}
            total = sum(r[k] for _, k in PHASES[:-1]) + phase["checkpoint"] + phase["other"]
            v = total if key == "total" else phase.get(key, r.get(key))
            shares.setdefault(n, {})[label] = v / total
            values.append(v)
            line += f"{v:14.3f} s" + (f" {v / total:5.0%}" if key != "total" else "      ")
        if len(names) == 2:
            line += f"{values[1] / values[0]:15.2f}x" if values[0] > 0 else f"{'-':>16s}"
        print(line)
    print(f"{'checkpoint, one save':34s}" + "".join(f"{results[n]['time/checkpoint_s']:14.3f} s      " for n in names))
    for label, key in [("generation (in the background: >0 ahead)", "generate_s"),
                       ("  of sync: waiting for the servers", "sync_wait_s")]:
        print(f"{label:34s}" + "".join(f"{results[n][key]:14.3f} s      " for n in names))
    for label, key in [("rollout tokens/s (SGLang)", "rollout_tokens_per_s"),
                       ("recompute+train tokens/s", "recompute_train_tokens_per_s"), ("wall time of the run (s)", "wall_s")]:
        print(f"{label:34s}" + "".join(f"{results[n][key]:16.1f}      " for n in names))
    print(f"{'reward mean':34s}" + "".join(f"{results[n]['reward_mean']:16.3f}      " for n in names))
    for n in names:
        phase = {k: v for k, v in shares[n].items() if k != "step total"}
        top = max(phase, key=phase.get)
        print(f"[{n}] largest share: {top} ({phase[top]:.0%} of the step)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "examples/tiny_cpu.yaml"))
    p.add_argument("--hf", help="tiny HF model directory (default: a fresh format-warm-started one)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--checkpoint-interval", type=int, default=4)
    p.add_argument("--vary", default="rollout.weight_sync", help="the config key the variants set")
    p.add_argument("--variants", default="disk,broadcast", help="values of --vary to compare")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the variants this many times, interleaved (A B A B ...), and average: the "
                        "machine's speed drifts, and interleaving spreads the drift over every variant")
    p.add_argument("--override", action="append", default=[], help="config key=value for every variant")
    p.add_argument("--profile", action="store_true", help="also time the named parts of each step, per rank")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")

    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        hf_dir = Path(args.hf) if args.hf else Path(tmp) / "hf"
        if not args.hf:
            from megatron_gspo.dev.tiny_model import make_tiny_qwen3
            from megatron_gspo.dev.warm_start import warm_start_format

            make_tiny_qwen3(hf_dir)
            warm_start_format(hf_dir)
        short = args.vary.rsplit(".", 1)[-1].replace("weight_sync", "sync")
        runs: dict[str, list[dict]] = defaultdict(list)
        for repeat in range(args.repeats):
            for variant in args.variants.split(","):
                print(f"running {args.steps} steps with {args.vary}={variant} "
                      f"({repeat + 1}/{args.repeats}) ...", flush=True)
                value, *more = variant.split("+")  # "1+parallel.dp=2": the value, then overrides of its own
                runs[f"{short}={variant}"].append(run_variant(
                    args.config, hf_dir, Path(tmp) / f"{re.sub(r'[^A-Za-z0-9_.=-]+', '_', variant)}-{repeat}", args.steps, args.checkpoint_interval,
                    [f"{args.vary}={value}", *more, *args.override, *(["logging.profile=true"] if args.profile else [])]))
        results = {name: {key: statistics.mean(r.get(key, 0.0) for r in rs) for key in {k for r in rs for k in r}}
                   for name, rs in runs.items()}
        if args.repeats > 1:
            for name, rs in runs.items():
                print(f"[{name}] step total per repeat: " + ", ".join(f"{r['step']:.2f} s" for r in rs))
        print()
        from megatron_gspo.config import load_config
        print_table(results, load_config(args.config).checkpoint.interval)
        print_profile(results, args.checkpoint_interval)  # the variants run with logging.profile=true
    return 0


if __name__ == "__main__":
    sys.exit(main())
