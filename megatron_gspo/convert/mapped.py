"""Bytes of a file as a CPU tensor without copying them: a private memory map of just those bytes.

Writing such a tensor to another file copies the page cache's pages once, in the kernel's write(),
as a plain file copy does; reading it into a fresh tensor first would add a copy of every byte.
The mapping belongs to the tensor: it is unmapped when the tensor (and every view of it) is freed,
so resident memory is the tensors alive, not the files they come from.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import torch


def map_bytes(path: str | Path, start: int, nbytes: int) -> torch.Tensor:
    """Bytes [start, start + nbytes) of the file at `path`, as a flat uint8 tensor. Writing to the
    tensor never changes the file (copy on write)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    begin = start - start % mmap.ALLOCATIONGRANULARITY  # mappings start page-aligned
    with open(path, "rb") as f:
        # Writable (torch has no read-only tensors) but private: the pages are the page cache's until
        # written. Not MAP_POPULATE: on a private writable mapping it copies every page.
        mapped = mmap.mmap(f.fileno(), start - begin + nbytes, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=begin)
    mapped.madvise(mmap.MADV_WILLNEED)  # start reading ahead if the file is not in the page cache
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=start - begin)
