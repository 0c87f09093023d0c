"""metrics.jsonl: one object per optimizer step, resume drops redone steps, optional back-ends."""
import json
import math

import pytest
import torch

from megatron_gspo.rollout.batch_filling import response_length_metrics
from megatron_gspo.loss.correction import MISMATCH_SUMS, mismatch_metrics
from megatron_gspo.training.metrics import LEGACY_NAMES, NAMESPACES, MetricsLogger, plot, read_metrics


def test_one_json_object_per_step(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward/mean": 0.1 * step, "loss/clipped_fraction_seq": 0.0, "loss/ratio_min": math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    first = json.loads(lines[0])          # strict JSON: inf became null
    assert first == {"step": 1, "reward/mean": 0.1, "loss/clipped_fraction_seq": 0.0, "loss/ratio_min": None}


def test_resume_drops_steps_after_the_checkpoint_and_appends(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 7):
            log.log(step, {"reward/mean": step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "rew')           # torn line of a crash mid-write
    with MetricsLogger(tmp_path, resume_after=4) as log:
        log.log(5, {"reward/mean": 50})
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 50)]


def test_a_new_run_starts_a_fresh_file(tmp_path):
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"train/a": 1})
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"train/a": 2})
    assert read_metrics(tmp_path) == [{"step": 1, "train/a": 2}]


def test_response_length_metrics_by_hand():
    assert response_length_metrics([4, 2, 6, 8]) == {"rollout/response_length_mean": 5.0,
                                                     "rollout/response_length_max": 8.0}


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
    log.log(1, {"reward/mean": 0.5})
    log.close()
    with pytest.warns(UserWarning, match="matplotlib is not installed"):
        assert plot(tmp_path) is None


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    with MetricsLogger(tmp_path) as log:
        for step in range(1, 5):
            log.log(step, {"reward/mean": step / 4, "loss/clipped_fraction_seq": 0.0,
                           "rollout/response_length_mean": 3.0})
        log.log(4, {"rollout_step": 1, "eval/held_out/mean@4": 0.5})  # an eval record gets its own panel
    path = plot(tmp_path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_metric_outside_the_namespaces_is_refused(tmp_path):
    with MetricsLogger(tmp_path) as log:
        with pytest.raises(KeyError, match="outside the namespaces .*'made_up'"):
            log.log(1, {"reward/mean": 1.0, "made_up": 2.0})
        log.log(1, {"rollout_step": 1, "moe/routing_changed_fraction/layer_07": 0.1})
        log.log(2, mismatch_metrics(torch.ones(len(MISMATCH_SUMS), dtype=torch.float64)))  # correction/*, every step


def test_the_mismatch_metrics_are_in_a_namespace(tmp_path):
    """Every recompute with the sampler's log-probs logs them (training/old_logprobs.py:set_old_logprobs)."""
    from megatron_gspo.loss.correction import MISMATCH_SUMS, mismatch_metrics

    metrics = mismatch_metrics(torch.ones(len(MISMATCH_SUMS), dtype=torch.float64))
    with MetricsLogger(tmp_path) as log:
        log.log(1, {"rollout_step": 1, **metrics})


def test_legacy_names_map_to_distinct_namespaced_ones():
    current = list(LEGACY_NAMES.values())
    assert len(set(current)) == len(current) and all(name.startswith(NAMESPACES) for name in current)


def test_records_of_runs_before_the_namespaces_read_under_todays_names(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "rollout_step": 1, "reward_mean": 0.5, "time_train_s": 2.0, '
                                            '"train_time_s": 0.25, "moe_routing_changed_fraction_layer_03": 0.1}\n')
    assert read_metrics(tmp_path) == [{"step": 1, "rollout_step": 1, "reward/mean": 0.5, "time/train_s": 2.0,
                                       "time/minibatch_train_s": 0.25, "moe/routing_changed_fraction/layer_03": 0.1}]
