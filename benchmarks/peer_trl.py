"""Benchmark: the CPU demo through Hugging Face TRL and through this project, one after the other, same
model, prompts, reward and matched GSPO settings; a table of step time, its parts, start-up and learning.

What each side is:
- TRL: `GRPOTrainer` of TRL 1.16 in ONE process (`--trl-threads` torch threads, default 2), generation
  in-process with the policy's own `generate()` (no server, no weight transfer). It runs in its own virtual
  environment, made here on first use (`runs/peer_trl/.venv-trl`, reused when its versions are the pinned
  ones): TRL is never a dependency of this package. The TRL script is benchmarks/peer_trl_worker.py.
- this project: `megatron-gspo train examples/tiny_cpu.yaml`: one SGLang server on CPU for the rollouts
  (HTTP), Megatron-Core with TP2 on 2 processes (gloo) for pi_old's log-probs and training, the new weights
  to the server through disk after every step, a checkpoint every checkpoint.interval steps (the example's
  10). Four rows: gspo.dynamic_sampling=false (reads the same prompts per step as TRL: like for like),
  ours_dp2: the same with the 2 trainer processes data-parallel (parallel.tp=1 parallel.dp=2) instead of
  TP2, true (the example's default: zero-signal groups are dropped and more prompts rolled out), and
  ours_overlap: dynamic sampling off with rollout.max_staleness=1 gspo.old_logprobs=rollout (the servers
  sample the next batch while this one trains; one step off-policy, pi_old = the sampler's log-probs).

Matched (the numbers are read from the project's resolved config and passed to the TRL script): the model
(`megatron-gspo tiny-model DIR --warm-start arithmetic`, one HF directory for both), the prompts
(examples/data/arithmetic/train.jsonl, chat messages, rendered "3+4=" by the tiny tokenizer's template),
the reward (exact match of the response before EOS with the answer; TRL: an equivalent function written in
the TRL script, since TRL cannot call megatron_gspo's), G=16 samples x 16 prompts per rollout step, 8
optimizer steps per rollout step on 8 disjoint mini-batches, pi_old's log-probs recomputed once per batch,
GSPO sequence ratio with the per-sequence mean (TRL: importance_sampling_level="sequence",
loss_type="grpo"), band 3e-4 / 4e-4, no KL, group-normalised advantages, Adam lr 1e-3 constant, grad clip
1.0, float32, temperature 1.0, at most 4 new tokens, seed 1234. Held-out evaluation is off on our side
(eval.interval=0; TRL evaluates nothing either). Not matched (neither can be set to the other's):
TRL shuffles the 256 samples before cutting mini-batches, ours keeps each mini-batch to 2 whole groups; TRL's
advantage divides by std + 1e-4, ours by std + 1e-6; TRL's sampler drops the last 13 of the 45 prompts in
each epoch (45 is not a multiple of 16), ours streams across epochs; SGLang's sampling is not seeded; TRL
saves no checkpoints.

Columns (seconds per rollout step, the median over the steps after the first, the warm-up): step: the
whole rollout step; generation: sampling + rewards (TRL: `_generate_and_score_completions` less the pi_old
forward; ours: time/rollout_s); training: pi_old's log-probs + the 8 forward/backward/optimizer steps (TRL:
the rest of the step; ours: time/recompute_s + time/train_s); other: weight sync, checkpoints, logging (TRL:
0 by construction; ours: time/step_s less the rest). Medians of parts need not add up to the median step.
mean step: the mean, checkpoints included. start-up: from launching the command to the start of step 1
(ours: torchrun, Megatron set-up, HF -> Megatron conversion, SGLang start). to 0.8: wall time from launch
(start-up included) until the mean reward of the last 10 rollout steps first reaches 0.8, and that step.
final reward: the mean reward of the last 10 steps (reward/mean: over every generated sample; with dynamic
sampling a step generates more samples than it trains on).

    python benchmarks/peer_trl.py                # 100 rollout steps per side (the issue's comparison)
    python benchmarks/peer_trl.py --quick        # smoke run: 3 steps per side (no 10-step window)
    python benchmarks/peer_trl.py --sides trl,ours  # a subset of trl, ours, ours_dp2, ours_dynamic, ours_overlap
    python benchmarks/peer_trl.py --task long_addition --sides trl,ours --steps 60 --repeats 2 --reward-target 0.22
                                                 # the long task (examples/tiny_long_cpu.yaml, ~74-token responses)

--task long_addition matches examples/tiny_long_cpu.yaml instead (results under OUT/long_addition/): the dense
tiny model cold-started as that file says (`tiny-model --warm-start long_addition --cold-start 200`, TINY_MODEL_ARGS),
G=8 x 16 prompts, 4 mini-batches, lr 3e-4, at most 128 new tokens, the final_answer reward (the TRL script's copy
of it). There generation is most of a step, so the table's generated tokens/s (response tokens, EOS included, per
second of generation: TRL's `generate()` alone, ours the servers' rollout/tokens_per_s) is the number to compare.
--repeats N runs the sides N times interleaved, so that both see the same machine load.

Measured 2026-12-07 16:58-17:15 UTC (`--task long_addition --sides trl,ours --steps 60 --repeats 2 --reward-target
0.22 --window 10 --trl-share-packages`; a quiet machine, 1-min load average 1.5-2.4 at the end of each side, from
the side itself; examples/results/peer_trl/long_addition.md):

| side | step s (median) | generation s | training s | start-up s | generated tokens/s | response tokens | wall s to 10-step reward 0.22 (step) | final 10-step reward |
|---|---|---|---|---|---|---|---|---|
| trl #1 | 2.635 | 1.164 | 1.444 | 10.7 | 8307 | 74.4 | 107 (39) | 0.245 |
| ours #1 | 3.166 | 1.969 | 1.038 | 74.2 | 4792 | 74.3 | 156 (26) | 0.289 |
| trl #2 | 2.517 | 1.090 | 1.424 | 9.5 | 8904 | 74.4 | 110 (39) | 0.245 |
| ours #2 | 3.209 | 2.008 | 1.104 | 52.8 | 4786 | 74.5 | 166 (33) | 0.262 |

On this tiny model (2 layers, hidden 64) TRL's `generate()` makes 8,300-8,900 tokens/s and SGLang on CPU
4,800: a decode step of 128 sequences costs next to nothing in arithmetic, so per-step scheduling overhead decides
it, and SGLang's scheduler (a separate process, the batched-attention plugin, HTTP) costs more than HF's loop.
Our step is 1.2x TRL's; our training part is shorter (1.0-1.1 s against 1.4 s). Both reach a 10-step mean reward
of 0.22 (from ~0.16): TRL in 107-110 s (step 39; its two runs are the same trajectory, seeded), ours in 156-166 s
(steps 26 and 33; SGLang's sampling is not seeded), of which 53-74 s are start-up (SGLang, Megatron set-up,
conversion). An earlier 3-step measurement on a machine loaded 11-15 on 2 cores (TRL 88 s per step, 165 tokens/s)
said the opposite; it measured the load, not the engines.

Run with the project's .venv python (needs .venv-sglang, scripts/setup_sglang.sh); the first run makes the
TRL environment (pip, ~1.5 GB; torch is pinned to the project's 2.13.0: pip takes a CPU wheel where its
configuration finds one, else pass `--pip-arg=--extra-index-url=URL` of a CPU wheel index). The table is
printed and written to runs/peer_trl/results.md; per-step records lie under runs/peer_trl/.

Not run in CI (it installs TRL); `--quick` is the smoke check (~2 min with the TRL environment present).

Measured 2026-12-05 23:40-23:52 UTC (`--sides trl,ours,ours_dp2,ours_overlap`, 100 rollout steps per side;
1-min load average 2.0-3.1 at the end of each side, from the side itself):

| side | step s (median) | generation s | training s | other s | mean step s | start-up s | wall s to 10-step reward 0.8 (step) | final 10-step reward | wall s (all) |
|---|---|---|---|---|---|---|---|---|---|
| trl | 0.193 | 0.042 | 0.150 | 0.000 | 0.198 | 3.5 | 18 (73) | 0.807 | 24 |
| ours | 0.409 | 0.131 | 0.237 | 0.036 | 0.428 | 27.4 | 55 (64) | 0.855 | 78 |
| ours_dp2 | 0.333 | 0.130 | 0.167 | 0.030 | 0.347 | 25.4 | 46 (60) | 0.845 | 68 |
| ours_overlap | 0.362 | 0.001 | 0.303 | 0.051 | 0.382 | 23.9 | 46 (58) | 0.916 | 70 |

Per-step time (median): ours / trl 2.12x, ours_dp2 / trl 1.73x, ours_overlap / trl 1.88x. trl: generate()
alone 0.034 s; ours: weight sync 0.027 s, checkpoints 1.0 s over the run, 16 groups per step.
Before (2026-12-04 19:04-19:17, a loaded machine): trl 0.287 s, ours 0.887 s (3.09x), ours_overlap 0.572 s,
ours_dynamic 4.039 s (176 groups per step).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_gspo.config import TrainConfig, load_config  # noqa: E402  (needs the path above)
from megatron_gspo.loss.policy import clip_range  # noqa: E402
from megatron_gspo.rollout.sglang.server import default_sglang_python  # noqa: E402
from megatron_gspo.training.metrics import read_metrics  # noqa: E402

TRL_PINS = {"torch": "2.13.0", "trl": "1.16.0", "transformers": "5.19.0", "accelerate": "1.16.0",
            "datasets": "5.2.0"}
"""The TRL environment: TRL 1.16 and the versions it was checked with (transformers and torch as in the
project's .venv, so both sides run the same kernels for the same model)."""

TASKS = {"arithmetic": REPO / "examples" / "tiny_cpu.yaml", "long_addition": REPO / "examples" / "tiny_long_cpu.yaml"}
"""--task: the example config of each side's settings; the model is `tiny-model --warm-start TASK`."""
WORKER = REPO / "benchmarks" / "peer_trl_worker.py"
SIDES = ("trl", "ours", "ours_dp2", "ours_dynamic", "ours_overlap")
OVERLAP = ["rollout.max_staleness=1", "gspo.old_logprobs=rollout"]
DP2 = ["parallel.tp=1", "parallel.dp=2"]
"""ours_dp2: like `ours` (like for like) with the 2 trainer processes data-parallel instead of TP2: no
collective inside a layer, one gradient all-reduce per mini-batch. The layout a 2-layer model should use;
the example keeps TP2 because it exercises the vocabulary-sharded path big models take."""
EXTRA = {"ours_dp2": DP2, "ours_overlap": OVERLAP}
"""ours_overlap: one-step-off rollouts (the servers sample the next batch while this one trains, weights
one version older) with the sampler's log-probs as pi_old: no recompute. Not like for like (off-policy by
one step): the fastest this project runs the demo."""


@dataclass
class SideResult:
    """One side's run: per-rollout-step series (seconds, rewards) and the launch-relative times."""

    name: str
    step_s: list[float]
    generation_s: list[float]
    training_s: list[float]
    other_s: list[float]
    rewards: list[float]
    startup_s: float
    wall_s: float
    tokens_per_s: list[float] = field(default_factory=list)
    """Generated response tokens per second of generation, per rollout step (TRL: `generate()` alone;
    ours: rollout/tokens_per_s, the servers' generation time)."""
    response_length: list[float] = field(default_factory=list)
    target: float = 0.8
    window: int = 10
    notes: list[str] = field(default_factory=list)

    def median(self, series: list[float]) -> float:
        measured = series[1:] or series  # the first step is warm-up
        return statistics.median(measured)

    def reached(self) -> tuple[float, int] | None:
        """(wall seconds from launch, step) when the mean reward of the last `window` steps first reaches
        `target`; None when it never does."""
        for end in range(self.window, len(self.rewards) + 1):
            if statistics.mean(self.rewards[end - self.window:end]) >= self.target:
                return self.startup_s + sum(self.step_s[:end]), end
        return None

    def final_reward(self) -> float | None:
        return statistics.mean(self.rewards[-self.window:]) if len(self.rewards) >= self.window else None


def versions(python: Path, packages) -> dict[str, str]:
    """Installed versions of `packages` in the environment of `python` ("missing" where absent)."""
    code = ("import importlib.metadata as m, json, sys\n"
            "def v(p):\n    try: return m.version(p)\n    except m.PackageNotFoundError: return 'missing'\n"
            "print(json.dumps({p: v(p) for p in sys.argv[1:]}))")
    out = subprocess.run([str(python), "-c", code, *packages], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def off_pin(python: Path) -> dict[str, str]:
    """The packages of TRL_PINS whose version in `python`'s environment is not the pinned one (local
    build tags such as "+cpu" aside), with the version found."""
    found = versions(python, TRL_PINS)
    return {name: version for name, version in found.items() if version.split("+")[0] != TRL_PINS[name]}


def trl_env(venv: Path, pip_args: list[str], share_packages: bool = False) -> Path:
    """The python of the TRL environment at `venv`: made (python -m venv + pip install of TRL_PINS) when
    absent, re-installed when its versions differ from the pins, else reused as it is.

    share_packages: the new environment also reads this project's site-packages (a .pth file, after its
    own), so pip installs only what the project's environment lacks (TRL, accelerate) and both sides run
    the very same torch and transformers; pip never changes the project's environment (it installs into
    `venv`, whose own packages come first)."""
    python = venv / "bin" / "python"
    if python.exists() and not off_pin(python):
        return python
    if not python.exists():
        print(f"making the TRL environment {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        if share_packages:
            code = "import site, sys; print(site.getsitepackages()[0])"
            own = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()
            ours = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
            (Path(own) / "megatron_gspo_shared.pth").write_text(ours + "\n")
    pins = [f"{name}=={version}" for name, version in TRL_PINS.items()]
    print(f"pip install {' '.join(pins)} into {venv} ...", flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pip_args, *pins], check=True)
    wrong = off_pin(python)
    if wrong:
        raise SystemExit(f"{venv}: after pip install, versions differ from TRL_PINS: {wrong}")
    return python


TINY_MODEL_ARGS = {"arithmetic": ["--warm-start", "arithmetic"],
                   "long_addition": ["--warm-start", "long_addition", "--cold-start", "200"]}
"""`megatron-gspo tiny-model DIR ARGS` of each --task: the model its example config is run from
(examples/tiny_long_cpu.yaml's header: the 200-step cold start, ~12% of held-out sums right when sampled)."""


def tiny_model(hf_dir: Path, task: str) -> None:
    """The demo's model for `task` in `hf_dir`, made with this project's CLI unless one made with the same
    arguments is already there (`hf_dir`/tiny_model_args.json records them)."""
    args = TINY_MODEL_ARGS[task]
    made = hf_dir / "tiny_model_args.json"
    if (hf_dir / "config.json").exists() and made.exists() and json.loads(made.read_text()) == args:
        return
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "tiny-model", str(hf_dir), *args], cwd=REPO, check=True)
    made.write_text(json.dumps(args))


