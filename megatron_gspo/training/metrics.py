"""Per-step metrics: RUN_DIR/metrics.jsonl (always), TensorBoard and W&B (when installed and asked),
and a PNG of reward, clipped fraction and response length over steps (when matplotlib is installed).

metrics.jsonl holds one JSON object per optimizer step: {"step": 12, "rollout_step": 3,
"reward/mean": 0.41, "loss/clipped_fraction_seq": 0.02, ...}. Non-finite numbers are written as null
(JSON has no NaN). Only rank 0 should create a MetricsLogger.

Metric names are namespaced where they are computed: reward/ (the verifier's rewards), rollout/ (what was
generated), loss/ (the policy loss and its ratios), train/ (optimizer, gradients, the policy's entropy,
train-vs-rollout log-prob gap), moe/ (routing), correction/ (train-inference mismatch), time/ (seconds),
data/, eval/ and profile/. A record with a name outside these is refused (`NAMESPACES`). Runs logged before
the namespaces are read under today's names (`read_metrics`, with `LEGACY_NAMES`).
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"

NAMESPACES = ("reward/", "rollout/", "loss/", "train/", "moe/", "correction/", "time/", "data/", "eval/", "profile/")
"""The prefixes every logged metric name has (besides step and rollout_step)."""

LEGACY_NAMES: dict[str, str] = {
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "reward_mean_trained": "reward/mean_trained",
    "zero_signal_group_fraction": "reward/zero_signal_group_fraction",
    "zero_signal_group_fraction_trained": "reward/zero_signal_group_fraction_trained",
    "reward_timeouts": "reward/timeouts",
    "reward_errors": "reward/errors",
    "response_truncated_fraction": "rollout/response_truncated_fraction",
    "data_epoch": "data/epoch",
    "rollout_groups_generated": "rollout/groups_generated",
    "dynamic_sampling_dropped_groups": "rollout/dynamic_sampling_dropped_groups",
    "dynamic_sampling_padded_groups": "rollout/dynamic_sampling_padded_groups",
    "response_length_mean": "rollout/response_length_mean",
    "response_length_max": "rollout/response_length_max",
    "rollout_weight_version": "rollout/weight_version",
    "rollout_tokens_per_s": "rollout/tokens_per_s",
    "rollout_staleness_mean": "rollout/staleness_mean",
    "rollout_staleness_max": "rollout/staleness_max",
    "rollout_partial_fraction": "rollout/partial_fraction",
    "rollout_stale_prefix_fraction": "rollout/stale_prefix_fraction",
    "loss": "loss/value",
    "clipped_fraction_seq": "loss/clipped_fraction_seq",
    "clipped_fraction_token": "loss/clipped_fraction_token",
    "clipped_fraction_seq_minibatch1": "loss/clipped_fraction_seq_minibatch1",
    "clipped_fraction_token_minibatch1": "loss/clipped_fraction_token_minibatch1",
    "ratio_mean": "loss/ratio_mean",
    "ratio_min": "loss/ratio_min",
    "ratio_max": "loss/ratio_max",
    "abs_log_ratio_per_token": "loss/abs_log_ratio_per_token",
    "abs_log_ratio_per_seq": "loss/abs_log_ratio_per_seq",
    "log_ratio_token_std": "loss/log_ratio_token_std",
    "log_ratio_seq_std": "loss/log_ratio_seq_std",
    "sequences_empty": "loss/sequences_empty",
    "sequences_nonfinite": "loss/sequences_nonfinite",
    "sequences": "train/sequences",
    "response_tokens": "train/response_tokens",
    "entropy": "train/entropy",
    "train_rollout_abs_delta_token": "train/rollout_abs_delta_token",
    "train_rollout_abs_delta_seq": "train/rollout_abs_delta_seq",
    "rollout_nonfinite_tokens": "train/rollout_nonfinite_tokens",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "update_successful": "train/update_successful",
    "microbatches": "train/microbatches",
    "padding_fraction": "train/padding_fraction",
    "train_tokens_per_s": "train/tokens_per_s",
    "moe_routing_changed_fraction": "moe/routing_changed_fraction",
    "moe_routing_rollout_changed_fraction": "moe/routing_rollout_changed_fraction",
    "time_rollout_s": "time/rollout_s",
    "time_recompute_s": "time/recompute_s",
    "time_train_s": "time/train_s",
    "time_sync_s": "time/sync_s",
    "time_checkpoint_s": "time/checkpoint_s",
    "time_step_s": "time/step_s",
    "time_reward_wait_s": "time/reward_wait_s",
    "time_eval_s": "time/eval_s",
    "time_rollout_generate_s": "time/rollout_generate_s",
    "time_sync_wait_s": "time/sync_wait_s",
    "time_sampler_idle_s": "time/sampler_idle_s",
    "train_time_s": "time/minibatch_train_s",
    "recompute_time_s": "time/minibatch_recompute_s",
}
"""Names of runs logged before the namespaces -> today's (read_metrics renames those records); per-layer
routing metrics were moe_routing_changed_fraction_layer_NN (LEGACY_PREFIXES)."""

LEGACY_PREFIXES = {"moe_routing_changed_fraction_layer_": "moe/routing_changed_fraction/layer_"}


PLOTTED = (("reward/mean", "mean reward"), ("loss/clipped_fraction_seq", "clipped fraction (sequences)"),
           ("rollout/response_length_mean", "mean response length (tokens)"))


def _clean(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else None
    return value


class MetricsLogger:
    """Writes one record per optimizer step to metrics.jsonl and the optional back-ends."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = False, wandb_project: str | None = None,
                 wandb_offline: bool = False, config: dict | None = None, resume_after: int | None = None):
        """`resume_after`: the last optimizer step of the checkpoint being resumed; records of later
        steps (written before a crash, about to be redone) are dropped from metrics.jsonl."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_after is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [r for r in read_metrics(self.run_dir) if r["step"] <= resume_after]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a")
        self._tb = self._open_tensorboard() if tensorboard else None
        self._wandb = self._open_wandb(wandb_project, wandb_offline, config) if wandb_project else None

    def _open_tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            warnings.warn("tensorboard is not installed: no TensorBoard events (pip install tensorboard)")
            return None
        return SummaryWriter(str(self.run_dir / "tensorboard"))

    def _open_wandb(self, project: str, offline: bool, config: dict | None):
        try:
            import wandb
        except ImportError:
            warnings.warn("wandb is not installed: no Weights & Biases logging (pip install wandb)")
            return None
        return wandb.init(project=project, dir=str(self.run_dir), config=config,
                          mode="offline" if offline else "online", resume="allow")

    def log(self, step: int, metrics: dict) -> None:
        unnamed = [k for k in metrics if k != "rollout_step" and not k.startswith(NAMESPACES)]
        if unnamed:
            raise KeyError(f"metric names outside the namespaces {', '.join(NAMESPACES)}: {unnamed}")
        record = {"step": int(step), **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The records of RUN_DIR/metrics.jsonl (a torn last line, from a crash mid-write, is skipped).
    Records of runs logged before the namespaces come back under the logged names of today."""
    records = []
    with open(Path(run_dir) / METRICS_FILE) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            records.append({_current_name(k): v for k, v in record.items()})
    return records


