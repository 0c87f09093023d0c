"""The workarounds of platform/torch_compat.py and platform/megatron_compat.py: each test shows what the
upstream code does that the workaround answers, and fails if the workaround is taken away.
(The distributed optimizer's load workarounds are covered by tests/distributed/test_resume.py's
dp2_distributed_optimizer case: without either the resumed run differs.)"""
import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.net import free_port
from megatron_gspo.platform.megatron_compat import WriteResults, detach_router_replays, use_own_write_results
from megatron_gspo.platform.torch_compat import standalone_group, wrap_collectives


def test_a_standalone_group_serves_torch_distributed_calls():
    """The weight-broadcast group: torch.distributed calls that take group= find it, and it can be destroyed
    (without its rank map both raise: torch_compat.standalone_group's docstring)."""
    group = standalone_group("127.0.0.1", free_port("127.0.0.1"), 1, "compat_test", "gloo",
                             datetime.timedelta(seconds=30))
    tensor = torch.arange(3.0)
    dist.broadcast(tensor, src=0, group=group)
    assert tensor.tolist() == [0.0, 1.0, 2.0]
    dist.destroy_process_group(group)


def test_wrapped_collectives_are_the_ones_megatron_calls():
    """Megatron's tensor-parallel reduction calls torch.distributed.all_reduce through the module at call
    time: the wrapper sees it; undo puts the original back."""
    from megatron.core.tensor_parallel.mappings import _reduce

    class TwoRanks:
        def size(self):
            return 2

    seen = []
    original = dist.all_reduce
    undo = wrap_collectives(["all_reduce", "not_a_collective"], lambda fn: lambda *a, **kw: seen.append(fn))
    try:
        _reduce(torch.ones(2), TwoRanks())
    finally:
        undo()
    assert seen == [original] and dist.all_reduce is original


def test_router_replays_leave_megatrons_process_wide_list():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine, other = RouterReplay(), RouterReplay()            # each appends itself (router_replay.py:87)
    assert mine in RouterReplay.global_router_replay_instances
    detach_router_replays([mine])
    assert mine not in RouterReplay.global_router_replay_instances
    assert other in RouterReplay.global_router_replay_instances   # another model's stay
    detach_router_replays([other])


def test_checkpoint_writes_report_through_our_queue():
    """dist_checkpointing reads its write results from a module-level queue it would otherwise create as a
    spawned Manager's (filesystem_async.py:51-56: a fresh interpreter per checkpoint)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    first = use_own_write_results()
    assert filesystem_async._get_write_results_queue() is first and isinstance(first, WriteResults)
    second = use_own_write_results()                          # the next save: the previous queue is closed
    assert filesystem_async._get_write_results_queue() is second and first._writer.closed


def test_writer_results_are_readable_right_after_they_are_put():
    """dist_checkpointing's synchronous save puts the write results into its results queue and reads
    them back with get_nowait() in the same process; a multiprocessing queue (fed by a thread) is
    often still empty then ("results_queue should not be empty": a failed save)."""
    for i in range(50):
        results = WriteResults()  # one per save
        results.put({"bucket": i})
        assert results.get_nowait() == {"bucket": i}


def test_a_background_writer_with_large_results_exits_before_they_are_read():
    """An async save's writer is a forked process that puts its results and exits; they are read only
    after it has exited. Results larger than a pipe's buffer (64 KiB) must not keep it from exiting."""
    import multiprocessing

    results = WriteResults()
    big = {"write_results": [("x" * 100, i) for i in range(20_000)]}  # ~2.5 MB pickled
    writer = multiprocessing.get_context("fork").Process(target=results.put, args=(big,))
    writer.start()
    writer.join(timeout=30)
    assert writer.exitcode == 0, "the writer blocked on a full pipe (or failed)"
    assert results.get_nowait() == big


def test_a_writer_that_died_without_results_is_an_error():
    import queue

    with pytest.raises(queue.Empty):  # dist_checkpointing turns it into a failed save on every rank
        WriteResults(wait_s=0.2).get_nowait()


def test_closing_a_queue_nothing_was_sent_to_ends_its_thread():
    """A rank with nothing to write puts no result: closing the save's queue must not leave its thread
    (and pipe) behind, one per save."""
    import threading

    before = threading.active_count()
    queues = [WriteResults() for _ in range(5)]
    for q in queues:
        q.close()
    for thread in [t for t in threading.enumerate() if t.name == "checkpoint-write-results"]:
        thread.join(timeout=5)
    assert threading.active_count() == before


def test_megatrons_fallback_warnings_are_said_once_not_six_times():
    """Importing the trainer shows none of Megatron-Core's six TE/apex fallback warnings (platform/quiet.py);
    any other warning still shows, and FALLBACK_NOTE is the one line said instead."""
    import subprocess
    import sys

    code = ("import warnings, megatron_gspo.training.loop\n"
            "from megatron_gspo.platform.quiet import fallbacks_in_use\n"
            "warnings.warn('a real warning')\nprint(fallbacks_in_use())")
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, check=True)
    assert "Falling back" not in out.stderr and "a real warning" in out.stderr, out.stderr[-2000:]
    assert out.stdout.strip() == "True"  # this CPU machine has neither TE nor apex
