"""Training checkpoints: save, find the latest complete one, resume exactly.

Layout of DIR (shared storage, seen by every rank):

    DIR/latest_checkpointed_iteration.txt   "7": written last, atomically (temp file + os.replace)
    DIR/iter_0000007/         Megatron dist_checkpointing (torch_dist) of {"model": ..., "optimizer": ...}:
        .metadata, common.pt, metadata.json, __*_*.distcp
        trainer.pt            step, data state, user state (e.g. rollout state), lr scheduler state
        rng/rank_00000.pt     each rank's RNG states: Python, NumPy, torch, CUDA, Megatron's tracker

This is Megatron-LM's layout (tracker file, iter_XXXXXXX, the model under "model" / "model0".."),
so the project's checkpoint tools read it as they read any Megatron checkpoint: e.g.
`convert.load.load_weights(model, DIR)` or an HF export of DIR.

A checkpoint is written into DIR/iter_0000007.tmp/ and renamed to iter_0000007/ by rank 0 only after
every rank has finished writing (its *publication*), then the `latest` file is updated: a crash at any
moment leaves either the previous complete checkpoint as the latest or the new one, never a partial one.
Written in the background (`BackgroundSaves`, checkpoint.async_save), the publication waits until every
rank's writer has finished: the same guarantee, later. It happens at the next save, at the run's end, on
a stop signal, and on an error every rank raises together (the driver's `RolloutFailed`: rank 0's rollout,
scoring or weight push failed); an error on one rank alone cannot publish it (the others cannot join in)
and neither can a kill. What such an exit leaves behind, `recover_unpublished` sorts out at the next
start: a `.tmp` newer than the latest checkpoint is published if it is complete (Megatron's `.metadata`
is written once every rank's tensors are: a kill before the rename), else removed; `find_latest` never
reads `.tmp` folders, and the next save deletes any left.

Exactness: model and Adam state (both moments and the step count) are saved in float32 as they are;
with the RNG states, the data position and the scheduler step restored, the resumed run takes the
same steps bit for bit (tests/distributed/test_resume.py). RNG files are per rank, so an exact
resume needs the same world size; model and optimizer reshard like any Megatron checkpoint.
The same holds with Megatron's distributed optimizer (Adam state sharded over DP ranks), which without
apex/TE needs two work-arounds (platform/megatron_compat.py; tested: DP2, bitwise); neither path has been
run on GPUs yet.
"""
from __future__ import annotations

import functools
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from megatron_gspo.convert.dcp_io import DcpRegionReader
from megatron_gspo.convert.load import named_model_chunks
from megatron_gspo.platform.megatron_compat import (create_distributed_optimizer_state,
                                                    restore_distributed_optimizer_steps, use_own_write_results)
from megatron_gspo.training.optimizer import fuse_cpu_adam

LATEST = "latest_checkpointed_iteration.txt"
_COMPLETE = re.compile(r"^iter_(\d{7})$")
_UNPUBLISHED = re.compile(r"^iter_(\d{7})\.tmp$")


@dataclass
class TrainerState:
    """Everything besides model and optimizer that a resumed run needs."""

    step: int
    """Completed rollout steps."""
    data_state: Any = None
    """The prompt source's position (anything picklable)."""
    user_state: dict = field(default_factory=dict)
    """Caller's extras, e.g. rollout state or a metrics cursor."""


def iteration_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    return Path(ckpt_dir) / f"iter_{step:07d}"


