"""`megatron-gspo train`'s last line when ranks fail (training/launch.py): the first recorded exception."""
import json
import os

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megatron_gspo.training.launch import first_failure


def recorded(path, message: str, written_ns: int) -> str:
    """An error file as torch's @record writes it (error_handler.py record_exception), written at written_ns."""
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "Traceback ...",
                                                                             "timestamp": str(written_ns // 10**9)}}}))
    os.utime(path, ns=(written_ns, written_ns))
    return str(path)


def test_the_earliest_recorded_exception_wins_over_later_ones_and_signals(tmp_path):
    t = 1_700_000_000 * 10**9  # the same second for all: the recorded timestamps cannot order them
    failures = {
        0: ProcessFailure(0, 100, 1, recorded(tmp_path / "0.json", "RuntimeError: Connection closed by peer", t + 900)),
        1: ProcessFailure(1, 101, 1, recorded(tmp_path / "1.json", "ValueError: bad row\nline two\nline three", t + 5)),
        2: ProcessFailure(2, 102, -9, str(tmp_path / "missing.json")),  # killed: no error file
    }
    assert first_failure(failures) == "rank 1 failed: ValueError: bad row [2 more lines in its traceback above]"
    del failures[1]
    assert first_failure(failures) == "rank 0 failed: RuntimeError: Connection closed by peer"


def test_ranks_that_recorded_nothing(tmp_path):
    killed = ProcessFailure(3, 7, -9, str(tmp_path / "none"))
    assert first_failure({3: killed}) == "rank 3 failed: killed by signal SIGKILL"
    assert first_failure({0: ProcessFailure(0, 7, 3, str(tmp_path / "none"))}) == (
        "rank 0 failed: exited with code 3 without recording an exception (see its output above)")


def test_rank_0s_error_relayed_to_every_rank_is_named_as_rank_0s(tmp_path):
    # Rank 0's scoring failed; every rank raised RolloutFailed with its message, rank 1's error file came first.
    t = 1_700_000_000 * 10**9
    relayed = "RolloutFailed: scoring failed on rank 0: RewardError: reward function 'f' failed on its first 4 samples"
    failures = {0: ProcessFailure(0, 100, 1, recorded(tmp_path / "0.json", relayed, t + 9)),
                1: ProcessFailure(1, 101, 1, recorded(tmp_path / "1.json", relayed, t + 5))}
    assert first_failure(failures) == "rank 0 failed: RewardError: reward function 'f' failed on its first 4 samples"
