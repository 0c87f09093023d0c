"""Configuration: YAML + overrides map onto typed, validated dataclasses; bad input names the field."""
import dataclasses
import re
from pathlib import Path

import pytest

from megatron_gspo.config import TrainConfig, dump_yaml, load_config
from megatron_gspo.loss.policy import clip_range
from megatron_gspo.training.preflight import preflight


def resolved_clip(config):
    return clip_range(config.gspo.algorithm, config.gspo.eps_low, config.gspo.eps_high)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = EXAMPLES / "tiny_cpu.yaml"


@pytest.mark.parametrize("name", ["tiny_cpu", "tiny_long_cpu", "qwen3_30b_a3b_gspo", "qwen3_235b_a22b_gspo"])
def test_presets_load(name):
    config = load_config(EXAMPLES / f"{name}.yaml")
    assert isinstance(config, TrainConfig)
    assert config.gspo.algorithm == "gspo"
    # The paper: 4 mini-batches per rollout batch. The CPU demo takes 8 smaller steps (examples/tiny_cpu.yaml).
    assert config.gspo.num_minibatches == (8 if name == "tiny_cpu" else 4)


def test_paper_preset_has_paper_settings():
    config = load_config(EXAMPLES / "qwen3_30b_a3b_gspo.yaml")
    assert resolved_clip(config) == (3e-4, 4e-4)
    assert config.gspo.old_logprobs == "recompute"
    assert (config.parallel.tp, config.parallel.ep, config.parallel.etp) == (4, 8, 1)


def test_tiny_cpu_runs_on_two_processes():
    parallel = load_config(TINY).parallel
    assert parallel.world_size == 2 and parallel.tp == 2 and str(parallel) == "tp2"


def test_overrides_are_parsed_by_field_type():
    config = load_config(TINY, ["gspo.eps_low=2e-4", "gspo.eps_high=none", "num_steps=7",
                                "logging.tensorboard=yes", "rollout.server_urls=http://a:1, http://b:2",
                                "gspo.algorithm=grpo", "parallel.etp=1", "optimizer.lr=1"])
    assert config.gspo.eps_low == 2e-4 and config.gspo.eps_high is None
    assert config.num_steps == 7 and config.logging.tensorboard is True
    assert config.rollout.server_urls == ("http://a:1", "http://b:2")
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    # eps_high None -> GRPO's default; eps_low as given.
    assert resolved_clip(config) == (2e-4, 0.27)


def test_clip_defaults_follow_the_algorithm():
    assert resolved_clip(load_config(TINY, ["gspo.algorithm=grpo"])) == (0.2, 0.27)
    assert resolved_clip(load_config(TINY, ["gspo.algorithm=gspo_token"])) == (3e-4, 4e-4)


def test_yaml_scientific_notation_without_dot(tmp_path):
    # YAML 1.1 reads `3e-4` as a string; a float field still takes it.
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: tiny_dense}\nrollout: {backend: megatron}\ngspo: {eps_low: 3e-4}\n")
    assert load_config(path).gspo.eps_low == 3e-4