def _current_name(name: str) -> str:
    if name in LEGACY_NAMES:
        return LEGACY_NAMES[name]
    for prefix, current in LEGACY_PREFIXES.items():
        if name.startswith(prefix):
            return current + name[len(prefix):]
    return name


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """RUN_DIR/metrics.png: reward, clipped fraction and response length over steps, the held-out eval scores
    (eval/NAME/mean@k) when the run evaluated, and tool calls and turns per episode when it ran episodes.

    Returns the PNG's path, or None (with a warning) when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no plot (pip install matplotlib); "
                      f"the numbers are in {Path(run_dir) / METRICS_FILE}")
        return None
    records = read_metrics(run_dir)
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and "/mean@" in k})
    panels = [*PLOTTED, *(((tuple(eval_keys), "held-out eval (mean@k)"),) if eval_keys else ())]
    if any("rollout/turns_mean" in r for r in records):
        panels.append((("rollout/tool_calls_mean", "rollout/turns_mean"), "per episode"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True)
    for ax, (keys, label) in zip(axes, panels):
        for key in (keys,) if isinstance(keys, str) else keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker=".", linewidth=1, label=None if isinstance(keys, str) else key)
        if not isinstance(keys, str):
            ax.legend(fontsize=7)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / PLOT_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
