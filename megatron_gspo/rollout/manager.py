"""The rollout side of one GSPO step, as every trainer rank sees it.

    rollout = Rollout(backend, task, gspo, stop)     # backend: on every rank, or on rank 0 only (SGLang)
    batch = rollout.generate(position)               # collective: the same ScoredBatch on every rank
    synced = rollout.sync_weights(export, "7")       # collective: False if a stop signal interrupted it

`generate` takes prompts from the task's stream at `position`, has the backend sample G responses per
prompt, scores them with the task's verifier and (gspo.dynamic_sampling) rolls out more prompts until
the batch holds gspo.prompts_per_step groups with signal (rollout/batch_filling.py). Rank 0's batch then
reaches every rank.

Preemption lives here because this is where it is met: Slurm signals the rollout servers together with
the trainer, so a request or a weight push can fail *because* the run is being stopped. After a stop
request such a failure is an interruption: `generate` returns None and `sync_weights` False, and the
driver stops with a checkpoint. Before one, it is an error and raises. A collective backend (the
trainer's own model) has no servers to lose, so its failures always raise.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch.distributed as dist

from megatron_gspo.config import GSPOConfig
from megatron_gspo.rollout.backends import RolloutBackend
from megatron_gspo.rollout.batch_filling import ScoredBatch, collect_scored_groups
from megatron_gspo.sync.sglang import NamedTensors


class StopSignal(Protocol):
    signal_name: str | None
    """The stop signal received (e.g. "SIGTERM"), or None."""


class Task(Protocol):
    def prompts(self, start: int) -> Iterable: ...

    def reward(self, sample) -> float: ...


@dataclass
class RolloutBatch:
    """One rollout step's scored groups and what the step rolled out to find them."""

    scored: ScoredBatch
    """prompts_per_step groups of G scored samples (rollout/batch_filling.py)."""
    next_position: int
    """The prompt stream's position after this batch (saved in checkpoints: resume continues there)."""

    def metrics(self) -> dict[str, float]:
        return self.scored.metrics()


class Rollout:
    """Prompts -> G samples each -> rewards, for every trainer rank; weight sync to the sampler."""

    def __init__(self, backend: RolloutBackend | None, task: Task, gspo: GSPOConfig, stop: StopSignal):
        self.backend = backend
        """This rank's backend, or None on ranks that only train (SGLang: every rank but 0)."""
        self.task, self.gspo, self.stop = task, gspo, stop

    def generate(self, position: int) -> RolloutBatch | None:
        """Collective: the batch from prompt-stream position `position` on every rank, or None on every
        rank when a stop signal interrupted the rollout."""
        batch = None
        if self.backend is not None:
            try:
                batch = self._collect(position)
            except Exception as error:
                if self.stop.signal_name is None or self.backend.collective:
                    raise
                print(f"rollout failed after {self.stop.signal_name} ({type(error).__name__}: {error})", flush=True)
        box = [batch]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _collect(self, position: int) -> RolloutBatch:
        taken = 0

        def counted():
            nonlocal taken
            for prompt in self.task.prompts(position):
                taken += 1
                yield prompt
        scored = asyncio.run(collect_scored_groups(self.backend.generate, counted(), self.gspo.prompts_per_step,
                                                   self.task.reward, drop_zero_variance=self.gspo.dynamic_sampling))
        return RolloutBatch(scored, position + taken)

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
