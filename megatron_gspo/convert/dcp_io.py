"""Megatron-Core `torch_dist` checkpoints written and read one tensor at a time, in one process.

What `dist_checkpointing.save` (megatron-core 0.16) writes, and what its `load` needs:
  metadata.json   {"sharded_backend": "torch_dist", ...}: which strategies read the directory;
  common.pt       torch.save of the non-sharded state (here {"checkpoint_version", "iteration"});
  .metadata       a pickled torch.distributed.checkpoint `Metadata`: per key the global shape, dtype
                  and stored chunks (offsets, sizes), and where each chunk's bytes are;
  __R_F.distcp    the chunks' bytes (each tensor a torch.save record).
`dist_checkpointing.save` gathers the whole state dict first; a model that does not fit in memory
cannot go through it. `StreamingDcpWriter` instead drives torch's own `FileSystemWriter.write_data`
(so the data files are what DCP writes) with one plan per group of tensors, and writes `.metadata`
once at the end from the chunks it recorded (torch's private `_StoragePrefix` names the data files;
`_create_file_view` reads one). No process group is needed. `DcpRegionReader` reads any region of
a key (e.g. one layer of a stacked key) from whatever chunks it was saved in, with torch's reader.

Throughput (benchmarks/convert.py): the writer thread only writes. A group's tensors are produced
(read, fused) by a background thread in the order the writer asks for them, so reading overlaps the
disk writes; the records are written without their zip CRC32 (`torch.load`, hence every DCP and
Megatron reader, never checks it; computing it cost ~10% of the conversion); and data files are
fsynced once, in `finish`, instead of each one stalling the writer when it is complete.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _create_file_view, _StoragePrefix
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.planner import TensorWriteData
from torch.utils.serialization import config as serialization_config

from megatron_gspo.convert.mapped import map_bytes

METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}
# Megatron-LM's checkpoint_version for the current QKV layout; iteration 0 for a converted model.
COMMON_STATE = {"checkpoint_version": 3.0, "iteration": 0}


class StreamingDcpWriter:
    """Writes a torch_dist checkpoint in groups of tensors, each group one data file.

    A group's tensors are produced (their `produce()` called) one after the other by a background
    thread while the writer writes the ones before them. torch's writer keeps the tensors of a file
    until the file is complete (filesystem.py, `_write_files_from_queue`), so a group's size bounds
    the memory, however far the production runs ahead within the group.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=False)
        # sync_files=False: `finish` fsyncs every file once, at the end.
        self.writer = FileSystemWriter(self.directory, single_file_per_rank=True, thread_count=1, sync_files=False)
        self.state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        self.results = []
        self.groups = 0
        self.bytes_written = 0

    def write_group(self, tensors: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                              torch.dtype, Callable[[], torch.Tensor]]],
                    objects: list[tuple[str, object]] = ()) -> None:
        """Write one data file.

        tensors: (key, global_shape, chunk_offsets, chunk_sizes, dtype, produce) each; `produce()`
            returns the chunk (shape chunk_sizes, dtype dtype) when its bytes are written.
        objects: (key, python object) each, stored as torch.save bytes (Megatron's ShardedObject).
        """
        items, producers = [], {}
        for key, global_shape, offsets, sizes, dtype, produce in tensors:
            md = self.state_dict_metadata.setdefault(
                key, TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(global_shape), []))
            if md.size != torch.Size(global_shape) or md.properties.dtype != dtype:
                raise ValueError(f"{key}: chunk of {global_shape} {dtype} does not match "
                                 f"{tuple(md.size)} {md.properties.dtype}")
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            md.chunks.append(chunk)
            index = MetadataIndex(key, torch.Size(offsets))
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                chunk=chunk, properties=md.properties, size=md.size)))
            producers[index] = (produce, tuple(sizes), dtype)
        for key, obj in objects:
            self.state_dict_metadata[key] = BytesStorageMetadata()
            index = MetadataIndex(key)
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            producers[index] = (obj, None, None)
        plan = SavePlan(items, storage_data=_StoragePrefix(f"__{self.groups}_"))
        self.groups += 1
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-produce")
        try:
            # Patched settings are thread-local: only torch.save calls made by this thread skip the CRC.
            with serialization_config.patch({"save.compute_crc32": False}):
                results = self.writer.write_data(plan, _Producer(producers, pool)).wait()
        finally:
            pool.shutdown(cancel_futures=True)  # after a failure, nothing more is read
        self.bytes_written += sum(r.size_in_bytes for r in results)
        self.results.append(results)

    def finish(self, common_state: dict = COMMON_STATE) -> None:
        """`.metadata`, common.pt and metadata.json, then every file fsynced; call once, after every
        group is written."""
        self.writer.set_up_storage_writer(True)
        self.writer.finish(Metadata(self.state_dict_metadata), self.results)
        torch.save(common_state, self.directory / "common.pt")
        with open(self.directory / "metadata.json", "w") as f:
            json.dump(METADATA_JSON, f)
        for path in sorted(self.directory.iterdir()):
            with open(path, "rb") as f:
                os.fsync(f.fileno())


