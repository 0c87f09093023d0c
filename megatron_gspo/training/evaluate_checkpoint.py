"""`megatron-gspo eval CONFIG --checkpoint DIR`: the config's eval datasets on one checkpoint, no training.

    megatron-gspo eval examples/tiny_cpu.yaml --checkpoint runs/tiny_cpu/checkpoints   # Megatron checkpoint
    megatron-gspo eval examples/tiny_cpu.yaml --checkpoint runs/tiny_cpu/hf            # or an HF directory

DIR is a Hugging Face model directory (config.json) or a Megatron distributed checkpoint (its root, with
latest_checkpointed_iteration.txt, or one iter_* directory); the latter is converted with the project's
converter into a temporary HF directory (model.hf_path gives its config and tokenizer). The responses come
from SGLang servers launched on it (the SGLang backend's settings; rollout.server_urls are not used: they
serve other weights), are scored by the run's reward pool and reported as in training (evaluation.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from pathlib import Path

from megatron_gspo.config import TrainConfig
from megatron_gspo.convert.mcore_to_hf import convert_mcore_to_hf
from megatron_gspo.evaluation import eval_sampling, evaluate
from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rollout.backend import SGLangBackend
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.training.preflight import check_reward, open_datasets


def evaluate_checkpoint(config: TrainConfig, checkpoint: str | Path) -> dict[str, float]:
    """eval/NAME/mean@k, pass@k, ... of every eval dataset of `config` on the weights in `checkpoint`."""
    if not config.eval.datasets:
        raise ValueError("eval.datasets is empty: nothing to evaluate (e.g. eval.datasets.held_out=test.jsonl)")
    check_reward(config.reward)
    checkpoint = Path(checkpoint)
    with tempfile.TemporaryDirectory(prefix="megatron_gspo_eval_") as tmp:
        if (checkpoint / "config.json").is_file():
            hf_dir = checkpoint
        elif (checkpoint / "latest_checkpointed_iteration.txt").is_file() or (checkpoint / "metadata.json").is_file():
            if config.model.hf_path is None:
                raise ValueError("model.hf_path is required to evaluate a Megatron checkpoint (its config and tokenizer)")
            hf_dir = Path(tmp) / "hf"
            convert_mcore_to_hf(checkpoint, config.model.hf_path, hf_dir, progress=False)
        else:
            raise ValueError(f"--checkpoint {str(checkpoint)!r}: neither a Hugging Face model directory (config.json) "
                             "nor a Megatron distributed checkpoint (latest_checkpointed_iteration.txt / metadata.json)")
        config = dataclasses.replace(
            config, model=dataclasses.replace(config.model, hf_path=str(hf_dir)),
            rollout=dataclasses.replace(config.rollout, backend="sglang", server_urls=(), weight_sync="disk"),
            logging=dataclasses.replace(config.logging, run_dir=tmp))
        prepared = open_datasets(config)
        r = config.reward
        with RewardPool(r.fn, workers=r.workers, timeout_s=r.timeout_s) as pool:
            backend = SGLangBackend(config, tokenizer=prepared.tokenizer)
            try:
                return asyncio.run(evaluate(backend.generate, prepared.eval_sets, Scorer(pool, r), eval_sampling(config),
                                            config.eval.samples_per_prompt))
            finally:
                backend.close()
