"""Missing model paths and unwritable directories fail before work starts, naming the setting."""
import os
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.data import DataError, write_arithmetic_data
from megatron_gspo.training.preflight import check_reward, preflight
from tests.tiny_hf import fake_hf_dir, make_config

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path, *overrides):
    train, test = write_arithmetic_data(tmp_path / "data")
    return load_config(None, [f"model.hf_path={tmp_path / 'hf'}", f"logging.run_dir={tmp_path / 'run'}",
                              f"data.train={train}", f"eval.datasets.held_out={test}", *overrides])


@pytest.fixture(autouse=True)
def sglang_python(monkeypatch):
    """The default rollout backend launches SGLang: any existing interpreter passes preflight's check."""
    monkeypatch.setenv("MEGATRON_GSPO_SGLANG_PYTHON", sys.executable)


def test_ok(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    prepared = preflight(config(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}", "eval.max_prompts=4"))
    assert (tmp_path / "ckpt").is_dir() and not list((tmp_path / "ckpt").iterdir())
    assert len(prepared.dataset) == 45 and len(prepared.eval_sets["held_out"]) == 4
    first = prepared.eval_sets["held_out"][0]  # "a+b" as a chat message, rendered by the tiny template
    assert first.prompt.endswith("=") and prepared.tokenizer.decode(first.prompt_ids) == first.prompt


def test_data_and_reward_errors_come_before_any_work(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    with pytest.raises(ValueError, match="data.train is required"):
        preflight(load_config(None, [f"model.hf_path={tmp_path / 'hf'}", f"logging.run_dir={tmp_path / 'run'}"]))
    with pytest.raises(ValueError, match="reward.fn: .*no_such_module"):
        preflight(config(tmp_path, "reward.fn=no_such_module:score"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl.*row 1.*answer"):
        preflight(config(tmp_path, f"eval.datasets.broken={bad}"))
    with pytest.raises(ValueError, match="eval.temperature must be > 0 with rollout.backend=megatron"):
        preflight(config(tmp_path, "rollout.backend=megatron", "eval.temperature=0"))


def test_reward_workers_0_only_for_functions_known_to_finish(tmp_path):
    # No time limit can be enforced in the trainer's thread: a user function or math there is refused, naming
    # both settings and what to do, instead of a run that may hang silently.
    fake_hf_dir(tmp_path / "hf")
    with pytest.raises(ValueError, match=r"reward.workers=0 .*reward.timeout_s cannot be enforced.* "
                                         r"reward.fn=tests.unit.reward_fns:hang_on_hang is not known to finish .*"
                                         r"set reward.workers to 1 or more"):
        preflight(config(tmp_path, "reward.fn=tests.unit.reward_fns:hang_on_hang", "reward.workers=0"))
    with pytest.raises(ValueError, match=r"reward.workers=0 .*reward.fn=math is not known to finish \(math-verify "
                                         r"can run forever .*\\boxed\{9\^\{9\^\{9\^\{9\}\}\}\}\): set reward.workers"):
        preflight(config(tmp_path, "reward.fn=math", "reward.workers=0"))
    preflight(config(tmp_path, "reward.fn=tests.unit.reward_fns:hang_on_hang", "reward.workers=1"))
    # The demos score with bounded built-ins in the trainer's thread, and keep doing so.
    for demo, fn in (("tiny_cpu.yaml", "exact_match"), ("tiny_long_cpu.yaml", "final_answer")):
        reward = load_config(str(REPO / "examples" / demo), []).reward
        assert (reward.fn, reward.workers) == (fn, 0)
        check_reward(reward)


def test_missing_model(tmp_path):
    with pytest.raises(ValueError, match="model.hf_path: no Hugging Face model at .*config.json not found"):
        preflight(config(tmp_path))


def test_missing_init_checkpoint(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    with pytest.raises(ValueError, match="model.init_checkpoint: no Megatron distributed checkpoint"):
        preflight(config(tmp_path, f"model.init_checkpoint={tmp_path / 'nope'}"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_unwritable_checkpoint_dir(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="checkpoint.dir: cannot write to"):
        preflight(config(tmp_path, f"checkpoint.dir={locked / 'ckpt'}"))


def test_checkpoint_dir_under_a_file(tmp_path):
    # Works as root too: a path below a regular file cannot be created.
    fake_hf_dir(tmp_path / "hf")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="checkpoint.dir: cannot write to"):
        preflight(config(tmp_path, f"checkpoint.dir={tmp_path / 'file' / 'ckpt'}"))


def test_export_under_a_file(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="checkpoint.export_hf: cannot write to"):
        preflight(config(tmp_path, f"checkpoint.dir={tmp_path / 'ckpt'}",
                         f"checkpoint.export_hf={tmp_path / 'file' / 'hf_final'}"))


def test_unknown_preset_is_named(tmp_path):
    bad_preset = load_config(None, ["model.preset=tiny_large", "rollout.backend=megatron",
                                    f"logging.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="model.preset must be one of .*got 'tiny_large'"):
        preflight(bad_preset)


def test_routing_replay_on_a_dense_model_names_the_field(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    dense = make_config("dense_tied")
    dense.architectures = ["Qwen3ForCausalLM"]
    dense.save_pretrained(tmp_path / "hf")  # a dense Qwen3 config.json
    with pytest.raises(ValueError, match="gspo.routing_replay=old: the model is dense"):
        preflight(config(tmp_path, "gspo.routing_replay=old"))


def test_missing_sglang_python_is_named_before_any_process_starts(tmp_path, monkeypatch):
    fake_hf_dir(tmp_path / "hf")
    monkeypatch.setenv("MEGATRON_GSPO_SGLANG_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(ValueError, match=r"no-venv/bin/python.*scripts/setup_sglang.sh"):
        preflight(config(tmp_path))
    preflight(config(tmp_path, "rollout.server_urls=[http://127.0.0.1:1]"))  # servers given: nothing to launch


def test_run_dir_with_glob_characters_is_refused_for_disk_sync(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    base = config(tmp_path)
    overrides = [f"model.hf_path={tmp_path / 'hf'}", f"data.train={base.data.train[0]}"]
    with pytest.raises(ValueError, match=r"logging.run_dir.*glob character"):
        preflight(load_config(None, [*overrides, f"logging.run_dir={tmp_path / 'run[1]'}"]))
    preflight(load_config(None, [*overrides, f"logging.run_dir={tmp_path / 'run[1]'}", "rollout.weight_sync=broadcast"]))


@pytest.mark.parametrize("layout, message", [
    # fake_hf_dir's tiny Qwen3: 4 attention heads, 2 KV heads, intermediate_size 128, 2 layers
    (["parallel.tp=3"], r"parallel.tp=3 must divide num_attention_heads=4; parallel.tp=3 must divide "
                        r"num_key_value_heads=2 \(on CPU\); parallel.tp=3 must divide intermediate_size=128$"),
    (["parallel.tp=4"], r"parallel.tp=4 must divide num_key_value_heads=2 \(on CPU\)$"),
    (["parallel.pp=4"], r"parallel.pp=4 must divide num_hidden_layers=2$"),
    (["parallel.pp=2", "parallel.vpp=2"], r"parallel.vpp=2 must divide the 1 layers of each of the pp=2 stages"),
    (["parallel.ep=2", "parallel.dp=2"], r"parallel.ep=2 needs an MoE model \(this one is dense\)"),
])
def test_layout_that_cannot_split_the_model_names_keys_and_values(tmp_path, layout, message):
    fake_hf_dir(tmp_path / "hf")
    fits = rf"the parallel layout does not fit the model \({tmp_path / 'hf'}\): "
    with pytest.raises(ValueError, match=fits + message):
        preflight(config(tmp_path, *layout))


def test_layout_is_checked_against_the_hf_config_and_moe_experts(tmp_path):
    fake_hf_dir(tmp_path / "hf")
    moe = make_config("moe")  # 4 experts, moe_intermediate_size 48, 4 layers
    moe.architectures = ["Qwen3MoeForCausalLM"]
    moe.save_pretrained(tmp_path / "hf")
    hf = str(tmp_path / "hf")
    with pytest.raises(ValueError, match=rf"does not fit the model \({hf}\): parallel.ep=8 must divide num_experts=4$"):
        preflight(config(tmp_path, "parallel.ep=8", "parallel.dp=8"))
    with pytest.raises(ValueError, match=r"the expert tensor parallel size 5 \(parallel.etp=5, parallel.tp=1\) must "
                                         r"divide moe_intermediate_size=48"):
        preflight(config(tmp_path, "parallel.etp=5", "parallel.dp=5"))
    preflight(config(tmp_path, "parallel.tp=2", "parallel.ep=2", "parallel.pp=2", "parallel.vpp=2"))  # fits


def test_a_missing_relative_path_says_it_was_looked_for_in_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_hf_dir(tmp_path / "hf")
    note = rf"; relative paths are resolved against the working directory, {tmp_path}$"
    with pytest.raises(ValueError, match=r"model.hf_path: no Hugging Face model at 'models/hf' \(config.json not "
                                         r"found\)" + note):
        preflight(config(tmp_path, "model.hf_path=models/hf"))
    with pytest.raises(ValueError, match=r"model.init_checkpoint: no Megatron distributed checkpoint at 'ckpt/init' "
                                         r"\(metadata.json not found\)" + note):
        preflight(config(tmp_path, "model.init_checkpoint=ckpt/init"))
    with pytest.raises(DataError, match=r"eval.datasets.more: data/more.jsonl: no such file or directory" + note):
        preflight(config(tmp_path, "eval.datasets.more=data/more.jsonl"))
    # absolute paths, and relative ones that exist (here: hf without config.json), get no note
    with pytest.raises(DataError, match=rf"{tmp_path / 'more.jsonl'}: no such file or directory$"):
        preflight(config(tmp_path, f"eval.datasets.more={tmp_path / 'more.jsonl'}"))
    (tmp_path / "hf" / "config.json").unlink()
    with pytest.raises(ValueError, match=r"no Hugging Face model at 'hf' \(config.json not found\)$"):
        preflight(config(tmp_path, "model.hf_path=hf"))


def test_resuming_at_or_past_num_steps_says_there_is_nothing_to_do_and_starts_nothing(tmp_path, capsys, monkeypatch):
    from megatron_gspo import cli
    from megatron_gspo.training import launch, preflight as preflight_module

    fake_hf_dir(tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000005").mkdir(parents=True)  # a complete checkpoint of step 5, the latest
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    (ckpt / "iter_0000009.tmp").mkdir()  # an unfinished save: not a checkpoint
    base = config(tmp_path)
    args = ["train", str(REPO / "examples/tiny_cpu.yaml"), f"model.hf_path={tmp_path / 'hf'}",
            f"logging.run_dir={tmp_path / 'run'}", f"data.train={base.data.train[0]}", f"checkpoint.dir={ckpt}"]

    def started(*_, **__):
        raise AssertionError("nothing may start")
    monkeypatch.setattr(preflight_module, "open_datasets", started)  # preflight's last, slowest part
    monkeypatch.setattr(launch, "run_torchrun", started)
    assert cli.main([*args, "num_steps=5"]) == 0
    assert capsys.readouterr().out == (f"megatron-gspo train: nothing to do: the latest checkpoint in checkpoint.dir="
                                       f"{ckpt} is at step 5 and num_steps=5 (raise num_steps to train on)\n")
    assert cli.main([*args, "num_steps=3"]) == 0
    assert "is at step 5 and num_steps=3" in capsys.readouterr().out
    # still something to do: more steps, no resume, or the final export not yet written
    for more in (["num_steps=6"], ["num_steps=5", "checkpoint.resume=false"],
                 ["num_steps=5", f"checkpoint.export_hf={tmp_path / 'final'}"]):
        with pytest.raises(AssertionError, match="nothing may start"):
            cli.main([*args, *more])