def complete_iterations(ckpt_dir: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints in ckpt_dir, ascending (`.tmp` leftovers are not complete)."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        return []
    return sorted(int(m.group(1)) for p in path.iterdir() if p.is_dir() and (m := _COMPLETE.match(p.name)))


def find_latest(ckpt_dir: str | os.PathLike) -> int | None:
    """The step to resume from: the `latest` file's when that checkpoint exists, else the newest complete."""
    complete = complete_iterations(ckpt_dir)
    try:
        named = int((Path(ckpt_dir) / LATEST).read_text().strip())
    except (FileNotFoundError, ValueError):
        named = None
    if named in complete:
        return named
    return complete[-1] if complete else None


def _sharded_state(model: list, optimizer, *, is_loading: bool) -> dict:
    model_state = {name: module.sharded_state_dict() for name, module in named_model_chunks(model)}
    state = dict(model_state)
    if optimizer is not None:
        # Megatron-LM's default layout for the distributed optimizer's state (other optimizers ignore it).
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return state


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class BackgroundSaves:
    """Checkpoints still being written (`checkpoint.async_save`), with Megatron-Core's async save.

    `save_checkpoint(..., background=saves)` writes the small files (common.pt, trainer.pt, RNG states)
    and returns; a process forked at that moment writes the model and optimizer tensors from its
    copy-on-write snapshot of them, so training goes on while it writes (on GPU Megatron first copies
    the tensors to host memory: its preload step). The checkpoint is published (renamed from `.tmp`,
    `latest` updated, old ones pruned) by `finish` once every rank's writer is done: until then the
    previous checkpoint is the latest, and a crash leaves only a `.tmp` behind. One save is in flight at
    most (the next save waits for it). Every method is collective: call it on every rank.

    As a context manager, leaving the block publishes the save in flight (waiting for its writers): at a
    normal end and on the errors in `collective_errors`, which every rank raises at the same point. Any
    other error may be one rank's, while the others are elsewhere and cannot join the all-reduce: its
    save stays a `.tmp` (`recover_unpublished` publishes or removes it at the next start).
    """

    def __init__(self, collective_errors: tuple[type[BaseException], ...] = ()):
        self._calls = AsyncCallsQueue(persistent=False)  # a fresh fork per save: a snapshot each time
        self.collective_errors = collective_errors

    def __enter__(self) -> "BackgroundSaves":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is None or isinstance(error, self.collective_errors):
            self.finish(wait=True)

    @property
    def pending(self) -> bool:
        return self._calls.get_num_unfinalized_calls() > 0

    def schedule(self, request) -> None:
        self._calls.schedule_async_request(request)

    def finish(self, wait: bool = False) -> None:
        """Publish the saves whose writers are done on every rank (`wait`: wait for them). Costs one
        small all-reduce per pending save; nothing when none is pending."""
        if self.pending:
            self._calls.maybe_finalize_async_calls(blocking=wait)


def save_checkpoint(ckpt_dir: str | os.PathLike, state: TrainerState, model: list, optimizer, scheduler=None,
                    *, keep_last: int = 0, background: BackgroundSaves | None = None) -> Path:
    """Write checkpoint `state.step` (collective: every rank calls it). Returns its directory, which
    exists on return, or, with `background`, once `background.finish` has published it."""
    if background is not None:
        background.finish(wait=True)
    rank = dist.get_rank()
    final = iteration_dir(ckpt_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        for stale in Path(ckpt_dir).glob("iter_*.tmp"):
            shutil.rmtree(stale)
        tmp.mkdir(parents=True)
    dist.barrier()
    use_own_write_results()  # taken by this save's writer; the last save is over (a background one: published above)
    request = dist_checkpointing.save(_sharded_state(model, optimizer, is_loading=False), str(tmp),
                                      async_sharded_save=background is not None)
    if rank == 0:
        (tmp / "rng").mkdir()
    dist.barrier()
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    if rank == 0:
        torch.save({"step": state.step, "data_state": state.data_state, "user_state": state.user_state,
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "world_size": dist.get_world_size()}, tmp / "trainer.pt")
    publish = functools.partial(_publish_on_rank0, Path(ckpt_dir), state.step, keep_last)
    if background is not None:
        # Megatron's own finalize (metadata, then a barrier: every rank's tensors are written) runs first.
        request.add_finalize_fn(publish)
        background.schedule(request)
        return final
    dist.barrier()
    publish()
    dist.barrier()
    return final


def _publish_on_rank0(ckpt_dir: Path, step: int, keep_last: int) -> None:
    """Publish checkpoint `step` once all ranks have finished writing it (rank 0 does; the others return)."""
    if dist.get_rank() == 0:
        _publish(ckpt_dir, step, keep_last)


def _publish(ckpt_dir: Path, step: int, keep_last: int) -> None:
    """iter_STEP.tmp -> iter_STEP, then the `latest` file, then the pruning."""
    final = iteration_dir(ckpt_dir, step)
    if final.exists():  # the same step saved again (e.g. on a signal right after a periodic save)
        shutil.rmtree(final)
    os.replace(final.with_name(final.name + ".tmp"), final)
    _write_atomically(ckpt_dir / LATEST, f"{step}\n")
    if keep_last:
        for old in complete_iterations(ckpt_dir)[:-keep_last]:
            shutil.rmtree(iteration_dir(ckpt_dir, old))


def recover_unpublished(ckpt_dir: str | os.PathLike, *, keep_last: int = 0) -> list[str]:
    """Publish or remove what a crash left unpublished; one line for each, to print. Call it on rank 0 only,
    before a resume reads `find_latest` (no process group needed).

    Each `iter_STEP.tmp` newer than the latest checkpoint is verified (`_why_incomplete`): complete
    (a kill between Megatron's finalize and the rename), it is published as the save would have (rename,
    `latest` file, pruning to `keep_last`); else removed, so that a run resuming from an older step never
    leaves a newer one lying next to it. Older `.tmp` folders stay for the next save to delete.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    latest = find_latest(ckpt_dir)
    lines = []
    for step in sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if (m := _UNPUBLISHED.match(p.name))):
        if latest is not None and step <= latest:
            continue
        tmp = ckpt_dir / f"iter_{step:07d}.tmp"
        problem = _why_incomplete(tmp, step)
        if problem is None:
            _publish(ckpt_dir, step, keep_last)
            latest = step
            lines.append(f"published iter_{step:07d} left complete by the previous run")
        else:
            shutil.rmtree(tmp)
            lines.append(f"removed {tmp.name}: incomplete ({problem})")
    return lines


def _why_incomplete(tmp: Path, step: int) -> str | None:
    """Why the unpublished checkpoint folder `tmp` of `step` is not complete, or None when it is.

    Complete: Megatron's `.metadata` (rank 0 writes it after gathering every rank's write results) with
    every data file it places records in present and long enough (convert/dcp_io.py), its metadata.json,
    common.pt, trainer.pt of this step, and an RNG file for each rank of the world that saved it.
    """
    if not (tmp / ".metadata").is_file():
        return "no .metadata: the previous run died while writing it"
    try:
        DcpRegionReader(tmp)
    except (FileNotFoundError, ValueError) as error:
        return str(error)
    for name in ("metadata.json", "common.pt", "trainer.pt"):
        if not (tmp / name).is_file():
            return f"no {name}"
    try:
        trainer = torch.load(tmp / "trainer.pt", weights_only=False)
    except Exception as error:  # truncated: EOFError, RuntimeError ("failed finding central directory"), ...
        return f"trainer.pt cannot be read ({type(error).__name__}: {error})"
    if trainer["step"] != step:
        return f"its trainer.pt is step {trainer['step']}'s"
    missing = [f"rng/rank_{r:05d}.pt" for r in range(trainer["world_size"])
               if not (tmp / "rng" / f"rank_{r:05d}.pt").is_file()]
    if missing:
        return f"no {', '.join(missing)} (saved by {trainer['world_size']} ranks)"
    return None


def load_checkpoint(ckpt_dir: str | os.PathLike, model: list, optimizer=None, scheduler=None, *,
                    step: int | None = None, restore_rng: bool = True) -> TrainerState | None:
    """Load the latest complete checkpoint (or `step`) into model/optimizer/scheduler; None if there is none.

    Collective: every rank calls it.
    """
    step = find_latest(ckpt_dir) if step is None else step
    if step is None:
        return None
    path = iteration_dir(ckpt_dir, step)
    if optimizer is not None:
        create_distributed_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, is_loading=True), str(path))
    for name, module in named_model_chunks(model):
        module.load_state_dict(loaded[name])
    if optimizer is not None:
        with torch.no_grad():  # it copies into the main parameters, views of the model's with fp32 params
            optimizer.load_state_dict(loaded["optimizer"])
        restore_distributed_optimizer_steps(optimizer, loaded["optimizer"])
        fuse_cpu_adam(optimizer)  # the saved param_groups replaced ours, fused flag included
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    if scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    if restore_rng:
        rng_file = path / "rng" / f"rank_{dist.get_rank():05d}.pt"
        if trainer["world_size"] != dist.get_world_size() or not rng_file.exists():
            raise ValueError(f"{path} was saved by {trainer['world_size']} ranks, this run has "
                             f"{dist.get_world_size()}: RNG states cannot be restored (restore_rng=False "
                             "resumes without them, not bit-exactly)")
        _set_rng_state(torch.load(rng_file, weights_only=False))
    dist.barrier()
    return TrainerState(step=trainer["step"], data_state=trainer["data_state"], user_state=trainer["user_state"])
