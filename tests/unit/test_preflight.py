"""Missing model paths and unwritable directories fail before work starts, naming the setting."""
import os

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.training.preflight import preflight


def config(tmp_path, *overrides):
    return load_config(None, [f"model.hf_path={tmp_path / 'hf'}", f"logging.run_dir={tmp_path / 'run'}",
                              *overrides])


def test_ok(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    preflight(config(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}"))
    assert (tmp_path / "ckpt").is_dir() and not list((tmp_path / "ckpt").iterdir())


def test_missing_model(tmp_path):
    with pytest.raises(ValueError, match="model.hf_path: no Hugging Face model at .*config.json not found"):
        preflight(config(tmp_path))


def test_missing_init_checkpoint(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="model.init_checkpoint: no Megatron distributed checkpoint"):
        preflight(config(tmp_path, f"model.init_checkpoint={tmp_path / 'nope'}"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_unwritable_checkpoint_dir(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="checkpoint.dir: cannot write to"):
        preflight(config(tmp_path, f"checkpoint.dir={locked / 'ckpt'}"))


def test_checkpoint_dir_under_a_file(tmp_path):
    # Works as root too: a path below a regular file cannot be created.
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="checkpoint.dir: cannot write to"):
        preflight(config(tmp_path, f"checkpoint.dir={tmp_path / 'file' / 'ckpt'}"))


def test_export_under_a_file(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="checkpoint.export_hf: cannot write to"):
        preflight(config(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}",
                         f"checkpoint.export_hf={tmp_path / 'file' / 'hf_final'}"))


def test_unknown_preset_and_task_are_named(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"rollout.task must be one of \['arithmetic'\], got 'sudoku'"):
        preflight(config(tmp_path, "rollout.task=sudoku"))
    bad_preset = load_config(None, ["model.preset=tiny_large", "rollout.backend=megatron",
                                    f"logging.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="model.preset must be one of .*got 'tiny_large'"):
        preflight(bad_preset)
