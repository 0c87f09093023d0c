"""Where a rollout step's time goes below the driver's phases: named wall-time spans per rank.

    profiling.enable()                       # logging.profile=true does this on every rank
    with profiling.span("train/optimizer"):  # anywhere; a no-op while profiling is off
        optimizer.step()
    parts = profiling.collect()              # collective, once per step: every rank's totals -> rank 0

Spans nest by name, not by stack: "sync/export" and "sync/server_load" are parts of "sync". While
profiling, the torch.distributed collectives (the ones Megatron-Core's tensor-parallel layers and this
package call through the module, e.g. `torch.distributed.all_reduce`) are timed too, each under
"<innermost open span>/collectives": the time a rank spends inside them, waiting for its peers included.
Spans opened on another thread than the main one (the rollout thread of rollout.max_staleness) are
named "background/<name>": they overlap the main thread's time instead of adding to it.

`collect` returns, on rank 0, per part: rank 0's seconds and the largest seconds of any other rank (the
trainer ranks without a rollout backend wait in a collective while rank 0 drives the servers, so the
two differ). benchmarks/step.py --profile prints them as a table with shares of the step.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import defaultdict

import torch.distributed as dist

from megatron_gspo.platform.torch_compat import wrap_collectives

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                "barrier", "all_gather_object", "broadcast_object_list", "gather_object", "send", "recv",
                "isend", "irecv", "batch_isend_irecv", "all_to_all_single")

_enabled = False
_totals: dict[str, float] = defaultdict(float)
_lock = threading.Lock()
_local = threading.local()
_originals: dict[str, object] = {}
"""The collectives as they were before enable() wrapped them (collect() gathers with the original)."""
_undo_wrapping = None


def enabled() -> bool:
    return _enabled


def enable(on: bool = True) -> None:
    """Start (or stop) recording spans and timing the torch.distributed collectives."""
    global _enabled, _undo_wrapping
    _enabled = on
    if on and _undo_wrapping is None:
        _originals.update({name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)})
        _undo_wrapping = wrap_collectives(_COLLECTIVES, _timed_collective)
    elif not on and _undo_wrapping is not None:
        _undo_wrapping()
        _undo_wrapping = None
        _originals.clear()


def _stack() -> list[str]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _qualified(name: str) -> str:
    return name if threading.current_thread() is threading.main_thread() else f"background/{name}"


def current(default: str = "untracked") -> str:
    """The innermost open span's name on this thread (`default` outside any)."""
    stack = _stack()
    return stack[-1] if stack else default


def add(name: str, seconds: float) -> None:
    """Add `seconds` to part `name` (for time measured elsewhere, e.g. a server's own report)."""
    if _enabled:
        with _lock:
            _totals[_qualified(name)] += seconds


@contextlib.contextmanager
def _span(name: str):
    stack = _stack()
    stack.append(name)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        stack.pop()
        add(name, elapsed)


_NULL = contextlib.nullcontext()


def span(name: str):
    """A context manager timing its block as part `name` (nothing while profiling is off)."""
    return _span(name) if _enabled else _NULL


def _timed_collective(fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        stack = _stack()
        if not _enabled or (stack and stack[-1].endswith("/collectives")):
            return fn(*args, **kwargs)  # a collective calling another (e.g. *_object) counts once
        outer = stack[-1] if stack else "untracked"
        with _span(f"{outer}/collectives"):
            return fn(*args, **kwargs)
    return timed


def take() -> dict[str, float]:
    """This rank's totals since the last take (and reset them)."""
    with _lock:
        out = dict(_totals)
        _totals.clear()
    return out


def collect(group=None) -> dict[str, float]:
    """Collective over `group` (default: the world): on its first rank, per part, "profile/PART/rank0_s"
    (that rank's seconds) and "profile/PART/others_max_s" (the most any other rank spent in it); {} elsewhere. The
    totals are reset everywhere. The gather itself is not timed."""
    mine = take()
    size = dist.get_world_size(group)
    parts: list = [None] * size
    gather = _originals.get("all_gather_object", dist.all_gather_object)
    gather(parts, mine, group=group)
    if dist.get_rank(group) != 0:
        return {}
    out = {f"profile/{name}/rank0_s": seconds for name, seconds in parts[0].items()}
    for other in parts[1:]:
        for name, seconds in other.items():
            key = f"profile/{name}/others_max_s"
            out[key] = max(out.get(key, 0.0), seconds)
    return out
