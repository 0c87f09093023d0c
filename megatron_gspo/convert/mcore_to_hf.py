"""Megatron-Core torch_dist checkpoint -> Hugging Face safetensors shards, streaming.

The model's shape comes from the HF config directory given (`--hf-config`); its config, tokenizer
and generation files are copied verbatim. The checkpoint may be one this package wrote or one
Megatron saved at any TP/EP/PP layout (chunks are reassembled by `DcpRegionReader`); a padded
vocabulary is cut back to the config's `vocab_size`. Tensors keep their stored dtype.

Memory: shards are planned (names, shapes, dtypes) before any data is read, their headers written
first, and each tensor is read, split into its HF parts, written and dropped. A tensor stored whole
is mapped from its data file rather than copied (dcp_io.DcpRegionReader), and its HF parts that are
contiguous slices of it (gate and up, every one-to-one tensor) are written from those pages
directly. The next tensors (`READ_AHEAD_BYTES`, at least one) are read meanwhile: mapped ones only
into the page cache. So about two of the largest tensors (the embedding) are in memory at most,
plus the read-ahead where a checkpoint chunked differently must be reassembled by copying.
"""
from __future__ import annotations

import collections
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm import tqdm

from megatron_gspo.convert import mapping
from megatron_gspo.convert.dcp_io import DcpRegionReader
from megatron_gspo.convert.hf_config import read_hf_config
from megatron_gspo.convert.hf_to_mcore import CHECKPOINT_DIR, TRACKER_FILE, staged_output
from megatron_gspo.convert.mapping import Item
from megatron_gspo.convert.safetensors_io import INDEX_FILE, ShardWriter, plan_shards
from megatron_gspo.model.gpt import Qwen3Shape

DEFAULT_SHARD_BYTES = 5 * 10**9
READ_AHEAD_BYTES = 256 << 20
# Weight files are what we write; everything else in --hf-config (config, tokenizer, chat template,
# generation config) is copied as it is.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_directory(mcore: str | Path) -> Path:
    """The directory holding .metadata: `mcore` itself, or the one its tracker file names."""
    mcore = Path(mcore)
    if (mcore / ".metadata").is_file():
        return mcore
    tracker = mcore / TRACKER_FILE
    if not tracker.is_file():
        raise FileNotFoundError(f"{mcore}: neither a torch_dist checkpoint (.metadata) nor a "
                                f"Megatron checkpoint root ({TRACKER_FILE})")
    step = tracker.read_text().strip()
    return mcore / (CHECKPOINT_DIR if step == CHECKPOINT_DIR else f"iter_{int(step):07d}")


def convert_mcore_to_hf(mcore: str | Path, hf_config: str | Path, out: str | Path, *,
                        max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True) -> Qwen3Shape:
    """Write the HF checkpoint of the torch_dist checkpoint `mcore` to `out` (must not exist)."""
    hf_config = Path(hf_config)
    shape = read_hf_config(hf_config)
    reader = DcpRegionReader(checkpoint_directory(mcore))
    plan = [(item, tuple(zip(item.hf_names, mapping.hf_shapes(shape, item)))) for item in mapping.items(shape)]
    for item, _ in plan:
        _check_stored(shape, reader, item)
    specs = [(name, hf_shape, reader.tensor_metadata(item.entry.mcore).properties.dtype)
             for item, parts in plan for name, hf_shape in parts]
    shards = plan_shards(specs, max_shard_bytes)
    # HF tensors in write order; the next Megatron tensors are read while the current one is written.
    item_bytes = [sum(torch.Size(hf_shape).numel() for _, hf_shape in parts)
                  * reader.tensor_metadata(item.entry.mcore).properties.dtype.itemsize for item, parts in plan]
    tensors = (part for parts in _prefetch(lambda item: zip(item.hf_names, _read_item(shape, reader, item)),
                                           [item for item, _ in plan], item_bytes)
               for part in parts)

    with staged_output(out) as staging:
        for src in sorted(hf_config.iterdir()):
            if src.is_file() and not src.name.endswith(WEIGHT_SUFFIXES) and src.name != INDEX_FILE:
                shutil.copy2(src, staging / src.name)
        weight_map, total = {}, 0
        bar = tqdm(total=len(specs), desc="mcore->hf", unit="tensor", disable=not progress)
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            writer = ShardWriter(staging / file, shard)
            for _ in shard:
                name, tensor = next(tensors)
                writer.write(name, tensor)  # checks the name, shape and dtype against the plan
                weight_map[name] = file
                total += tensor.nbytes
                bar.update()
            writer.close()
        bar.close()
        with open(staging / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return shape


def _prefetch(fn, items, item_bytes, ahead_bytes: int = READ_AHEAD_BYTES):
    """fn(item) for each item in order, computed in a thread ahead of the caller, up to
    `ahead_bytes` of items (at least the next one): reading overlaps writing. A tensor mapped from
    its file costs no memory until its pages are used (they are only read ahead into the page
    cache); one read into memory (a region of a differently chunked checkpoint) costs its size."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending, queued = collections.deque(), 0
        for item, nbytes in zip(items, item_bytes):
            pending.append((pool.submit(fn, item), nbytes))
            queued += nbytes
            while len(pending) > 1 and queued - pending[-1][1] >= ahead_bytes:
                future, done = pending.popleft()
                queued -= done
                yield future.result()
        while pending:
            yield pending.popleft()[0].result()


def _region(shape: Qwen3Shape, item: Item, reader: DcpRegionReader):
    """(offsets, sizes) of `item` in its stored Megatron key; the vocabulary cut to vocab_size."""
    md = reader.tensor_metadata(item.entry.mcore)
    lead = len(item.index)
    inner = tuple(md.size[lead:])
    if item.entry.mcore in (mapping.MODEL_ENTRIES[0].mcore, mapping.OUTPUT_ENTRY.mcore):
        inner = (shape.vocab_size,) + inner[1:]
    return tuple(item.index) + (0,) * len(inner), (1,) * lead + inner


def _check_stored(shape: Qwen3Shape, reader: DcpRegionReader, item: Item) -> None:
    md = reader.tensor_metadata(item.entry.mcore)
    lead = len(item.index)
    want = mapping.stacked_shape(shape, item.entry, ())
    parts = mapping.hf_shapes(shape, item)
    rows = sum(s[0] for s in parts)
    if tuple(md.size[:lead]) != want or md.size[lead] < rows or tuple(md.size[lead + 1:]) != parts[0][1:]:
        raise ValueError(f"{reader.directory}: {item.entry.mcore} is stored as {tuple(md.size)}, which does "
                         f"not fit the config (leading {want}, rows >= {rows})")


def _read_item(shape: Qwen3Shape, reader: DcpRegionReader, item: Item):
    offsets, sizes = _region(shape, item, reader)
    fused = reader.read(item.entry.mcore, offsets, sizes)
    return mapping.split(shape, item.entry.layout, fused.view(sizes[len(item.index):]))