@pytest.mark.parametrize("override, message", [
    ("gspo.eps_low=-1", "gspo.eps_low must be in [0, 1), got -1.0"),
    ("sampling.temperature=0", "sampling.temperature must be > 0"),
    ("parallel.tp=0", "parallel.tp must be >= 1"),
    ("parallel.tp=two", "parallel.tp must be an integer, got 'two'"),
    ("gspo.algorithm=ppo", "gspo.algorithm must be one of gspo, gspo_token, grpo"),
    ("gspo.old_logprobs=sglang", "gspo.old_logprobs must be one of recompute, rollout"),
    ("logging.tensorboard=maybe", "logging.tensorboard must be true or false"),
    ("gspo.num_minibatches=3", "gspo.num_minibatches must divide prompts_per_step * group_size = 256"),
    ("sampling.top_p=1.5", "sampling.top_p must be in (0, 1]"),
    ("rollout.max_attempts=0", "rollout.max_attempts must be >= 1"),
    ("rollout.max_total_tokens=0", "rollout.max_total_tokens must be >= 1"),
    ("rollout.connect_timeout_s=0", "rollout.connect_timeout_s must be > 0"),
    ("rollout.retry_backoff_s=-1", "rollout.retry_backoff_s must be >= 0"),
    ("sampling.top_k=0", "sampling.top_k must be -1 or >= 1"),
    ("sampling.stop_token_ids=1,x", "sampling.stop_token_ids must be a list of integers"),
    ("optimizer.min_lr=1", "optimizer.min_lr must be in [0, lr]"),
    ("model.preset=tiny_moe", "exactly one must be set"),
    ("checkpoint.keep_last=-1", "checkpoint.keep_last must be >= 0"),
    ("parallel.ep=4", "parallel.ep (times etp = 1) must divide tp * cp * dp = 2 (raise parallel.dp), got 4"),
    ("gspo.routing_replay=r2", "gspo.routing_replay must be one of off, old, rollout"),
])
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ValueError) as err:
        load_config(TINY, [override])
    assert message in str(err.value)


@pytest.mark.parametrize("override, suggestion", [
    ("gspo.eps_lo=1", "'gspo.eps_low'"),
    ("eps_low=1", "'gspo.eps_low'"),            # right name, wrong section
    ("num_step=3", "'num_steps'"),
    ("optimiser.lr=1", "'optimizer'"),
])
def test_unknown_keys_suggest_the_nearest(override, suggestion):
    with pytest.raises(ValueError, match="unknown config key") as err:
        load_config(TINY, [override])
    assert f"did you mean {suggestion}" in str(err.value)


def test_unknown_yaml_key_rejected(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: tiny_dense}\nrollout: {backend: megatron, max_new_token: 5}\n")
    with pytest.raises(ValueError, match="'rollout.max_new_token'; did you mean 'sampling.max_new_tokens'"):
        load_config(path)


@pytest.mark.parametrize("text, message", [
    # "seed" indented under a scalar: YAML sees "5 seed" as one value, then a colon it cannot place
    ("model: {preset: tiny_dense}\nnum_steps: 5\n  seed: 3\n", r"c\.yaml, line 3, column 7: invalid YAML: "
                                                               r"mapping values are not allowed here$"),
    ("data: {train: [a.jsonl, b.jsonl}\n", r"c\.yaml, line 1, column 32: invalid YAML: expected ',' or '\]', "
                                           r"but got '}' \(while parsing a flow sequence at line 1, column 15\)$"),
    ("gspo:\n\tnum_minibatches: 2\n", r"c\.yaml, line 2, column 1: invalid YAML: found character '\\t' that "
                                      r"cannot start any token$"),
    ("seed: 1\nnum_steps: \x00\n", r"c\.yaml, line 2, column 12: invalid YAML: character '\\x00' is not allowed$"),
])
def test_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_config(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("num_steps: 5\nseed: 1\nnum_steps: 7\n", "key 'num_steps' is given twice, at line 1 and at line 3"),
    ("model: {preset: tiny_dense}\ngspo:\n  eps_low: 1.0e-4\n  group_size: 4\n  eps_low: 2.0e-4\n",
     "key 'gspo.eps_low' is given twice, at line 3 and at line 5"),
    ("eval:\n  datasets: {a: x.jsonl, a: y.jsonl}\n", r"key 'eval.datasets.a' is given twice, at line 2 and at line 2"),
    ("model:\n  preset: tiny_dense\nrollout:\n  backend: megatron\nmodel:\n  dtype: float32\n",
     "key 'model' is given twice, at line 1 and at line 5"),
])
def test_yaml_key_given_twice_is_refused(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: {message} \(remove one\)$"):
        load_config(path)


def test_yaml_merge_key_may_be_overridden(tmp_path):
    # A key merged in with << and given again in the mapping it is merged into is YAML's override, not a duplicate.
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: tiny_dense}\nrollout: {backend: megatron}\n"
                    "sampling: {<<: {temperature: 0.5, top_p: 0.9}, temperature: 0.7}\n")
    sampling = load_config(path).sampling
    assert (sampling.temperature, sampling.top_p) == (0.7, 0.9)