def run_trl(python: Path, config: TrainConfig, hf_dir: Path, out_dir: Path, threads: int, name: str = "trl"
            ) -> SideResult:
    """TRL's GRPOTrainer on the settings of `config` (benchmarks/peer_trl_worker.py), in its own process."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    if len(config.data.train) != 1 or not config.data.train[0].endswith(".jsonl"):
        raise SystemExit(f"data.train: the TRL script reads one .jsonl file, got {config.data.train}")
    g = config.gspo
    eps_low, eps_high = clip_range(g.algorithm, g.eps_low, g.eps_high)
    cmd = [str(python), str(WORKER), "--model", str(hf_dir), "--data", config.data.train[0],
           "--out", str(out_dir / "steps.jsonl"), "--work-dir", str(out_dir / "trainer"),
           "--steps", str(config.num_steps), "--group-size", str(g.group_size), "--prompts", str(g.prompts_per_step),
           "--minibatches", str(g.num_minibatches), "--eps-low", str(eps_low), "--eps-high", str(eps_high),
           "--lr", str(config.optimizer.lr), "--clip-grad", str(config.optimizer.clip_grad),
           "--temperature", str(config.sampling.temperature), "--max-new-tokens", str(config.sampling.max_new_tokens),
           "--seed", str(config.seed), "--threads", str(threads), "--reward", config.reward.fn]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    launched = time.time()
    with open(out_dir / "log.txt", "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.time() - launched
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed (exit {proc.returncode}): see {out_dir / 'log.txt'}:\n"
                         + (out_dir / "log.txt").read_text()[-3000:])
    lines = [json.loads(line) for line in (out_dir / "steps.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "step" in r]
    if len(steps) != config.num_steps:
        raise SystemExit(f"{out_dir / 'steps.jsonl'}: {len(steps)} rollout steps, expected {config.num_steps}")
    return SideResult(
        name=name, step_s=[r["step_s"] for r in steps],
        generation_s=[r["rollout_s"] - r["recompute_s"] for r in steps],
        training_s=[r["train_s"] + r["recompute_s"] for r in steps], other_s=[0.0 for _ in steps],
        rewards=[r["reward_mean"] for r in steps], startup_s=lines[0]["unix_time"] - launched, wall_s=wall,
        tokens_per_s=[r["completion_tokens"] / r["generate_s"] for r in steps if r.get("completion_tokens", -1) > 0],
        response_length=[r["completion_tokens"] / r["samples"] for r in steps if r.get("completion_tokens", -1) > 0],
        notes=[f"generate() alone: median {statistics.median([r['generate_s'] for r in steps][1:] or [0]):.3f} s"])


def our_overrides(hf_dir: Path, run_dir: Path, steps: int, dynamic_sampling: bool, extra: Sequence[str] = ()
                  ) -> list[str]:
    """examples/tiny_cpu.yaml's overrides for one row: fresh run directory, fixed steps, no eval."""
    return [*extra, f"model.hf_path={hf_dir}", f"logging.run_dir={run_dir}", f"checkpoint.dir={run_dir / 'checkpoints'}",
            f"num_steps={steps}", f"gspo.dynamic_sampling={str(dynamic_sampling).lower()}", "eval.interval=0",
            "logging.progress_bar=true", "logging.tensorboard=false"]


