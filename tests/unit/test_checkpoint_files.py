"""Which checkpoint a resume picks: complete iter_XXXXXXX folders only, the `latest` file when valid."""
from megatron_gspo.training.checkpoint import LATEST, complete_iterations, find_latest, iteration_dir


def make(tmp_path, *names):
    for name in names:
        (tmp_path / name).mkdir()


def test_no_checkpoint(tmp_path):
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "missing") is None


def test_tmp_leftovers_are_not_complete(tmp_path):
    make(tmp_path, "iter_0000002", "iter_0000003.tmp", "iter_0000010.tmp", "something_else")
    assert complete_iterations(tmp_path) == [2]
    assert find_latest(tmp_path) == 2


def test_latest_file_wins_when_its_checkpoint_exists(tmp_path):
    make(tmp_path, "iter_0000002", "iter_0000004")
    (tmp_path / LATEST).write_text("2\n")       # e.g. 4 was copied in by hand: the pointer decides
    assert find_latest(tmp_path) == 2


def test_stale_or_garbled_latest_file_falls_back_to_newest_complete(tmp_path):
    make(tmp_path, "iter_0000002", "iter_0000004")
    (tmp_path / LATEST).write_text("6\n")       # its folder was deleted
    assert find_latest(tmp_path) == 4
    (tmp_path / LATEST).write_text("not a number")
    assert find_latest(tmp_path) == 4


def test_iteration_dir_name(tmp_path):
    assert iteration_dir(tmp_path, 7).name == "iter_0000007"


def test_writer_results_are_readable_right_after_they_are_put():
    """dist_checkpointing's synchronous save puts the write results into its results queue and reads
    them back with get_nowait() in the same process; a multiprocessing queue (fed by a thread) is
    often still empty then ("results_queue should not be empty": a failed save)."""
    from megatron_gspo.training.checkpoint import _WriteResults

    for i in range(50):
        results = _WriteResults()  # one per save
        results.put({"bucket": i})
        assert results.get_nowait() == {"bucket": i}


def test_a_background_writer_with_large_results_exits_before_they_are_read():
    """An async save's writer is a forked process that puts its results and exits; they are read only
    after it has exited. Results larger than a pipe's buffer (64 KiB) must not keep it from exiting."""
    import multiprocessing

    from megatron_gspo.training.checkpoint import _WriteResults

    results = _WriteResults()
    big = {"write_results": [("x" * 100, i) for i in range(20_000)]}  # ~2.5 MB pickled
    writer = multiprocessing.get_context("fork").Process(target=results.put, args=(big,))
    writer.start()
    writer.join(timeout=30)
    assert writer.exitcode == 0, "the writer blocked on a full pipe (or failed)"
    assert results.get_nowait() == big


def test_a_writer_that_died_without_results_is_an_error():
    import queue

    import pytest

    from megatron_gspo.training.checkpoint import _WriteResults

    with pytest.raises(queue.Empty):  # dist_checkpointing turns it into a failed save on every rank
        _WriteResults(wait_s=0.2).get_nowait()


def test_closing_a_queue_nothing_was_sent_to_ends_its_thread():
    """A rank with nothing to write puts no result: closing the save's queue must not leave its thread
    (and pipe) behind, one per save."""
    import threading

    from megatron_gspo.training.checkpoint import _WriteResults

    before = threading.active_count()
    queues = [_WriteResults() for _ in range(5)]
    for q in queues:
        q.close()
    for thread in [t for t in threading.enumerate() if t.name == "checkpoint-write-results"]:
        thread.join(timeout=5)
    assert threading.active_count() == before
