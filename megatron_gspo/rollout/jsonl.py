"""JSONL in and out: prompt files (one prompt per line; `read_prompt_file` also reads training data files)
and sample files (one Sample per line).

Every malformed line is an error naming the file and the 1-based line number; nothing is skipped
silently (blank lines are allowed and ignored).

A sample's `routed_experts` array (MoE routing, [P + R - 1, L, k] of uint8 or int16) is written as
`{"dtype": "uint8", "shape": [T, L, k], "data": "<base64 of the C-order little-endian bytes>"}`, not
as nested lists: for Qwen3-30B-A3B that is 512 characters per token instead of ~1,500, and reading it
back gives the same array, dtype included. A multi-turn sample's turns and tool calls are objects with
their fields (samples.Turn, samples.ToolCall).

`write_rollouts` writes what a training step trained on for people to read (logging.save_rollouts,
run_dir/rollouts/step_NNNNNN.jsonl): per sample its prompt, its trajectory as text (special tokens kept),
the ids, loss mask and sampler log-probs, each turn with its text and reward, the tool calls, its reward
and advantage.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from megatron_gspo.config import DataConfig
from megatron_gspo.data import open_prompt_dataset
from megatron_gspo.samples import Prompt, Sample, ToolCall, Turn


class JsonlError(ValueError):
    """A malformed line: the message starts with `file:line:`."""


def _objects(path: str | Path) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise JsonlError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise JsonlError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def _int_list(value, what: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise JsonlError(f"{where}: {what} must be a list of integers")
    return value


def read_prompts(path: str | Path, encode: Callable[[str], list[int]] | None = None) -> list[Prompt]:
    """Lines hold `prompt` (text, tokenized with `encode`) or `prompt_ids`, optionally `answer`.

    group_id is the line's `group_id` if given, else the prompt's position in the file (0, 1, ...).
    """
    prompts = []
    for lineno, obj in _objects(path):
        where = f"{path}:{lineno}"
        text, ids = obj.get("prompt"), obj.get("prompt_ids")
        if ids is not None:
            ids = _int_list(ids, "prompt_ids", where)
        elif isinstance(text, str):
            if encode is None:
                raise JsonlError(f"{where}: text prompt but no tokenizer given (pass one, or use prompt_ids)")
            ids = list(encode(text))
        else:
            raise JsonlError(f"{where}: needs `prompt` (a string) or `prompt_ids` (a list of integers)")
        if not ids:
            raise JsonlError(f"{where}: empty prompt")
        answer = obj.get("answer")
        if answer is not None and not isinstance(answer, (str, int, float)):
            raise JsonlError(f"{where}: answer must be a string or a number")
        group_id = obj.get("group_id", len(prompts))
        if not isinstance(group_id, int) or isinstance(group_id, bool):
            raise JsonlError(f"{where}: group_id must be an integer")
        prompts.append(Prompt(group_id=group_id, prompt_ids=ids, prompt=text if isinstance(text, str) else None,
                              answer=None if answer is None else str(answer)))
    ids = [p.group_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise JsonlError(f"{path}: duplicate group_id values")
    return prompts


def read_prompt_file(path: str | Path, tokenizer=None) -> list[Prompt]:
    """The prompts of `megatron-gspo rollout --prompts`: a prompts JSONL file of {prompt (text) | prompt_ids,
    answer?, group_id?} lines (`read_prompts`; text tokenized as it is), or any file data.train takes, read
    the way training reads it (data/: {role, content} message prompts through the tokenizer's chat template,
    an answer on every row; .parquet and save_to_disk directories too), its prompts in file order."""
    if Path(path).suffix in (".jsonl", ".json") and not any(
            isinstance(obj.get("prompt"), list) for _, obj in _objects(path)):
        encode = None if tokenizer is None else lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        return read_prompts(path, encode)
    if tokenizer is None:
        raise JsonlError(f"{path}: prompts given as messages (or a .parquet / save_to_disk dataset) need a "
                         "tokenizer and its chat template: pass --tokenizer")
    return open_prompt_dataset([str(path)], DataConfig(), tokenizer, field="--prompts").eval_prompts()


_ROUTING_DTYPES = {"uint8": np.dtype("<u1"), "int16": np.dtype("<i2")}
"""The dtypes Sample.routed_experts may have (rollout/sglang/routed_experts.py:routing_dtype), by stored name."""


def _routing_to_json(ids_TLk: np.ndarray, where: str) -> dict:
    ids_TLk = np.asarray(ids_TLk)
    name = ids_TLk.dtype.name
    if name not in _ROUTING_DTYPES or ids_TLk.ndim != 3:
        raise ValueError(f"{where}: routed_experts must be a 3-d uint8 or int16 array, got "
                         f"{name} with shape {ids_TLk.shape}")
    data = np.ascontiguousarray(ids_TLk, dtype=_ROUTING_DTYPES[name]).tobytes()
    return {"dtype": name, "shape": list(ids_TLk.shape), "data": base64.b64encode(data).decode("ascii")}


def _routing_from_json(obj, positions: int, where: str) -> np.ndarray:
    """The array `_routing_to_json` wrote; `positions` = P + R - 1 of the line's ids."""
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "data"}:
        raise JsonlError(f"{where}: routed_experts must be null or {{dtype, shape, data}}")
    dtype, shape = _ROUTING_DTYPES.get(obj["dtype"]) if isinstance(obj["dtype"], str) else None, obj["shape"]
    if dtype is None:
        raise JsonlError(f"{where}: routed_experts dtype {obj['dtype']!r} is not one of {sorted(_ROUTING_DTYPES)}")
    if len(_int_list(shape, "routed_experts shape", where)) != 3 or min(shape) < 0:
        raise JsonlError(f"{where}: routed_experts shape must be 3 non-negative integers, got {shape}")
    if shape[0] != positions:
        raise JsonlError(f"{where}: routed_experts has {shape[0]} positions, but P + R - 1 = {positions}")
    try:
        data = base64.b64decode(obj["data"], validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise JsonlError(f"{where}: routed_experts data is not base64") from None
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise JsonlError(f"{where}: routed_experts data has {len(data)} bytes, shape {shape} of "
                         f"{obj['dtype']} needs {math.prod(shape) * dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(obj["dtype"])  # native order, writable


def write_samples(path: str | Path, samples: Iterable[Sample]) -> int:
    """One JSON object per sample (every Sample field); returns the number written."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for sample in samples:
            row = {field.name: getattr(sample, field.name) for field in fields(sample)}
            row["turns"] = None if sample.turns is None else [asdict(t) for t in sample.turns]
            row["tool_calls"] = [asdict(c) for c in sample.tool_calls]
            if sample.routed_experts is not None:
                row["routed_experts"] = _routing_to_json(
                    sample.routed_experts, f"group {sample.group_id} sample {sample.sample_index}")
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


_REQUIRED = ("group_id", "sample_index", "prompt_ids", "response_ids", "rollout_logprobs", "finish_reason")


def read_samples(path: str | Path) -> list[Sample]:
    known = {f.name for f in fields(Sample)}
    samples = []
    for lineno, obj in _objects(path):
        where = f"{path}:{lineno}"
        missing = [k for k in _REQUIRED if k not in obj]
        if missing:
            raise JsonlError(f"{where}: missing field(s) {', '.join(missing)}")
        unknown = sorted(set(obj) - known)
        if unknown:
            raise JsonlError(f"{where}: unknown field(s) {', '.join(unknown)}")
        _int_list(obj["prompt_ids"], "prompt_ids", where)
        _int_list(obj["response_ids"], "response_ids", where)
        logprobs = obj["rollout_logprobs"]
        if not isinstance(logprobs, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in logprobs):
            raise JsonlError(f"{where}: rollout_logprobs must be a list of finite numbers")
        reward = obj.get("reward")
        if reward is not None and (not isinstance(reward, (int, float)) or not math.isfinite(reward)):
            raise JsonlError(f"{where}: reward must be a finite number or null")
        if obj.get("routed_experts") is not None:
            positions = len(obj["prompt_ids"]) + len(obj["response_ids"]) - 1
            obj["routed_experts"] = _routing_from_json(obj["routed_experts"], positions, where)
        try:
            if obj.get("turns") is not None:
                obj["turns"] = [Turn(**t) for t in obj["turns"]]
            obj["tool_calls"] = [ToolCall(**c) for c in obj.get("tool_calls") or ()]
            samples.append(Sample(**obj))
        except (TypeError, ValueError) as e:
            raise JsonlError(f"{where}: {e}") from None
    return samples


def rollout_record(sample: Sample, advantage, tokenizer, step: int) -> dict:
    """One line of a saved rollout (module doc). `advantage`: the sample's (a number), or per response token
    (gspo_token: a list, written per turn)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    turns = sample.turns if sample.turns is not None else [Turn(0, len(sample.response_ids), sample.finish_reason,
                                                                sample.reward or 0.0)]
    per_token = not isinstance(advantage, (int, float))
    return {"step": step, "group_id": sample.group_id, "sample_index": sample.sample_index,
            "prompt": sample.prompt if sample.prompt is not None else decode(sample.prompt_ids),
            "answer": sample.answer, "trajectory": decode(sample.response_ids),
            "reward": sample.reward,
            "advantage": [advantage[t.start] if t.end > t.start else 0.0 for t in turns] if per_token else advantage,
            "finish_reason": sample.finish_reason, "weight_version": sample.weight_version,
            "turns": [{**asdict(t), "text": decode(sample.response_ids[t.start:t.end])} for t in turns],
            "tool_calls": [asdict(c) for c in sample.tool_calls], "storage": sample.storage,
            "prompt_ids": sample.prompt_ids, "response_ids": sample.response_ids,
            "loss_mask": sample.loss_mask if sample.loss_mask is not None else [1] * len(sample.response_ids),
            "rollout_logprobs": sample.rollout_logprobs}


def write_rollouts(path: str | Path, samples: Sequence[Sample], advantages: Sequence, tokenizer, step: int) -> Path:
    """The trained samples of rollout step `step` with their advantages, one `rollout_record` per line
    (written under a temporary name, then renamed: a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as f:
        for sample, advantage in zip(samples, advantages, strict=True):
            f.write(json.dumps(rollout_record(sample, advantage, tokenizer, step), ensure_ascii=False, default=repr)
                    + "\n")
    partial.replace(path)
    return path
