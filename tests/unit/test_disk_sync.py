"""DiskSync refuses a weights folder SGLang's loader cannot find files in (it globs the folder)."""
import pytest

from megatron_gspo.rollout.sglang.weight_sync import DiskSync


@pytest.mark.parametrize("name", ["run[1]", "run*", "what?"])
def test_glob_characters_in_the_folder_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="glob character"):
        DiskSync(["http://127.0.0.1:1"], tmp_path / name / "weights", tmp_path)


def test_a_plain_folder_is_taken(tmp_path):
    assert DiskSync(["http://127.0.0.1:1"], tmp_path / "run-1" / "weights", tmp_path).folder.name == "weights"
