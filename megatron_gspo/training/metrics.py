"""Per-step metrics: RUN_DIR/metrics.jsonl (always), TensorBoard and W&B (when installed and asked),
and a PNG of reward, clipped fraction and response length over steps (when matplotlib is installed).

metrics.jsonl holds one JSON object per optimizer step: {"step": 12, "rollout_step": 3,
"reward_mean": 0.41, "clipped_fraction_seq": 0.02, ...}. Non-finite numbers are written as null
(JSON has no NaN). Only rank 0 should create a MetricsLogger.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Sequence

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
PLOTTED = (("reward_mean", "mean reward"), ("clipped_fraction_seq", "clipped fraction (sequences)"),
           ("response_length_mean", "mean response length (tokens)"))


def response_length_metrics(response_lengths: Sequence[int]) -> dict[str, float]:
    """The trained batch's response lengths (GSPO.md's list). The reward statistics come from
    `ScoredBatch.metrics()`, which sees every generated sample, not only the groups that train."""
    return {"response_length_mean": sum(response_lengths) / len(response_lengths),
            "response_length_max": float(max(response_lengths))}


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
    """The records of RUN_DIR/metrics.jsonl (a torn last line, from a crash mid-write, is skipped)."""
    records = []
    with open(Path(run_dir) / METRICS_FILE) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """RUN_DIR/metrics.png: reward, clipped fraction and response length over steps.

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
    fig, axes = plt.subplots(len(PLOTTED), 1, figsize=(7, 2.4 * len(PLOTTED)), sharex=True)
    for ax, (key, label) in zip(axes, PLOTTED):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker=".", linewidth=1)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    out = Path(out) if out is not None else Path(run_dir) / PLOT_FILE
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
