"""Hugging Face Qwen3 / Qwen3-MoE safetensors -> Megatron-Core torch_dist checkpoint, streaming.

Output layout (Megatron-LM's): OUT/release/ holds the checkpoint and OUT/latest_checkpointed_iteration.txt
says "release". Everything is written into a temporary sibling of OUT and renamed to OUT only when
complete, so an interrupted run never leaves a directory that looks like a finished checkpoint.

Global (unsharded) shapes are stored, so `dist_checkpointing.load` reads the checkpoint into any
TP/EP/PP layout. The vocabulary is stored unpadded ([vocab_size, H]): Megatron marks the embedding
and output layer `allow_shape_mismatch` (tensor_parallel/layers.py:317, language_module.py:302) and
loads a smaller stored tensor into its zero-initialised padded one, so the padding rows come out 0.

Memory: Megatron tensors (one layer's fused QKV, one expert's fc1) are built from their HF tensors
one at a time, a little ahead of the writer (dcp_io.StreamingDcpWriter). torch's DCP writer keeps
a data file's tensors until the file is complete, so data files are cut at `group_bytes` (512 MB):
the peak is about max(group_bytes, the largest tensor) plus that tensor's HF parts, whatever the
model's size. Tensors stored in the HF file as Megatron stores them (every expert's fc1, as gate
and up are stored back to back, fc2, norms, embeddings) are not copied at all: they are mapped
from the safetensors file and written from the page cache (safetensors_io.SafetensorsReader.map).
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_gspo.convert import mapping
from megatron_gspo.convert.dcp_io import StreamingDcpWriter
from megatron_gspo.convert.hf_config import read_hf_config
from megatron_gspo.convert.mapping import Item, Layout
from megatron_gspo.convert.safetensors_io import SafetensorsReader
from megatron_gspo.model.gpt import Qwen3Shape

CHECKPOINT_DIR = "release"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
GROUP_BYTES = 512 << 20


@contextmanager
def staged_output(out: str | Path):
    """A temporary directory next to `out`, renamed to `out` if the block succeeds, removed if not."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"output directory {out} already exists; refusing to overwrite it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.incomplete-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_hf_tensors(shape: Qwen3Shape, reader: SafetensorsReader, hf_dir) -> None:
    """Every tensor the table expects is present with its shape, and nothing else is."""
    expected = {}
    for item in mapping.items(shape):
        expected.update(zip(item.hf_names, mapping.hf_shapes(shape, item)))
    missing = [n for n in expected if n not in reader.tensors]
    if missing:
        raise ValueError(f"{hf_dir}: tensor {missing[0]!r} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, want in expected.items():
        got = reader.tensors[name].shape
        if got != want:
            raise ValueError(f"{hf_dir}: tensor {name!r} has shape {got}, the config implies {want}")
    # Some tied checkpoints also store the (shared) output weight; Megatron has no place for it.
    redundant = {mapping.OUTPUT_ENTRY.hf[0]} if shape.tie_word_embeddings else set()
    unexpected = sorted(set(reader.tensors) - set(expected) - redundant)
    if unexpected:
        raise ValueError(f"{hf_dir}: tensor {unexpected[0]!r} has no place in the Megatron model"
                         + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""))
    dtypes = {reader.tensors[n].dtype for n in expected}
    if len(dtypes) > 1:
        raise ValueError(f"{hf_dir}: mixed dtypes {sorted(map(str, dtypes))}; expected one")


def convert_hf_to_mcore(hf_dir: str | Path, out: str | Path, *, group_bytes: int = GROUP_BYTES,
                        progress: bool = True) -> Qwen3Shape:
    """Convert the HF checkpoint in `hf_dir` into a torch_dist checkpoint at `out` (must not exist).

    group_bytes: the size of one data file (a larger tensor gets a file of its own); torch's DCP
        writer holds a file's tensors until the file is done, so this bounds the memory.
    Returns the model's shape. All checks (config, tensor names, shapes, file integrity) run
    before anything is written.
    """
    hf_dir = Path(hf_dir)
    shape = read_hf_config(hf_dir)
    reader = SafetensorsReader(hf_dir)
    check_hf_tensors(shape, reader, hf_dir)
    requests = [(item, _tensor_request(shape, reader, item)) for item in mapping.items(shape)]
    total = sum(_nbytes(request) for _, request in requests)
    with staged_output(out) as staging:
        writer = StreamingDcpWriter(staging / CHECKPOINT_DIR)
        with tqdm(total=total, desc="hf->mcore", unit="B", unit_scale=True, disable=not progress) as bar:
            for group in _groups(requests, group_bytes):
                writer.write_group([request for _, request in group],
                                   [(_object_key(shape, item), [None]) for item, _ in group if item.entry.extra_state])
                bar.update(sum(_nbytes(request) for _, request in group))
        writer.finish()
        (staging / TRACKER_FILE).write_text(CHECKPOINT_DIR)
    return shape


def _nbytes(request) -> int:
    _, _, _, sizes, dtype, _ = request
    return torch.Size(sizes).numel() * dtype.itemsize


def _groups(requests, group_bytes: int):
    """Consecutive runs of requests of at most group_bytes each (a larger one alone)."""
    group, size = [], 0
    for entry in requests:
        nbytes = _nbytes(entry[1])
        if group and size + nbytes > group_bytes:
            yield group
            group, size = [], 0
        group.append(entry)
        size += nbytes
    if group:
        yield group


def _tensor_request(shape: Qwen3Shape, reader: SafetensorsReader, item: Item):
    names = item.hf_names
    infos = [reader.tensors[n] for n in names]
    fused_shape = mapping.fused_shape(shape, item)  # the HF shapes were checked against the config
    lead = len(item.index)
    global_shape = mapping.stacked_shape(shape, item.entry, fused_shape)
    offsets = tuple(item.index) + (0,) * len(fused_shape)
    sizes = (1,) * lead + tuple(fused_shape)

    def produce():
        if item.entry.layout is not Layout.QKV:
            # One tensor, or gate and up (the two halves of fc1) stored back to back, as HF checkpoints
            # store them: written straight from the mapped file, no copy.
            mapped = reader.map(names)
            if mapped is not None:
                return mapped.view(sizes)
        if item.entry.layout is Layout.GLU:
            # gate and up stored apart: each read straight into its half of fc1.
            fused = torch.empty(fused_shape, dtype=infos[0].dtype)
            for name, half in zip(names, fused.chunk(2)):
                reader.read(name, out=half)
        else:  # QKV: one copy, interleaving the mapped q, k and v per query group
            parts = [reader.map((name,)).view(info.shape) for name, info in zip(names, infos)]
            fused = mapping.fuse(shape, item.entry.layout, parts)
        return fused.view(sizes)

    return item.entry.mcore, global_shape, offsets, sizes, infos[0].dtype, produce


def _object_key(shape: Qwen3Shape, item: Item) -> str:
    """Megatron's ShardedObject key: KEY/shard_<offset>_<shape>, dotted over the stacked axes.

    The object itself is the local spec's `_extra_state` as Megatron saves it ([None]).
    """
    stack = mapping.stacked_shape(shape, item.entry, ())
    return f"{item.entry.extra_state_key}/shard_{'.'.join(map(str, item.index))}_{'.'.join(map(str, stack))}"

