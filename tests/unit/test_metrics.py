"""metrics.jsonl: one object per optimizer step, resume drops redone steps, optional back-ends."""
import json
import math

import pytest

from megatron_gspo.training.metrics import MetricsLogger, plot, read_metrics, response_length_metrics


def test_one_json_object_per_step(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward_mean": 0.1 * step, "clipped_fraction_seq": 0.0, "ratio_min": math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])          # strict JSON: inf became null
    assert first == {"step": 1, "reward_mean": 0.1, "clipped_fraction_seq": 0.0, "ratio_min": None}


def test_resume_drops_steps_after_the_checkpoint_and_appends(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 7):
            log.log(step, {"reward_mean": step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "rew')           # torn line of a crash mid-write
    with MetricsLogger(tmp_path, resume_after=4) as log:
        log.log(5, {"reward_mean": 50})
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 50)]


def test_a_new_run_starts_a_fresh_file(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"a": 1})
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"a": 2})
    assert read_metrics(tmp_path) == [{"step": 1, "a": 2}]


def test_response_length_metrics_by_hand():
    assert response_length_metrics([4, 2, 6, 8]) == {"response_length_mean": 5.0, "response_length_max": 8.0}


def test_missing_optional_backends_only_warn(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_optional(name, *args, **kwargs):
        if name.startswith(("torch.utils.tensorboard", "wandb", "matplotlib")):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_optional)
    with pytest.warns(UserWarning, match="tensorboard is not installed"):
        log = MetricsLogger(tmp_path, tensorboard=True)
    log.log(1, {"reward_mean": 0.5})
    log.close()
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert plot(tmp_path) is None


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 5):
            log.log(step, {"reward_mean": step / 4, "clipped_fraction_seq": 0.0, "response_length_mean": 3.0})
    path = plot(tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
