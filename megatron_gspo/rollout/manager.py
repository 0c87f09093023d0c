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

Overlap (rollout.max_staleness = N > 0; SGLang backend, rank 0): after `generate` hands out batch t,
`prefetch(batch_t)` has the servers generate batches t+1 .. t+N in a background thread while the
trainer trains on batch t. A weight push waits for the batch being generated to finish and holds
the next one back until the servers have the new weights (`sync_weights`), so every batch is sampled
by one weight version, at most N versions older than the policy that trains on it; each sample carries
it (`weight_version`) and `staleness_metrics` reports the gap. With rollout.partial_rollout a push
waits for nothing: the servers hold the requests in flight while they load the new weights and continue
them under those (rollout/sglang/weight_sync.py:generation_paused); a response cut by a push trains only on the tokens
after its `stale_prefix` (samples.py), which the newer weights generated, so a batch mixes versions but
every trained token is at most N versions old. Evaluation holds the background thread back either way
(until the batch being generated finishes). `ahead()` gives the batches already generated (a checkpoint saves them) and
`preload` puts them back on resume, so a resumed run trains on exactly the batches the interrupted
one had sampled. With N = 0 nothing runs in the background: generate, then train.

Preemption lives here because this is where it is met: Slurm signals the rollout servers together with
the trainer, so a request or a weight push can fail *because* the run is being stopped. After a stop
request such a failure is an interruption: `generate` returns `Ended("signal")`, `sync_weights` False and
`evaluate` no results, and the driver stops with a checkpoint. Before one, it is an error, and every rank
raises it: rank 0's failure (the servers are rank 0's, and so is the reward pool) travels to the other
ranks as a `Failed` in the broadcast they wait in, and each rank raises `RolloutFailed` with rank 0's
message, so they can still finish together what they share (the driver publishes the background
checkpoint all of them have written). A collective backend (the trainer's own model) has no servers to
lose: its failures raise where they happen, except the scoring's, which is rank 0's (rollout/scoring.py).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Protocol, Sequence

import torch.distributed as dist

from megatron_gspo import profiling
from megatron_gspo.config import TrainConfig
from megatron_gspo.data import PromptDataset
from megatron_gspo.evaluation import eval_sampling, evaluate
from megatron_gspo.rollout.batch_filling import PromptsExhausted, ScoredBatch, collect_scored_groups
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.samples import Prompt
from megatron_gspo.rollout.protocol import Failed, NamedTensors, RolloutBackend, RolloutFailed, failed_on_rank0


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
    position: int = 0
    """The prompt stream's position where this batch started."""
    generate_s: float = 0.0
    """Wall time its generation and scoring took (in the background when prefetched)."""
    started_at: float = 0.0
    ended_at: float = 0.0
    """time.monotonic() on rank 0 when its generation started and ended."""

    def metrics(self) -> dict[str, float]:
        return {**self.scored.metrics(), "data/epoch": float(self.epoch)}


def staleness_metrics(batch: RolloutBatch, policy_version: int) -> dict[str, float]:
    """How many weight versions older than the training policy (`policy_version`: optimizer rollout steps
    taken) the samples' weights were: rollout_staleness_mean / _max (0 in a synchronous run)."""
    versions = [s.weight_version for g in batch.scored.groups for s in g]
    gaps = [policy_version - int(v) for v in versions if v is not None and str(v).lstrip("-").isdigit()]
    if not gaps:
        return {}
    return {"rollout/staleness_mean": sum(gaps) / len(gaps), "rollout/staleness_max": float(max(gaps))}


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
        overlapping = backend is not None and not backend.collective
        self.max_staleness = config.rollout.max_staleness if overlapping else 0
        """Batches generated ahead (rank 0 of an SGLang run); 0 elsewhere."""
        self.partial = bool(self.max_staleness) and config.rollout.partial_rollout
        """A push goes into the batch being generated (the backend pauses and continues it)."""
        self._ahead: collections.deque[Future] = collections.deque()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") if self.max_staleness else None
        self._turn = threading.Condition()
        self._generating = False   # the background thread is generating a batch
        self._held = 0             # pushes / evals waiting: the next background batch must not start
        self.sync_wait_s = 0.0
        """Seconds the last `sync_weights` waited for the background thread's batch to finish."""
        self._loops = _EventLoops(backend)

    def generate(self, position: int) -> RolloutBatch | Ended:
        """Collective: the batch from prompt-stream position `position` on every rank, or the same
        `Ended` on every rank; RolloutFailed on every rank when rank 0's rollout failed (see the module doc)."""
        result: RolloutBatch | Ended | Failed | None = None
        if self.backend is not None:
            if self._ahead:
                result = self._ahead.popleft().result()
                if isinstance(result, RolloutBatch) and result.position != position:
                    raise RuntimeError(f"the batch generated ahead starts at prompt {result.position}, "
                                       f"the trainer asks for {position}")
            else:
                result = self._attempt(position)
        with profiling.span("rollout/broadcast_batch"):
            return _from_rank0(result)

    def _attempt(self, position: int) -> RolloutBatch | Ended | Failed:
        try:
            return self._collect(position)
        except PromptsExhausted as exhausted:
            print(f"data: {exhausted}; ending the run", flush=True)
            return Ended("data")
        except Exception as error:
            if self.backend.collective:
                raise
            if self.stop.signal_name is None:
                return failed_on_rank0("rollout", error)
            print(f"rollout failed after {self.stop.signal_name} ({type(error).__name__}: {error})", flush=True)
            return Ended("signal")

    # ---- generating ahead (rollout.max_staleness > 0) ------------------------------------------------

    def prefetch(self, batch: RolloutBatch, remaining: int) -> None:
        """Start generating the batches after `batch` in the background, up to max_staleness of them and
        no more than the `remaining` steps of the run will train on. No-op without overlap."""
        if not self.max_staleness:
            return
        while len(self._ahead) < min(self.max_staleness, remaining):
            previous = self._ahead[-1] if self._ahead else None
            self._ahead.append(self._executor.submit(self._generate_after, previous, batch))

    def _generate_after(self, previous: Future | None, batch: RolloutBatch) -> RolloutBatch | Ended | Failed:
        """The background thread's job: the batch that follows `previous`'s result (or `batch`)."""
        before = previous.result() if previous is not None else batch
        if isinstance(before, (Ended, Failed)):
            return before
        with self._turn:
            while self._held:
                self._turn.wait()
            self._generating = True
        try:
            return self._attempt(before.next_position)
        finally:
            with self._turn:
                self._generating = False
                self._turn.notify_all()

    @contextlib.contextmanager
    def _servers_to_ourselves(self):
        """Wait for the background batch being generated (if any) and start no other until the block ends."""
        with self._turn:
            self._held += 1
            while self._generating:
                self._turn.wait()
        try:
            yield
        finally:
            with self._turn:
                self._held -= 1
                self._turn.notify_all()

    def ahead(self) -> list[RolloutBatch]:
        """The batches generated ahead and finished, in order (waits for the one being generated): what a
        checkpoint keeps. Rank 0's; [] elsewhere or without overlap."""
        done = []
        with self._servers_to_ourselves():
            for future in self._ahead:
                if not future.done() or not isinstance(future.result(), RolloutBatch):
                    break
                done.append(future.result())
        return done

    def preload(self, batches: Sequence[RolloutBatch]) -> None:
        """Batches a checkpoint kept (`ahead()`): `generate` hands them out first, in order."""
        if not self.max_staleness:
            return
        for batch in batches:
            future: Future = Future()
            future.set_result(batch)
            self._ahead.append(future)

    def _collect(self, position: int) -> RolloutBatch:
        taken = 0

        def counted():
            nonlocal taken
            for prompt in self.dataset.prompts(position):
                taken += 1
                yield prompt
        started, start = time.monotonic(), time.perf_counter()
        with profiling.span("rollout/generate_and_score"):
            scored = self._loops.run(collect_scored_groups(self.backend.generate, counted(), self.gspo.prompts_per_step,
                                                       self.scorer, drop_zero_variance=self.gspo.dynamic_sampling))
        return RolloutBatch(scored, position + taken, self.dataset.epoch_of(position + taken - 1), position=position,
                            generate_s=time.perf_counter() - start, started_at=started, ended_at=time.monotonic())

    def evaluate(self) -> dict[str, float]:
        """Collective: every eval dataset's metrics (evaluation.py) on every rank; {} without eval sets or
        when a stop signal interrupted it; RolloutFailed on every rank when rank 0's failed."""
        results: dict | Failed | None = None
        if self.backend is not None and self.eval_sets:
            try:
                with self._servers_to_ourselves():  # the scorer and the servers' weights are the eval's alone
                    results = self._loops.run(evaluate(self.backend.generate, self.eval_sets, self.scorer,
                                                       self.eval_sampling, self.eval_k))
            except Exception as error:
                if self.backend.collective:
                    raise
                if self.stop.signal_name is None:
                    results = failed_on_rank0("evaluation", error)
                else:
                    print(f"evaluation failed after {self.stop.signal_name} ({type(error).__name__}: {error})",
                          flush=True)
        return _from_rank0(results) or {}

    @property
    def needs_weights(self) -> bool:
        """Whether a sync needs the exported tensors: the sampler is rank 0's servers (the trainer's own
        model needs none)."""
        return self.backend is None or not self.backend.collective

    def sync_weights(self, export: Callable[[], NamedTensors], version: str) -> bool:
        """Collective: the policy's new weights become the sampler's, as `version`.

        `export()` is the collective walk over the model under HF names (convert/export.py; only rank 0
        receives full tensors): every rank walks it to the end, whether or not rank 0's push succeeded,
        and then learns how it went. Returns False when the push failed after a stop signal (the servers
        got it too): a resumed run pushes the weights of its checkpoint first. Before one, RolloutFailed
        on every rank."""
        tensors = _Walk(_timed_export(export()) if self.needs_weights else ())
        synced: bool | Failed = True
        try:
            if self.backend is not None:
                start = time.perf_counter()
                # between two batches, each sampled by one version; partial rollouts: into the one in flight
                with contextlib.nullcontext() if self.partial else self._servers_to_ourselves():
                    self.sync_wait_s = time.perf_counter() - start
                    self.backend.sync_weights(tensors, version)
        except Exception as error:
            if tensors.failed or (self.stop.signal_name is None and self.backend.collective):
                raise  # this rank's own: a collective of the walk failed, or (the trained model samples) its push
            if self.stop.signal_name is None:
                synced = failed_on_rank0("weight push", error)
            else:
                print(f"weight sync failed after {self.stop.signal_name} ({type(error).__name__}: {error}); "
                      "the weights go to the servers when the run resumes", flush=True)
                synced = False
        for _ in tensors:  # the rest of the walk (all of it on ranks without a backend)
            pass
        return _from_rank0(synced) if self.needs_weights else synced

    def close(self) -> None:
        if self._executor is not None:  # a batch being generated ends with the servers (or first)
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.backend is not None:
            self.backend.close()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._loops.close()


class _EventLoops:
    """One event loop per thread that rolls out (the trainer's; the background one with overlap), kept for
    the run, in which the backend keeps its connections open (`keep_connections`): a fresh loop per call
    reconnected to the servers every step (the demo: the rollout call 0.103 -> 0.096 s with them kept)."""

    def __init__(self, backend: RolloutBackend | None):
        self._backend = backend
        self._local = threading.local()
        self._runners: list[asyncio.Runner] = []
        self._lock = threading.Lock()

    def run(self, coro):
        runner = getattr(self._local, "runner", None)
        if runner is None:
            runner = self._local.runner = asyncio.Runner()
            with self._lock:
                self._runners.append(runner)
            if self._backend is not None:
                runner.run(self._backend.keep_connections())
        return runner.run(coro)

    def close(self) -> None:
        """After the threads that used them are done: close the connections, then the loops."""
        with self._lock:
            runners, self._runners = self._runners, []
        for runner in runners:
            try:
                if self._backend is not None:
                    runner.run(self._backend.close_connections())
            finally:
                runner.close()


def _from_rank0(result):
    """Collective: rank 0's `result` on every rank, or, when it is a `Failed`, RolloutFailed raised on every rank."""
    box = [result]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Failed):
        raise RolloutFailed(box[0].message)
    return box[0]


class _Walk:
    """The export walk, remembering whether it raised itself (a collective inside it failed: an error the
    other ranks cannot learn of) rather than the push that reads it."""

    def __init__(self, items: NamedTensors):
        self._items, self.failed = iter(items), False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._items)
        except StopIteration:
            raise
        except BaseException:
            self.failed = True
            raise


def _timed_export(tensors: NamedTensors) -> NamedTensors:
    """The export walk, each step's time (gathering the full tensors) as part "<innermost span>/export"."""
    iterator = iter(tensors)
    while True:
        with profiling.span(profiling.current("sync") + "/export"):
            item = next(iterator, None)
        if item is None:
            return
        yield item