class _Producer:
    """The part of a SavePlanner that `FileSystemWriter.write_data` calls: data for a write item.

    Every tensor is submitted to `pool` (one thread) at once, in the plan's order, which is the order
    the writer asks for them (single thread, `_SerialCpuLoader`).
    """

    def __init__(self, producers, pool: ThreadPoolExecutor):
        self.producers = producers
        self.futures = {index: pool.submit(produce) for index, (produce, sizes, _) in producers.items()
                        if sizes is not None}

    def resolve_data(self, write_item: WriteItem):
        produce, sizes, dtype = self.producers.pop(write_item.index)
        if sizes is None:
            buffer = io.BytesIO()
            torch.save(produce, buffer)
            return buffer
        tensor = self.futures.pop(write_item.index).result()
        if tuple(tensor.shape) != sizes or tensor.dtype != dtype:
            raise ValueError(f"{write_item.index.fqn}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                             f"expected {sizes} {dtype}")
        # torch.save writes a view's whole storage: give it a tensor of its own.
        return tensor if tensor.untyped_storage().nbytes() == tensor.nbytes else tensor.clone()


class DcpRegionReader:
    """Reads regions of the tensors of a torch_dist checkpoint directory, whatever their chunking."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        if not (self.directory / ".metadata").is_file():
            raise FileNotFoundError(f"{self.directory}: no .metadata (not a torch_dist checkpoint)")
        self.reader = FileSystemReader(self.directory)
        try:
            self.metadata = self.reader.read_metadata()
        except (EOFError, pickle.UnpicklingError, RuntimeError, ValueError) as e:
            raise ValueError(f"{self.directory / '.metadata'}: truncated or corrupt ({_first_line(e)})") from e
        self.reader.set_up_storage_reader(self.metadata, True)
        self._check_data_files()

    def _check_data_files(self) -> None:
        """ValueError naming a data file that is missing or shorter than the records `.metadata` places in it
        (a copy cut short); torch's reader would fail deep inside its zip reader, naming no file."""
        ends: dict[str, int] = {}
        for info in self.reader.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            path = self.directory / name
            if not path.is_file():
                raise ValueError(f"{path}: missing (the checkpoint's .metadata has records in it)")
            size = path.stat().st_size
            if size < end:
                raise ValueError(f"{path}: truncated torch_dist data file ({size} bytes, but .metadata has "
                                 f"records up to byte {end})")

    def _corrupt(self, read_items, error: Exception) -> ValueError:
        """The error for records torch could not load: which file(s), which key."""
        infos = [self.reader.storage_data[item.storage_index] for item in read_items]
        files = ", ".join(sorted({str(self.directory / info.relative_path) for info in infos}))
        return ValueError(f"{files}: corrupt torch_dist data file: the record of {read_items[0].storage_index.fqn!r} "
                          f"cannot be read ({_first_line(error)})")

    def tensor_metadata(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{self.directory}: tensor {key!r} is not in the checkpoint")
        return md

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of `key`, in its stored dtype."""
        md = self.tensor_metadata(key)
        wanted = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        read_items = create_read_items_for_chunk_list(key, md, [wanted])
        covered = sum(torch.Size(r.lengths).numel() for r in read_items)
        if covered != wanted.sizes.numel():
            raise ValueError(f"{self.directory}: {key} region {offsets}+{sizes} is only partly stored "
                             f"({covered} of {wanted.sizes.numel()} elements)")
        try:
            if len(read_items) == 1 and self._is_whole_chunk(read_items[0], md):
                return self._load_chunk(read_items[0]).view(sizes)
            out = torch.empty(sizes, dtype=md.properties.dtype)
            self.reader.read_data(LoadPlan(read_items), _Receiver(out)).wait()
        except _UNREADABLE as e:
            raise self._corrupt(read_items, e) from e
        return out

    def _is_whole_chunk(self, read_item, md: TensorStorageMetadata) -> bool:
        stored = next(c for c in md.chunks if c.offsets == read_item.storage_index.offset)
        return (all(o == 0 for o in read_item.storage_offsets) and tuple(read_item.lengths) == tuple(stored.sizes)
                and self.reader.storage_data[read_item.storage_index].transform_descriptors is None)

    def _load_chunk(self, read_item) -> torch.Tensor:
        """A stored chunk as it is, its bytes mapped from the data file, not copied (`FileSystemReader.read_data`
        would read them into a new tensor, then copy that into a destination tensor).

        Loading the record with map_location="meta" reads only its pickle and zip directory: the
        storage's `_checkpoint_offset` says where its bytes are (what torch's own
        distributed/checkpoint/_experimental/checkpoint_reader.py reads them with).
        """
        info = self.reader.storage_data[read_item.storage_index]
        path = self.directory / info.relative_path
        with open(path, "rb") as f:
            meta = torch.load(_create_file_view(f, info.offset, info.length), map_location="meta", weights_only=True)
        storage = meta.untyped_storage()
        # The bytes are used as stored: right for records saved on a little-endian machine, read on one.
        if storage._checkpoint_offset is None or sys.byteorder != "little":
            with open(path, "rb") as f:
                return torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu", weights_only=True)
        data = map_bytes(path, info.offset + storage._checkpoint_offset, storage.nbytes()).view(meta.dtype)
        return data.as_strided(meta.shape, meta.stride(), meta.storage_offset())


_UNREADABLE = (EOFError, pickle.UnpicklingError, RuntimeError)
"""What torch.load raises for a record whose bytes are not a torch.save record (zip reader, unpickler)."""


def _first_line(error: Exception, limit: int = 120) -> str:
    line = str(error).splitlines()[0] if str(error) else "no message"
    return f"{type(error).__name__}: {line if len(line) <= limit else line[:limit] + '...'}"


class _Receiver:
    """The part of a LoadPlanner that `FileSystemReader.read_data` calls: where a read item goes."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def resolve_tensor(self, read_item):
        view = self.out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        pass
