"""Full Hugging Face tensors, one at a time, from a live Megatron model sharded over TP/EP/PP.

For weight sync to rollout servers (SGLang takes HF names, one tensor per expert, q/k/v and
gate/up separate: it fuses them itself). The model says where each piece lives through its own
`sharded_state_dict()` (global offsets of every local shard, the same description checkpoints use),
so this works for any layout without knowing how TP splits the fused QKV (by query group) or the
gated fc1 (gate and up halves sharded separately: Megatron's swiglu factory), or which EP rank
holds an expert, or which PP stage holds a layer.

Collective: every rank of the default process group must iterate the generator to the end, in
step. By default each piece is broadcast from the rank holding it (its main replica) to all ranks,
so every rank yields the same (name, tensor) sequence; a rank that does not need them just drops
them. With `dst=` only that rank assembles and yields the tensors: each piece is sent to it alone
(point to point), and the other ranks yield nothing, only sending their pieces as the walk goes.
Memory: one full HF tensor at a time (plus its pieces) per yielding rank, never the model.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from megatron_gspo.convert import mapping
from megatron_gspo.convert.load import named_model_chunks
from megatron_gspo.model.gpt import Qwen3Shape


def _local_shards(model_chunks) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """key -> [(global offsets, data with the stacked axes as size-1 dims)] of this rank's main replicas."""
    shards = {}
    for _, module in named_model_chunks(model_chunks):
        for value in nested_values(module.sharded_state_dict()):
            built = nested_values(value.build()) if isinstance(value, ShardedTensorFactory) else [value]
            for sh in built:
                if not isinstance(sh, ShardedTensor) or any(r != 0 for r in _as_tuple(sh.replica_id)):
                    continue
                if sh.flattened_range is not None:
                    raise ValueError(f"{sh.key}: flattened shards are not supported")
                data = sh.data.detach().view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
                shards.setdefault(sh.key, []).append((tuple(sh.global_offset), data))
    return shards


def _as_tuple(replica_id) -> tuple:
    return replica_id if isinstance(replica_id, tuple) else (replica_id,)


def iter_hf_tensors(model_chunks, shape: Qwen3Shape, *, dst: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every tensor of the HF checkpoint of `shape`, in the
    table's order, on every rank, or with `dst` on that global rank only (the others yield nothing).
    Collective over the default process group (see module doc).

    model_chunks: this rank's model chunks (GPTModel or DDP-wrapped), as `build_model` returns.
    Tensors are in the model's dtype, on the current CUDA device (CPU without CUDA); the padded
    vocabulary is cut to `shape.vocab_size`.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    local = _local_shards(model_chunks)
    # Everyone learns who holds which piece: (key, offsets, sizes, dtype) per rank.
    mine = [(key, offsets, tuple(data.shape), data.dtype) for key, pieces in local.items() for offsets, data in pieces]
    catalog: list[list] = [None] * dist.get_world_size()
    dist.all_gather_object(catalog, mine)
    owners: dict[str, list] = {}
    for rank, pieces in enumerate(catalog):
        for key, offsets, sizes, dtype in pieces:
            owners.setdefault(key, []).append((rank, offsets, sizes, dtype))
    local_data = {(key, offsets): data for key, pieces in local.items() for offsets, data in pieces}
    me = dist.get_rank()

    for item in mapping.items(shape):
        key = item.entry.mcore
        if key not in owners:
            raise KeyError(f"no rank holds {key!r}: is the model built for {shape}?")
        fused = mapping.fused_shape(shape, item)
        offsets = tuple(item.index) + (0,) * len(fused)
        sizes = (1,) * len(item.index) + fused
        assemble = dst is None or dst == me
        out = torch.empty(sizes, dtype=owners[key][0][3], device=device) if assemble else None
        filled = 0
        for rank, piece_offsets, piece_sizes, dtype in owners[key]:
            overlap = _overlap(offsets, sizes, piece_offsets, piece_sizes)
            if overlap is None:
                continue
            start, length = overlap
            filled += torch.Size(length).numel()
            if not assemble and rank != me:
                continue  # neither sends nor receives this piece
            buffer = torch.empty(length, dtype=dtype, device=device)
            if rank == me:
                buffer.copy_(_narrow(local_data[(key, piece_offsets)],
                                     [s - p for s, p in zip(start, piece_offsets)], length))
            if dst is None:
                dist.broadcast(buffer, src=rank)
            elif rank != dst and rank == me:
                dist.send(buffer, dst)
            elif rank != dst:
                dist.recv(buffer, rank)
            if assemble:
                _narrow(out, [s - o for s, o in zip(start, offsets)], length).copy_(buffer)
        if filled != torch.Size(sizes).numel():
            raise RuntimeError(f"{key} at {item.index}: the model's shards cover {filled} of "
                               f"{torch.Size(sizes).numel()} elements")
        if assemble:
            yield from zip(item.hf_names, mapping.split(shape, item.entry.layout, out.view(fused)))


def _overlap(a_off, a_size, b_off, b_size):
    """(start, length) of the intersection of two boxes, or None."""
    start = tuple(max(a, b) for a, b in zip(a_off, b_off))
    end = tuple(min(a + n, b + m) for a, n, b, m in zip(a_off, a_size, b_off, b_size))
    if any(e <= s for s, e in zip(start, end)):
        return None
    return start, tuple(e - s for s, e in zip(start, end))


def _narrow(tensor: torch.Tensor, start, length) -> torch.Tensor:
    for dim, (s, n) in enumerate(zip(start, length)):
        tensor = tensor.narrow(dim, s, n)
    return tensor
