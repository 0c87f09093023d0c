"""What this package needs of torch beyond its public API, in one place.

Each function names the torch file:line (torch 2.13.0, under torch/distributed/) it relies on, and
tests/unit/test_platform_compat.py holds a test per function that fails if the workaround is taken away.

- `standalone_group`: a process group outside torch's default world (the weight-broadcast group the
  SGLang servers create), built as torch itself builds one.
- `wrap_collectives`: route the module-level torch.distributed collectives through a wrapper (the
  profiler times them), since Megatron-Core calls them through the module.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable, Iterable

import torch.distributed as dist
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

Undo = Callable[[], None]


def standalone_group(host: str, port: int, world_size: int, group_name: str, backend: str, timeout: timedelta):
    """Rank 0 of a `world_size`-process group named `group_name` that lives outside torch's default world
    (this process may also be a rank of Megatron's world, or of none), hosting its TCPStore itself.

    torch has no public call for it: `init_process_group` makes *the* default group and `new_group` a
    subgroup of it. SGLang builds its side the same way (sglang/srt/utils/common.py:init_custom_process_group):
    distributed_c10d.py:1984 `_new_process_group_helper` makes the group, and the group's rank map in
    `_world.pg_group_ranks` (which distributed_c10d.py:6071 fills for `new_group`'s groups) is what the
    torch.distributed calls taking `group=` look up: without it `dist.broadcast(..., group=g)` raises "Group
    ... is not registered" and `dist.destroy_process_group(g)` a KeyError (distributed_c10d.py:2438).
    Rank 0 hosts the store: torch's tcp:// rendezvous under torchrun would only connect (with
    TORCHELASTIC_USE_AGENT_STORE it expects torchrun's agent to host it), and every member would wait."""
    store = TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    group, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def wrap_collectives(names: Iterable[str], wrap: Callable[[Callable], Callable]) -> Undo:
    """Replace each `torch.distributed.NAME` by `wrap(original)`; returns the undo.

    A module attribute swap, because that is how the callers reach them: Megatron-Core calls the
    collectives through the module at call time (e.g. megatron/core/tensor_parallel/mappings.py:31
    `torch.distributed.all_reduce(...)`), and so does this package (`dist.all_reduce`); torch offers no
    hook around them (the profiler's record_function marks only what its own ops do)."""
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))

    def undo() -> None:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return undo