def test_malformed_override():
    with pytest.raises(ValueError, match="key.sub=value"):
        load_config(TINY, ["num_steps"])
    with pytest.raises(ValueError, match="is a section"):
        load_config(TINY, ["gspo=1"])


def test_sglang_backend_needs_hf_weights(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: tiny_dense}\n")
    with pytest.raises(ValueError, match="model.hf_path is required with rollout.backend=sglang"):
        load_config(path)
    assert load_config(path, ["rollout.backend=megatron"]).model.preset == "tiny_dense"


def test_frozen_and_round_trips_through_yaml(tmp_path):
    config = load_config(TINY, ["gspo.eps_low=1e-4", "rollout.server_urls=http://x:1"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_steps = 3
    dump_yaml(config, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == config


def test_final_export_needs_a_checkpoint_and_hf_files(tmp_path):
    with pytest.raises(ValueError, match="checkpoint.export_hf.*needs checkpoint.dir"):
        load_config(TINY, [f"checkpoint.export_hf={tmp_path / 'out'}", "checkpoint.dir=none"])
    with pytest.raises(ValueError, match="checkpoint.export_hf.*needs model.hf_path"):
        load_config(TINY, [f"checkpoint.export_hf={tmp_path / 'out'}", "model.hf_path=none",
                           "rollout.backend=megatron", "model.preset=tiny_dense"])
    config = load_config(TINY, [f"checkpoint.export_hf={tmp_path / 'out'}"])
    assert config.checkpoint.export_hf == str(tmp_path / "out")


def test_correction_rules():
    assert not load_config(TINY).correction.active                     # off by default
    config = load_config(TINY, ["correction.weight=geometric", "correction.reject_band=[0.8, 1.25]"])
    assert config.correction.weight == "geometric" and config.correction.reject_band == (0.8, 1.25)
    for bad, message in [("correction.reject_band=[2, 0.5]", "correction.reject_band must be \\[low, high\\] with 0 < low < high"),
                         ("correction.reject_band=[0, 2]", "0 < low < high"),
                         ("correction.weight_cap=0", "correction.weight_cap must be > 0")]:
        with pytest.raises(ValueError, match=message):
            load_config(TINY, [bad])
    with pytest.raises(ValueError, match="correction.weight and correction.reject need gspo.old_logprobs=recompute"):
        load_config(TINY, ["gspo.old_logprobs=rollout", "correction.reject=token"])
    overlap = ["rollout.max_staleness=1"]
    with pytest.raises(ValueError, match="rollout.max_staleness > 0 needs gspo.old_logprobs=rollout"):
        load_config(TINY, overlap)                                      # recompute without a correction
    assert load_config(TINY, [*overlap, "correction.weight=token"]).rollout.max_staleness == 1


def test_recompute_mode_only_with_recompute():
    assert load_config(TINY, ["gspo.old_logprobs=rollout"]).gspo.recompute == "auto"
    with pytest.raises(ValueError, match="gspo.recompute applies to gspo.old_logprobs=recompute only"):
        load_config(TINY, ["gspo.old_logprobs=rollout", "gspo.recompute=per_minibatch"])


@pytest.mark.parametrize("old, new", [("gspo.temperature", "sampling.temperature"), ("rollout.top_k", "sampling.top_k"),
                                      ("rollout.max_new_tokens", "sampling.max_new_tokens"),
                                      ("rollout.top_p", "sampling.top_p")])
def test_keys_that_moved_name_their_home(tmp_path, old, new):
    with pytest.raises(ValueError, match=f"unknown config key '{old}'; did you mean '{new}'"):
        load_config(TINY, [f"{old}=0.5"])
    section, leaf = old.split(".")
    path = tmp_path / "old.yaml"                             # YAML written with the older keys
    path.write_text(f"model: {{hf_path: x}}\n{section}: {{{leaf}: 0.5}}\n")
    with pytest.raises(ValueError, match=f"unknown config key '{old}'; did you mean '{new}'"):
        load_config(path)


def test_megatron_backend_sampling_rules(tmp_path):
    base = ["model.hf_path=none", "model.preset=tiny_dense", "rollout.backend=megatron", f"logging.run_dir={tmp_path}"]
    with pytest.raises(ValueError, match="sampling.top_p < 1 needs sampling.top_k >= 1"):
        preflight(load_config(TINY, [*base, "sampling.top_p=0.9"]))
    with pytest.raises(ValueError, match="sampling.stop is not supported by rollout.backend=megatron"):
        preflight(load_config(TINY, [*base, "sampling.stop=</s>"]))
    # past the sampler's rules, preflight stops at the next one: a preset has no tokenizer
    with pytest.raises(ValueError, match="model.hf_path is required to train"):
        preflight(load_config(TINY, [*base, "sampling.top_p=0.9", "sampling.top_k=20"]))


def test_old_routing_replay_needs_recomputed_old_logprobs():
    with pytest.raises(ValueError, match="gspo.routing_replay must not be old with gspo.old_logprobs=rollout"):
        load_config(TINY, ["gspo.old_logprobs=rollout", "gspo.routing_replay=old"])
    assert load_config(TINY, ["gspo.old_logprobs=rollout", "gspo.routing_replay=rollout"]).gspo.routing_replay == "rollout"


def test_yaml_off_is_the_word_off(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {preset: tiny_moe}\nrollout: {backend: megatron}\ngspo: {routing_replay: off}\n")
    assert load_config(path).gspo.routing_replay == "off"


def test_overlapped_rollouts_need_sglang_and_rollout_logprobs():
    with pytest.raises(ValueError, match="rollout.max_staleness must be 0 with rollout.backend=megatron"):
        load_config(EXAMPLES / "tiny_moe_cpu.yaml", ["rollout.backend=megatron", "rollout.max_staleness=1"])
    with pytest.raises(ValueError, match="rollout.max_staleness > 0 needs gspo.old_logprobs=rollout"):
        load_config(TINY, ["rollout.max_staleness=1"])
    config = load_config(TINY, ["rollout.max_staleness=1", "gspo.old_logprobs=rollout"])
    assert config.rollout.max_staleness == 1 and config.rollout.partial_rollout is False


def test_partial_rollouts_need_overlap_and_no_rollout_routing():
    overlap = ["rollout.max_staleness=1", "gspo.old_logprobs=rollout"]
    assert load_config(TINY, [*overlap, "rollout.partial_rollout=true"]).rollout.partial_rollout is True
    with pytest.raises(ValueError, match="rollout.partial_rollout needs rollout.max_staleness > 0"):
        load_config(TINY, ["rollout.partial_rollout=true"])
    with pytest.raises(ValueError, match="rollout.partial_rollout is not yet supported with gspo.routing_replay=rollout"):
        load_config(TINY, [*overlap, "rollout.partial_rollout=true", "gspo.routing_replay=rollout"])


def test_packed_rows_rules():
    assert load_config(TINY, ["parallel.pack_sequences=true"]).parallel.pack_sequences is True
    with pytest.raises(ValueError, match="parallel.pack_sequences needs pp = 1"):
        load_config(TINY, ["parallel.pack_sequences=true", "parallel.pp=2", "parallel.tp=1"])
    both = load_config(TINY, ["parallel.pack_sequences=true", "gspo.routing_replay=old"])  # tested together
    assert both.parallel.pack_sequences and both.gspo.routing_replay == "old"