def run_ours(name: str, config_path: Path, overrides: list[str], run_dir: Path) -> SideResult:
    """`megatron-gspo train CONFIG OVERRIDES` from a fresh run directory; the start of step 1 is the time its
    progress line is printed less that step's time/step_s."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # else the run would resume from its checkpoints
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(config_path), *overrides]
    launched, first_line = time.time(), None
    with open(run_dir.parent / f"{run_dir.name}.log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if first_line is None and line.startswith("step 1/"):
                first_line = time.time()
        proc.wait()
    wall = time.time() - launched
    if proc.returncode != 0 or first_line is None:
        raise SystemExit(f"{name} run failed (exit {proc.returncode}): see {log.name}:\n"
                         + Path(log.name).read_text()[-3000:])
    by_step: dict[int, dict] = {}
    for record in read_metrics(run_dir):
        by_step.setdefault(record["rollout_step"], record)  # the rollout step's numbers are on each record
    steps = [by_step[k] for k in sorted(by_step)]
    step_s = [r["time/step_s"] for r in steps]
    generation = [r["time/rollout_s"] for r in steps]
    training = [r["time/recompute_s"] + r["time/train_s"] for r in steps]
    return SideResult(
        name=name, step_s=step_s, generation_s=generation, training_s=training,
        other_s=[s - g - t for s, g, t in zip(step_s, generation, training)],
        rewards=[r["reward/mean"] for r in steps], startup_s=first_line - launched - step_s[0], wall_s=wall,
        tokens_per_s=[r["rollout/tokens_per_s"] for r in steps],
        response_length=[r["rollout/response_length_mean"] for r in steps],
        notes=[f"weight sync: median {statistics.median([r['time/sync_s'] for r in steps][1:] or [0]):.3f} s",
               f"checkpoints: {sum(r['time/checkpoint_s'] for r in steps):.1f} s in all",
               f"groups rolled out per step: median {statistics.median(r['rollout/groups_generated'] for r in steps):.0f}"])


def table(results: list[SideResult]) -> str:
    """The markdown table of `results`, then the ratios of per-step time to the first (TRL's) row."""
    first = results[0]
    head = ("| side | step s (median) | generation s | training s | other s | mean step s | start-up s "
            f"| generated tokens/s | response tokens | wall s to {first.window}-step reward {first.target:g} (step) "
            f"| final {first.window}-step reward | mean reward | wall s (all) |")
    rows = [head, "|" + "---|" * 13]
    for r in results:
        hit = r.reached()
        final = r.final_reward()
        rows.append(f"| {r.name} | {r.median(r.step_s):.3f} | {r.median(r.generation_s):.3f} | "
                    f"{r.median(r.training_s):.3f} | {r.median(r.other_s):.3f} | {statistics.mean(r.step_s):.3f} | "
                    f"{r.startup_s:.1f} | {f'{r.median(r.tokens_per_s):.0f}' if r.tokens_per_s else 'n/a'} | "
                    f"{f'{statistics.mean(r.response_length):.1f}' if r.response_length else 'n/a'} | "
                    f"{f'{hit[0]:.0f} ({hit[1]})' if hit else 'not reached'} | "
                    f"{f'{final:.3f}' if final is not None else 'n/a'} | {statistics.mean(r.rewards):.3f} | "
                    f"{r.wall_s:.0f} |")
    base = results[0]
    ratios = [f"{r.name} / {base.name}: {r.median(r.step_s) / base.median(base.step_s):.2f}x" for r in results[1:]]
    notes = [f"- {r.name}: {'; '.join(r.notes)}" for r in results if r.notes]
    ratio = ["", "Per-step time (median) ratio: " + ", ".join(ratios)] if ratios else []
    return "\n".join(rows + ratio + [""] + notes)


def listed(found: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in found.items())


def header(config: TrainConfig, config_path: Path, trl_threads: int, trl_versions: dict, our_versions: dict) -> str:
    """What was run: date, machine, each side and its versions, the matched settings (from `config`)."""
    g, o = config.gspo, config.optimizer
    eps_low, eps_high = clip_range(g.algorithm, g.eps_low, g.eps_high)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return "\n".join([
        f"# Peer benchmark: TRL vs megatron_gspo on {config_path.relative_to(REPO)} ({config.num_steps} rollout "
        "steps per side)", "",
        f"{now}, {os.cpu_count()} CPU cores, load average at the end {load} (1/5/15 min).", "",
        f"- TRL: GRPOTrainer in one process, generation in-process with `generate()`, {trl_threads} torch threads; "
        f"{listed(trl_versions) or 'not run'}.",
        f"- this project (ours): an SGLang server on CPU + Megatron-Core with TP{config.parallel.tp} on "
        f"{config.parallel.world_size} processes, weight sync by {config.rollout.weight_sync} every step, a checkpoint "
        f"every {config.checkpoint.interval} steps; {listed(our_versions)}.",
        f"- Settings: G={g.group_size} x {g.prompts_per_step} prompts, {g.num_minibatches} mini-batches, "
        f"{g.algorithm} band {eps_low:g}/{eps_high:g}, no KL, lr {o.lr:g} {o.schedule}, {config.model.dtype}, "
        f"temperature {config.sampling.temperature:g}, {config.sampling.max_new_tokens} new tokens, "
        f"{config.reward.fn} reward, seed {config.seed}; ours without held-out eval. "
        "`ours`: gspo.dynamic_sampling=false (like for like); `ours_dynamic`: true (the example's default); "
        f"`ours_dp2`: like `ours` with {' '.join(DP2)} (data-parallel trainer instead of TP2); "
        f"`ours_overlap`: like `ours` with {' '.join(OVERLAP)} (one step off-policy, no recompute).",
        "- Seconds per rollout step, median over steps 2..N (columns: benchmarks/peer_trl.py's docstring).", "", ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="rollout steps per side (default 100)")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 steps per side")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "peer_trl", help="work and results directory")
    p.add_argument("--trl-venv", type=Path, help="TRL environment (default OUT/.venv-trl)")
    p.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    p.add_argument("--pip-arg", action="append", default=[], help="extra argument for the TRL pip install")
    p.add_argument("--trl-share-packages", action="store_true", help="a new TRL environment reads the project's "
                   "site-packages too: pip installs only TRL and what else is missing (no second torch)")
    p.add_argument("--task", choices=sorted(TASKS), default="arithmetic",
                   help="arithmetic: examples/tiny_cpu.yaml (4 new tokens); long_addition: examples/tiny_long_cpu.yaml "
                   "(~74-token responses: generation dominates)")
    p.add_argument("--repeats", type=int, default=1, help="run the sides this many times, interleaved "
                   "(trl, ours, trl, ours, ...): both see the same machine load")
    p.add_argument("--reward-target", type=float, default=0.8, help="the 'time to reward' target")
    p.add_argument("--window", type=int, default=10, help="rollout steps averaged for the target and final reward")
    a = p.parse_args()
    steps = 3 if a.quick else a.steps
    config_path = TASKS[a.task]
    sides = [s for s in a.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown or not sides:
        raise SystemExit(f"--sides: unknown {sorted(unknown)}; choose from {','.join(SIDES)}")
    out = a.out.resolve()
    work = out if a.task == "arithmetic" else out / a.task
    hf_dir = out / "hf" if a.task == "arithmetic" else work / "hf"
    def overrides_for(side: str, run_dir: Path) -> list[str]:
        return our_overrides(hf_dir, run_dir, steps, dynamic_sampling=side == "ours_dynamic", extra=EXTRA.get(side, ()))

    rows = {side: overrides_for(side, work / side) for side in SIDES if side != "trl"}
    configs = {side: load_config(config_path, overrides) for side, overrides in rows.items()}  # bad overrides fail now
    config = configs["ours"]  # the like-for-like settings, TRL's too
    tiny_model(hf_dir, a.task)
    results, trl_versions, python = [], {}, None
    if "trl" in sides:
        python = trl_env(a.trl_venv or out / ".venv-trl", a.pip_arg, share_packages=a.trl_share_packages)
        trl_versions = versions(python, TRL_PINS)
    for repeat in range(1, a.repeats + 1):
        for side in [s for s in SIDES if s in sides]:
            name = side if a.repeats == 1 else f"{side} #{repeat}"
            print(f"{name}: {steps} steps ...", flush=True)
            suffix = "" if a.repeats == 1 else f"_{repeat}"
            if side == "trl":
                results.append(run_trl(python, config, hf_dir, work / f"trl{suffix}", a.trl_threads, name=name))
            else:
                run_dir = work / f"{side}{suffix}"  # its own run and checkpoint directory: a repeat must not resume
                results.append(run_ours(name, config_path, overrides_for(side, run_dir), run_dir))
            results[-1].target, results[-1].window = a.reward_target, a.window
            results[-1].notes.append(f"1-min load average at its end {os.getloadavg()[0]:.1f}")
    our_versions = versions(Path(sys.executable), ("torch", "megatron-core", "transformers"))
    our_versions.update(versions(Path(default_sglang_python()), ("sglang",)))
    text = header(config, config_path, a.trl_threads, trl_versions, our_versions) + table(results) + "\n"
    print(text)
    work.mkdir(parents=True, exist_ok=True)
    (work / "results.md").write_text(text)
    print(f"written: {work / 'results.md'}")


if __name__ == "__main__":
    main()
