"""The rollout side of one GSPO step, as every trainer rank sees it.

    rollout = Rollout(backend, dataset, scorer, config, stop, eval_sets)  # backend: every rank, or rank 0 (SGLang)
    batch = rollout.generate(position)       # collective: a RolloutBatch on every rank, or an Ended
    results = rollout.evaluate()             # collective: eval/NAME/mean@k, pass@k, ... (evaluation.py)
    synced = rollout.sync_weights(export, "7")   # collective: False if a stop signal interrupted it

`generate` takes prompts from the dataset's stream at `position` (data/dataset.py), has the backend
sample G responses per prompt, scores each group as it finishes in the reward pool (rollout/scoring.py)
and (gspo.dynamic_sampling) rolls out more prompts until the batch holds gspo.prompts_per_step groups
with signal (rollout/batch_filling.py). Rank 0's batch then reaches every rank. When the dataset's
`data.epochs` run out before a batch is full, `generate` returns `Ended("data")` (the partial batch is
not trained) and the driver ends the run with a checkpoint.

Preemption lives here because this is where it is met: Slurm signals the rollout servers together with
the trainer, so a request or a weight push can fail *because* the run is being stopped. After a stop
request such a failure is an interruption: `generate` returns `Ended("signal")` and `sync_weights` False, and the
driver stops with a checkpoint. Before one, it is an error and raises. A collective backend (the
trainer's own model) has no servers to lose, so its failures always raise.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Protocol, Sequence

import torch.distributed as dist

from megatron_gspo.config import TrainConfig
from megatron_gspo.data import PromptDataset
from megatron_gspo.evaluation import eval_sampling, evaluate
from megatron_gspo.rollout.backends import RolloutBackend
from megatron_gspo.rollout.batch_filling import PromptsExhausted, ScoredBatch, collect_scored_groups
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.samples import Prompt
from megatron_gspo.sync.sglang import NamedTensors


class StopSignal(Protocol):
    signal_name: str | None
    """The stop signal received (e.g. "SIGTERM"), or None."""


@dataclass(frozen=True)
class Ended:
    """No batch: the run ends here. "signal": a stop signal interrupted the rollout; "data": the
    prompts of data.epochs ran out."""

    reason: Literal["signal", "data"]


@dataclass
class RolloutBatch:
    """One rollout step's scored groups and what the step rolled out to find them."""

    scored: ScoredBatch
    """prompts_per_step groups of G scored samples (rollout/batch_filling.py)."""
    next_position: int
    """The prompt stream's position after this batch (saved in checkpoints: resume continues there)."""
    epoch: int = 0
    """The data epoch of the batch's last prompt (0-based)."""

    def metrics(self) -> dict[str, float]:
        return {**self.scored.metrics(), "data_epoch": float(self.epoch)}


class Rollout:
    """Prompts -> G samples each -> rewards, for every trainer rank; weight sync to the sampler."""

    def __init__(self, backend: RolloutBackend | None, dataset: PromptDataset, scorer: Scorer | None,
                 config: TrainConfig, stop: StopSignal, eval_sets: Mapping[str, Sequence[Prompt]] | None = None):
        self.backend = backend
        """This rank's backend, or None on ranks that only train (SGLang: every rank but 0)."""
        self.scorer = scorer
        """This rank's scorer (with the reward pool on rank 0), or None where there is no backend."""
        self.dataset, self.gspo, self.stop = dataset, config.gspo, stop
        self.eval_sets = dict(eval_sets or {})
        self.eval_k, self.eval_sampling = config.eval.samples_per_prompt, eval_sampling(config)

    def generate(self, position: int) -> RolloutBatch | Ended:
        """Collective: the batch from prompt-stream position `position` on every rank, or the same
        `Ended` on every rank (see the module doc)."""
        result: RolloutBatch | Ended | None = None
        if self.backend is not None:
            try:
                result = self._collect(position)
            except PromptsExhausted as exhausted:
                print(f"data: {exhausted}; ending the run", flush=True)
                result = Ended("data")
            except Exception as error:
                if self.stop.signal_name is None or self.backend.collective:
                    raise
                print(f"rollout failed after {self.stop.signal_name} ({type(error).__name__}: {error})", flush=True)
                result = Ended("signal")
        box = [result]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _collect(self, position: int) -> RolloutBatch:
        taken = 0

        def counted():
            nonlocal taken
            for prompt in self.dataset.prompts(position):
                taken += 1
                yield prompt
        scored = asyncio.run(collect_scored_groups(self.backend.generate, counted(), self.gspo.prompts_per_step,
                                                   self.scorer, drop_zero_variance=self.gspo.dynamic_sampling))
        return RolloutBatch(scored, position + taken, self.dataset.epoch_of(position + taken - 1))

    def evaluate(self) -> dict[str, float]:
        """Collective: every eval dataset's metrics (evaluation.py) on every rank; {} without eval sets."""
        results = None
        if self.backend is not None and self.eval_sets:
            results = asyncio.run(evaluate(self.backend.generate, self.eval_sets, self.scorer, self.eval_sampling,
                                           self.eval_k))
        box = [results]
        dist.broadcast_object_list(box, src=0)
        return box[0] or {}

    @property
    def needs_weights(self) -> bool:
        """Whether a sync needs the exported tensors (the trainer's own model needs none)."""
        return self.backend is None or not self.backend.collective

    def sync_weights(self, export: Callable[[], NamedTensors], version: str) -> bool:
        """Collective: the policy's new weights become the sampler's, as `version`.

        `export()` is the collective walk over the model under HF names (convert/export.py; only rank 0
        receives full tensors): every rank walks it to the end, whether or not rank 0's push succeeded.
        Returns False when the push failed after a stop signal (the servers got it too): a resumed run
        pushes the weights of its checkpoint first."""
        tensors = iter(export()) if self.needs_weights else iter(())
        synced = True
        try:
            if self.backend is not None:
                self.backend.sync_weights(tensors, version)
        except Exception as error:
            if self.stop.signal_name is None:
                raise
            print(f"weight sync failed after {self.stop.signal_name} ({type(error).__name__}: {error}); "
                  "the weights go to the servers when the run resumes", flush=True)
            synced = False
        for _ in tensors:  # the rest of the walk (all of it on ranks without a backend)
            pass
        return synced

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
