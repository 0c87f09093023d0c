"""Streaming safetensors: read one tensor at a time, write shards whose header is planned up front.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}}, then the
data, offsets relative to its start. We parse the header ourselves. `read` copies a tensor into a
fresh one with one `readinto`; `map` maps just the bytes of a run of tensors (never a whole shard),
so a tensor that is written out as it is stored costs no copy: the page cache's pages are written
from directly, and they leave the process's memory when the tensor is dropped. Writing, the header
is computed from the planned (name, shape, dtype) list before any data, so a 5 GB shard never sits
in memory.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_gspo.convert.mapped import map_bytes

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Absolute byte offset of the data in `file`."""
    nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, checked against the file's size (truncation)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"{path}: truncated safetensors file (header of {n} bytes, file {size})")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    infos = {}
    for name, meta in header.items():
        begin, end = meta["data_offsets"]
        if 8 + n + end > size:
            raise ValueError(f"{path}: truncated safetensors file: tensor {name!r} ends at byte "
                             f"{8 + n + end}, the file has {size}")
        infos[name] = TensorInfo(path, DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + begin, end - begin)
    return infos


class SafetensorsReader:
    """The tensors of a Hugging Face checkpoint directory (index + shards, or one model.safetensors)."""

    def __init__(self, hf_dir: str | Path):
        hf_dir = Path(hf_dir)
        if (hf_dir / INDEX_FILE).is_file():
            with open(hf_dir / INDEX_FILE) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif (hf_dir / SINGLE_FILE).is_file():
            files = [SINGLE_FILE]
        else:
            raise FileNotFoundError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE}")
        self.tensors: dict[str, TensorInfo] = {}
        for file in files:
            if not (hf_dir / file).is_file():
                raise FileNotFoundError(f"{hf_dir / file}: listed in {INDEX_FILE} but missing")
            self.tensors.update(read_header(hf_dir / file))

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name`, read into `out` (contiguous, of its dtype and size) if given."""
        info = self.tensors[name]
        if out is None:
            out = torch.empty(info.shape, dtype=info.dtype)
        if not out.is_contiguous() or out.dtype != info.dtype or out.numel() * out.itemsize != info.nbytes:
            raise ValueError(f"{name}: cannot read {info.shape} {info.dtype} into {tuple(out.shape)} {out.dtype}")
        with open(info.file, "rb") as f:
            f.seek(info.start)
            if f.readinto(out.view(-1).view(torch.uint8).numpy()) != info.nbytes:
                raise ValueError(f"{info.file}: short read of tensor {name!r}")
        return out.view(info.shape)

    def map(self, names: tuple[str, ...]) -> torch.Tensor | None:
        """Tensors `names`, if stored back to back in this order in one file and of one dtype, as one
        flat tensor of that dtype backed by a private mapping of their bytes (no copy); else None.
        Writing to it never changes the file."""
        infos = [self.tensors[n] for n in names]
        first = infos[0]
        for before, after in zip(infos, infos[1:]):
            if (after.file, after.dtype, after.start) != (first.file, first.dtype, before.start + before.nbytes):
                return None
        return map_bytes(first.file, first.start, sum(i.nbytes for i in infos)).view(first.dtype)


def plan_shards(specs: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int):
    """Split the ordered (name, shape, dtype) list into shards of at most max_shard_bytes each
    (a single larger tensor gets a shard of its own), keeping the order."""
    shards, current, current_bytes = [], [], 0
    for name, shape, dtype in specs:
        nbytes = _nbytes(shape, dtype)
        if current and current_bytes + nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append((name, shape, dtype))
        current_bytes += nbytes
    if current:
        shards.append(current)
    return shards


def _nbytes(shape, dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class ShardWriter:
    """Writes one safetensors file whose tensors (names, shapes, dtypes, order) are known up front."""

    def __init__(self, path: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path = path
        self.expected = list(specs)
        header, offset = {}, 0
        for name, shape, dtype in specs:
            nbytes = _nbytes(shape, dtype)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(blob)) + blob)
        self.position = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, shape, dtype = self.expected[self.position]
        if (name, tuple(tensor.shape), tensor.dtype) != (expected_name, shape, dtype):
            raise ValueError(f"{self.path}: got {name} {tuple(tensor.shape)} {tensor.dtype}, "
                             f"planned {expected_name} {shape} {dtype}")
        self.file.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().data)
        self.position += 1

    def close(self) -> None:
        if self.position != len(self.expected):
            raise ValueError(f"{self.path}: {len(self.expected) - self.position} planned tensors not written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
