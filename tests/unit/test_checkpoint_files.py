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
