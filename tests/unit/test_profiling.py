"""megatron_gspo/profiling.py: named spans per rank, collectives timed under the innermost span, and
`collect` gathering every rank's totals to rank 0 (two gloo processes here, no Megatron)."""
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_gspo import profiling
from megatron_gspo.net import free_port
from megatron_gspo.rollout.sglang.client import _covered


@pytest.fixture
def profile():
    profiling.take()
    profiling.enable(True)
    yield
    profiling.enable(False)
    profiling.take()


def test_disabled_records_nothing_and_leaves_collectives_alone():
    original = dist.all_reduce
    profiling.enable(False)
    with profiling.span("a"):
        profiling.add("b", 1.0)
    assert profiling.take() == {}
    assert dist.all_reduce is original


def test_spans_nest_by_name_and_accumulate(profile):
    for _ in range(2):
        with profiling.span("train"):
            with profiling.span("train/optimizer"):
                time.sleep(0.01)
            assert profiling.current() == "train"
    assert profiling.current("none") == "none"
    totals = profiling.take()
    assert set(totals) == {"train", "train/optimizer"}
    assert totals["train"] >= totals["train/optimizer"] >= 0.02
    assert profiling.take() == {}  # take resets


def test_other_threads_are_background(profile):
    def work():
        with profiling.span("rollout"):
            pass
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert set(profiling.take()) == {"background/rollout"}


def test_enable_patches_and_disable_restores_collectives():
    original = dist.broadcast
    profiling.enable(True)
    try:
        assert dist.broadcast is not original
        profiling.enable(True)  # twice: still one wrapper over the original
        assert dist.broadcast.__wrapped__ is original
    finally:
        profiling.enable(False)
    assert dist.broadcast is original


def test_covered_is_the_union_of_intervals():
    assert _covered([]) == 0.0
    assert _covered([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert _covered([(0.0, 5.0), (1.0, 2.0)]) == pytest.approx(5.0)


def _two_ranks(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    profiling.enable(True)
    with profiling.span("train"):
        if rank == 1:
            time.sleep(0.2)  # rank 0 waits for rank 1 inside the all-reduce
        dist.all_reduce(torch.ones(1))
    with profiling.span(f"only_rank{rank}"):
        pass
    out = profiling.collect()
    again = profiling.collect()  # totals were reset, the gather itself is not timed
    profiling.enable(False)
    dist.destroy_process_group()
    queue.put((rank, out, again))


def test_collect_gathers_every_rank_to_rank0():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_two_ranks, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, out, again = queue.get(timeout=120)
        results[rank] = (out, again)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    out, again = results[0]
    assert results[1] == ({}, {})
    assert again == {}
    assert set(out) == {"profile/train/rank0_s", "profile/train/collectives/rank0_s", "profile/only_rank0/rank0_s",
                        "profile/train/others_max_s", "profile/train/collectives/others_max_s",
                        "profile/only_rank1/others_max_s"}
    assert out["profile/train/collectives/rank0_s"] >= 0.15  # waited for rank 1
    assert out["profile/train/others_max_s"] >= 0.2
    assert out["profile/train/collectives/others_max_s"] < 0.15
