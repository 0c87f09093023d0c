"""What this package needs of Megatron-Core beyond its public API, in one place.

Each function names the megatron-core 0.16.1 file:line (under megatron/core/) it works around or relies on;
tests/unit/test_platform_compat.py and the checkpoint/routing tests hold a test per workaround that fails
if it is taken away. CPU-only patches (CUDA literals, the RNG tracker, ...) live in cpu.py.

- `use_own_write_results`: dist_checkpointing's write results through a pipe of ours, not a spawned Manager.
- `create_distributed_optimizer_state`, `restore_distributed_optimizer_steps`: loading a distributed
  optimizer's checkpoint without apex/Transformer Engine.
- `detach_router_replays`: a model's RouterReplay objects out of Megatron's process-wide list.
"""
from __future__ import annotations

import multiprocessing
import queue
import threading

import torch
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer
from megatron.core.transformer.moe.router_replay import RouterReplay


def use_own_write_results() -> "WriteResults":
    """Give dist_checkpointing's next save a fresh `WriteResults` (closing the previous save's): see that
    class for why. The queue is module state that filesystem_async.py:48-56 `_get_write_results_queue` reads
    (`_results_queue`, created on first use as a spawned Manager's queue); there is no argument to pass one."""
    previous = filesystem_async._results_queue
    if isinstance(previous, WriteResults):
        previous.close()
    filesystem_async._results_queue = WriteResults()
    return filesystem_async._results_queue


class WriteResults:
    """The queue that carries dist_checkpointing's write results to this process, for one save.

    megatron-core 0.16.1 dist_checkpointing/strategies/filesystem_async.py:51-56 makes it a queue of a
    *spawned* multiprocessing Manager on the first save: a fresh interpreter that re-imports the
    trainer's main module, 3.4 s per checkpoint of the tiny demo model (measured, TP2, 2 cores; the
    save itself takes 0.06 s), and a process that, kept alive, is orphaned by a kill -9 and holds the
    launcher's stdout open. The results are put by the process that ran the writers: this one in a
    synchronous save, the forked background writer in an async one (`put` after the fork: the pipe is
    inherited). A thread here drains the pipe at once, so a large result never blocks that writer on a
    full pipe (it must exit before the results are read); `get_nowait` waits for the thread up to `wait_s`
    (a plain multiprocessing.Queue's get_nowait right after the put can find the pipe still
    empty: "results_queue should not be empty", seen in CI's Slurm requeue test on a loaded machine).
    """

    def __init__(self, wait_s: float = 30.0):
        self._reader, self._writer = multiprocessing.get_context("fork").Pipe(duplex=False)
        self._received: queue.Queue = queue.Queue()
        self._wait_s = wait_s
        threading.Thread(target=self._drain, name="checkpoint-write-results", daemon=True).start()

    def _drain(self) -> None:
        try:
            self._received.put(self._reader.recv())  # one result (or exception) per save
        except (EOFError, OSError):  # closed with nothing sent (a rank with nothing to write)
            pass
        finally:
            self._reader.close()

    def put(self, item) -> None:
        self._writer.send(item)

    def get_nowait(self):
        # The writer has exited (or, synchronously, returned) before this is called: what it sent is
        # in the pipe; nothing arrives only if it died without sending (then queue.Empty, an error).
        return self._received.get(timeout=self._wait_s)

    def close(self) -> None:
        """Once the save is over: the drain thread ends (at once if nothing was sent)."""
        self._writer.close()


def create_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer the Adam state that loading overwrites.

    megatron-core 0.16.1 optimizer/distrib_optimizer.py:642: without apex or Transformer Engine,
    DistributedOptimizer.state_dict() asserts that Adam's `step` exists, so a freshly built one (no
    step taken yet) cannot build the sharded state dict to load into. One zero-gradient step creates
    the state, as Megatron does itself before an FSDP load (distrib_optimizer.py:1357); the load then
    replaces it, and the model weights are loaded after it (a zero-gradient AdamW step can still
    apply weight decay).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            with torch.no_grad():
                opt._init_optimizer_states_with_dummy_values()


def restore_distributed_optimizer_steps(optimizer, loaded: dict) -> None:
    """Put the checkpoint's Adam step count back into a distributed optimizer's state.

    Without apex/TE the step lives in the saved param_groups (distrib_optimizer.py:671), and
    DistributedOptimizer.load_state_dict (distrib_optimizer.py:817-825) writes it into a copy of the
    state that, with state already allocated (create_distributed_optimizer_state's zero-gradient step), does not reach torch's
    Adam: the step stays 1 and Adam's bias correction is wrong after a resume. Measured on CPU with
    megatron-core 0.16.1; a no-op with apex/TE and for the non-distributed optimizers.
    """
    if HAVE_APEX_OR_TE:
        return
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    states = loaded if isinstance(loaded, dict) and len(subs) == 1 else None
    for i, opt in enumerate(subs):
        if not isinstance(opt, DistributedOptimizer):
            continue
        state = states if states is not None else loaded[i]
        steps = {g["step"] for g in state["optimizer"]["param_groups"] if g.get("step") is not None}
        if len(steps) != 1:
            raise ValueError(f"distributed optimizer checkpoint holds Adam steps {sorted(steps)}; expected one")
        step = float(steps.pop())
        for param_state in opt.optimizer.state.values():
            param_state["step"] = torch.tensor(step, dtype=torch.float32)


def detach_router_replays(replays) -> None:
    """Take `replays` (RouterReplay objects of one model's routers) out of Megatron's process-wide list.

    transformer/moe/router_replay.py:87 appends every RouterReplay to the class attribute
    `global_router_replay_instances` (line 26), and its static helpers (lines 36-75) drive all of them at
    once. This package reaches each model's routers through the model (model/routing.py), so two models in
    one process (tests, a reference model) never see each other's routing; the list must not keep them
    (nor keep them alive)."""
    mine = {id(r) for r in replays}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]
