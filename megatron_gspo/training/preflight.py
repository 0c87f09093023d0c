"""Checks that need the file system or the package's registries, run before any work starts
(config.py checks values only and knows nothing of the package)."""
from __future__ import annotations

import os
from pathlib import Path

from megatron_gspo.config import TrainConfig
from megatron_gspo.model.presets import PRESETS
from megatron_gspo.rollout.megatron_backend import check_sampling
from megatron_gspo.tasks import TASKS


def _writable(path: str, name: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".write_test.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{name}: cannot write to {path!r} ({e.strerror or e})") from None


def preflight(config: TrainConfig) -> None:
    """Raise ValueError naming the setting when a path the run needs is missing or not writable, or a
    named preset or task does not exist."""
    model = config.model
    if model.preset is not None and model.preset not in PRESETS:
        raise ValueError(f"model.preset must be one of {sorted(PRESETS)}, got {model.preset!r}")
    if config.rollout.task not in TASKS:
        raise ValueError(f"rollout.task must be one of {sorted(TASKS)}, got {config.rollout.task!r}")
    if config.rollout.backend == "megatron":
        check_sampling(config.sampling)
    if model.hf_path is None:
        raise ValueError("model.hf_path is required to train: the task's prompts need its tokenizer "
                         f"(model.preset={model.preset!r} gives a model shape only)")
    if not (Path(model.hf_path) / "config.json").is_file():
        raise ValueError(f"model.hf_path: no Hugging Face model at {model.hf_path!r} (config.json not found)")
    if model.init_checkpoint is not None and not (Path(model.init_checkpoint) / "metadata.json").is_file():
        raise ValueError(f"model.init_checkpoint: no Megatron distributed checkpoint at "
                         f"{model.init_checkpoint!r} (metadata.json not found)")
    if config.checkpoint.dir is not None:
        _writable(config.checkpoint.dir, "checkpoint.dir")
    _writable(config.logging.run_dir, "logging.run_dir")
    if config.checkpoint.export_hf is not None:
        _writable(str(Path(config.checkpoint.export_hf).resolve().parent), "checkpoint.export_hf")
