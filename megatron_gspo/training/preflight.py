"""Checks that need the file system or the package's registries, run before any work starts
(config.py checks values only and knows nothing of the package).

`preflight` also opens the training and eval datasets (data/): a bad file, a missing key on row N or
an empty dataset is an error naming them before any process group starts, and the opened datasets
are what the run uses.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from megatron_gspo.config import RewardConfig, TrainConfig
from megatron_gspo.convert.hf_config import shape_of
from megatron_gspo.data import PromptDataset, open_prompt_dataset
from megatron_gspo.model.gpt import check_layout
from megatron_gspo.model.presets import PRESETS
from megatron_gspo.paths import relative_path_note
from megatron_gspo.rewards.verifiers import BOUNDED, load_reward_fn
from megatron_gspo.rollout.agent.episode import load_episode_fn
from megatron_gspo.rollout.agent.tools import tool_schemas
from megatron_gspo.rollout.megatron.sampling import check_sampling
from megatron_gspo.rollout.sglang.backend import SGLANG_CONTEXT_RESERVE, model_context_length
from megatron_gspo.rollout.sglang.server import check_sglang_python, default_sglang_python
from megatron_gspo.samples import Prompt
from megatron_gspo.rollout.sglang.weight_sync import check_disk_sync_folder
from megatron_gspo.training.checkpoint import find_latest


@dataclass
class Prepared:
    """What preflight opened: the run uses these."""

    tokenizer: object
    dataset: PromptDataset
    """The training prompts (data.train)."""
    eval_sets: dict[str, list[Prompt]]
    """eval.datasets: name -> the prompts evaluated (the first eval.max_prompts)."""
    tools: list[dict]
    """The JSON schemas of rollout.tools (rendered into every prompt); [] without tools."""


def _writable(path: str, name: str) -> None:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".write_test.{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{name}: cannot write to {path!r} ({e.strerror or e})") from None


def preflight(config: TrainConfig) -> Prepared:
    """Raise ValueError naming the setting when a path the run needs is missing or not writable, a
    named preset or reward function does not exist (or cannot have its time limit, `check_reward`), the
    parallel layout cannot split the model (model.gpt.check_layout), or a dataset is bad (data.DataError);
    else the opened datasets."""
    model = config.model
    if model.preset is not None and model.preset not in PRESETS:
        raise ValueError(f"model.preset must be one of {sorted(PRESETS)}, got {model.preset!r}")
    if config.rollout.backend == "megatron":
        check_sampling(config.sampling)
        if config.eval.datasets and config.eval.temperature <= 0:
            raise ValueError(f"eval.temperature must be > 0 with rollout.backend=megatron, got {config.eval.temperature}")
    if model.hf_path is None:
        raise ValueError("model.hf_path is required to train: the prompts need its tokenizer "
                         f"(model.preset={model.preset!r} gives a model shape only)")
    if not (Path(model.hf_path) / "config.json").is_file():
        raise ValueError(f"model.hf_path: no Hugging Face model at {model.hf_path!r} (config.json not found)"
                         f"{relative_path_note(model.hf_path)}")
    shape, name = shape_of(model.preset, model.hf_path), model.preset or model.hf_path
    try:
        check_layout(shape, config.parallel)
    except ValueError as e:
        raise ValueError(f"the parallel layout does not fit the model ({name}): {e}") from None
    gspo = config.gspo
    if gspo.routing_replay != "off" and not shape.is_moe:
        raise ValueError(f"gspo.routing_replay={gspo.routing_replay}: the model is dense ({name} has no MoE "
                         "routers); use off")
    if gspo.recompute == "fused" and shape.is_moe:
        raise ValueError(f"gspo.recompute=fused: {name} is an MoE model, whose routing is recorded per "
                         "micro-batch while recomputing; use per_minibatch (or auto)")
    if config.parallel.pack_sequences and torch.cuda.is_available():
        raise ValueError("parallel.pack_sequences=true needs the local attention spec (CPU): on GPU the model "
                         "uses Transformer Engine attention, whose packed format (THD) is not wired here")
    if model.init_checkpoint is not None and not (Path(model.init_checkpoint) / "metadata.json").is_file():
        raise ValueError(f"model.init_checkpoint: no Megatron distributed checkpoint at {model.init_checkpoint!r} "
                         f"(metadata.json not found){relative_path_note(model.init_checkpoint)}")
    if config.checkpoint.dir is not None:
        _writable(config.checkpoint.dir, "checkpoint.dir")
    _writable(config.logging.run_dir, "logging.run_dir")
    if config.checkpoint.export_hf is not None:
        _writable(str(Path(config.checkpoint.export_hf).resolve().parent), "checkpoint.export_hf")
    try:
        if config.rollout.backend == "sglang" and not config.rollout.server_urls:
            check_sglang_python(default_sglang_python())
    except ValueError as e:
        raise ValueError(f"rollout.backend=sglang launches SGLang servers: {e}") from None
    try:
        if config.rollout.weight_sync == "disk":
            check_disk_sync_folder(Path(config.logging.run_dir) / "weights")  # the folder SGLangBackend syncs
    except ValueError as e:
        raise ValueError(f"logging.run_dir (rollout.weight_sync=disk): {e}") from None
    if not config.data.train:
        raise ValueError("data.train is required to train: a .jsonl/.parquet prompt file or a save_to_disk "
                         "directory (see README, 'Train on your own data')")
    check_reward(config.reward)
    if config.rollout.episode_fn is not None:
        load_episode_fn(config.rollout.episode_fn)
    if config.rollout.episodes and config.rollout.max_context_tokens is not None:
        most = model_context_length(model.hf_path) - SGLANG_CONTEXT_RESERVE
        if config.rollout.max_context_tokens > most:
            raise ValueError(f"rollout.max_context_tokens={config.rollout.max_context_tokens} is more than SGLang "
                             f"serves {name}: at most its max_position_embeddings less {SGLANG_CONTEXT_RESERVE} = {most}")
    prepared = open_datasets(config)
    if config.rollout.tools:
        check_tool_template(prepared.tokenizer, prepared.tools, config.data.chat_template_kwargs)
    return prepared


def check_reward(reward: RewardConfig) -> None:
    """ValueError when reward.fn cannot be loaded, or when reward.workers=0 (scoring in the trainer's
    thread, where reward.timeout_s cannot be enforced) is asked of a function not known to be bounded
    (rewards/verifiers.py BOUNDED): one response on which it hangs would stall the run, silently."""
    try:
        load_reward_fn(reward.fn)
    except ValueError as e:
        raise ValueError(f"reward.fn: {e}") from None
    if reward.workers == 0 and reward.fn not in BOUNDED:
        why = ("math-verify can run forever on a short hostile response such as \\boxed{9^{9^{9^{9}}}}"
               if reward.fn == "math" else "a user function may hang, and nothing could stop it")
        raise ValueError(f"reward.workers=0 scores in the trainer's thread, where reward.timeout_s cannot be enforced, "
                         f"and reward.fn={reward.fn} is not known to finish ({why}): set reward.workers to 1 or more "
                         f"(worker processes, killed past reward.timeout_s); workers=0 is only for "
                         f"{', '.join(sorted(BOUNDED))}")


def nothing_to_do(config: TrainConfig) -> str | None:
    """What to tell the user when the run would resume at or past num_steps (the latest checkpoint of
    checkpoint.dir, training/checkpoint.py find_latest), before anything starts; else None. A final export
    (checkpoint.export_hf) not yet written is still to do."""
    c = config.checkpoint
    if not (c.dir and c.resume) or (c.export_hf is not None and not Path(c.export_hf).exists()):
        return None
    step = find_latest(c.dir)
    if step is None or step < config.num_steps:
        return None
    return (f"nothing to do: the latest checkpoint in checkpoint.dir={c.dir} is at step {step} and "
            f"num_steps={config.num_steps} (raise num_steps to train on)")


def open_datasets(config: TrainConfig) -> Prepared:
    """The tokenizer of model.hf_path, the training prompts and the eval prompts (with rollout.tools rendered
    into them)."""
    tokenizer = AutoTokenizer.from_pretrained(config.model.hf_path)
    tools = tool_schemas(config.rollout.tools) if config.rollout.tools else []
    dataset = open_prompt_dataset(config.data.train, config.data, tokenizer, seed=config.seed, tools=tools)
    eval_sets = {name: open_prompt_dataset([path], config.data, tokenizer, seed=config.seed, tools=tools,
                                           field=f"eval.datasets.{name}").eval_prompts(config.eval.max_prompts)
                 for name, path in config.eval.datasets.items()}
    return Prepared(tokenizer, dataset, eval_sets, tools)


def check_tool_template(tokenizer, tools: list[dict], template_kwargs: dict) -> None:
    """ValueError unless the chat template renders the tools and a `tool` message (a template without them
    would drop both silently: the model would never see a tool or its result)."""
    name = tools[0]["function"]["name"]
    user = [{"role": "user", "content": "?"}]
    render = lambda messages, **kw: tokenizer.apply_chat_template(messages, tokenize=False, **kw,  # noqa: E731
                                                                 **template_kwargs)
    if render(user, tools=tools) == render(user) or name not in render(user, tools=tools):
        raise ValueError(f"rollout.tools: the chat template of model.hf_path does not render tools (apply_chat_template "
                         f"with tools= leaves out {name!r}): use a tokenizer whose template has tools")
    probe = "\u2063tool result\u2063"
    try:
        text = render([*user, {"role": "assistant", "content": "!"}, {"role": "tool", "name": name, "content": probe}])
    except Exception as e:
        raise ValueError(f"rollout.tools: the chat template of model.hf_path cannot render a tool message "
                         f"({type(e).__name__}: {e})") from None
    if probe not in text:
        raise ValueError("rollout.tools: the chat template of model.hf_path leaves out a tool message's content: the "
                         "model would never see a tool's result")
