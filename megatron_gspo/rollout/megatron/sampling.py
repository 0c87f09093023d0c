"""Sampling the next token from vocabulary-sharded logits, with counter-based noise (the in-process sampler).

Shapes: B rows, V this rank's vocabulary shard.

The next token is argmax_v (logits_v / T + g_v) with g_v standard Gumbel noise (Gumbel-max); each TP rank
takes the argmax of its shard and a max all-reduce picks the winner, so the full-vocabulary logits are never
gathered. g_v is a hash of (seed, weight version, group id, sample index, decode position, global vocab id):
the same whatever the layout, so a resumed run samples exactly what the uninterrupted one sampled. top-k
(and top-p inside the top-k) gathers only k candidates per TP rank. The log-prob of each sampled token is
`loss.vocab_parallel_logprobs` of the same logits at the same temperature: the trainer's own function.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_gspo.config import SamplingConfig
from megatron_gspo.loss.logprobs import vocab_parallel_logprobs
from megatron_gspo.parallel.collectives import group_rank, group_size

_MASK32 = 0xFFFFFFFF


def check_sampling(sampling: SamplingConfig) -> None:
    """What this sampler needs of the sampling settings (ValueError naming the setting otherwise).
    preflight calls it for rollout.backend=megatron, before any work starts."""
    if sampling.temperature <= 0:
        raise ValueError(f"sampling.temperature must be > 0 with rollout.backend=megatron, got {sampling.temperature}")
    if sampling.top_p < 1 and sampling.top_k < 1:
        raise ValueError("sampling.top_p < 1 needs sampling.top_k >= 1 with rollout.backend=megatron (the nucleus "
                         f"is searched among the top-k tokens), got top_p={sampling.top_p}")
    if sampling.stop:
        raise ValueError(f"sampling.stop is not supported by rollout.backend=megatron (stop token ids are), "
                         f"got {sampling.stop!r}")


# ---- counter-based Gumbel noise ------------------------------------------------------------------

def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2^32 for int64 x in [0, 2^32), without int64 overflow (16-bit halves of m)."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (Wellons' lowbias32): every input bit flips each output bit ~1/2."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(keys_B2: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise (float64) for each row's key and each global vocab id.

    keys_B2: [B, 2] int64 32-bit keys; vocab_ids: [V] or [B, V] int64 -> [B, V]. A pure function of
    (key, id): any shard of the vocabulary gets the values the full vocabulary would.
    """
    ids = vocab_ids if vocab_ids.dim() == 2 else vocab_ids.unsqueeze(0)
    bits = _mix32(_mix32(ids ^ keys_B2[:, :1]) ^ keys_B2[:, 1:])
    uniform = (bits.double() + 0.5) / 2.0 ** 32  # in (0, 1)
    return -torch.log(-torch.log(uniform))


def sample_keys(seed: int, version: str, rows: Sequence[tuple[int, int]], position: int) -> torch.Tensor:
    """[B, 2] keys for (group_id, sample_index) rows at decode position `position`."""
    out = []
    for group_id, index in rows:
        digest = hashlib.blake2b(f"{seed}/{version}/{group_id}/{index}/{position}".encode(), digest_size=8).digest()
        out.append([int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")])
    return torch.tensor(out, dtype=torch.long).reshape(-1, 2)


# ---- sampling from vocabulary-sharded logits -----------------------------------------------------

def sample_from_sharded_logits(logits_BV: torch.Tensor, keys_B2: torch.Tensor, settings: SamplingConfig, *,
                               tp_group=None, vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B] long, their log-probs [B] float32) sampled from this rank's vocab shard.

    Collective over `tp_group` (every rank gets the same tokens); the full-vocabulary logits are never
    gathered. Rank r holds global ids [r*V, (r+1)*V); ids >= vocab_size are padding, never sampled.
    """
    B, V = logits_BV.shape
    start = group_rank(tp_group) * V
    ids_V = torch.arange(start, start + V, device=logits_BV.device)
    x_BV = logits_BV.double() / settings.temperature
    if vocab_size is not None:
        x_BV = x_BV.masked_fill(ids_V >= vocab_size, float("-inf"))
    if settings.top_k < 1:
        tokens_B = _gumbel_argmax(x_BV + gumbel_noise(keys_B2, ids_V), ids_V, tp_group)
    else:
        tokens_B = _truncated_sample(x_BV, ids_V, keys_B2, settings, tp_group)
    logprobs_B = vocab_parallel_logprobs(logits_BV.unsqueeze(1), tokens_B.unsqueeze(1), tp_group=tp_group,
                                         temperature=settings.temperature, vocab_size=vocab_size)
    return tokens_B, logprobs_B.squeeze(1).float()


def _gumbel_argmax(perturbed_BV: torch.Tensor, ids_V: torch.Tensor, tp_group) -> torch.Tensor:
    """Global argmax over the sharded vocabulary: max all-reduce of the value, then of the id holding it."""
    best_B, where_B = perturbed_BV.max(dim=1)
    if group_size(tp_group) == 1:
        return ids_V[where_B]
    global_B = best_B.clone()
    dist.all_reduce(global_B, op=dist.ReduceOp.MAX, group=tp_group)
    # Ties between shards (measure zero) go to the larger id, the same on every rank.
    winner_B = torch.where(best_B == global_B, ids_V[where_B], torch.full_like(where_B, -1))
    dist.all_reduce(winner_B, op=dist.ReduceOp.MAX, group=tp_group)
    return winner_B


def _truncated_sample(x_BV, ids_V, keys_B2, settings: SamplingConfig, tp_group) -> torch.Tensor:
    """Gumbel-max among the top-k (then top-p) tokens: only k candidates per TP rank are gathered."""
    k = min(settings.top_k, x_BV.shape[1])
    values_Bk, where_Bk = x_BV.topk(k, dim=1)
    cand_ids_Bk = ids_V[where_Bk]
    if group_size(tp_group) > 1:
        tp = group_size(tp_group)
        parts_v = [torch.empty_like(values_Bk) for _ in range(tp)]
        parts_i = [torch.empty_like(cand_ids_Bk) for _ in range(tp)]
        dist.all_gather(parts_v, values_Bk.contiguous(), group=tp_group)
        dist.all_gather(parts_i, cand_ids_Bk.contiguous(), group=tp_group)
        values_Bk, order = torch.cat(parts_v, 1).topk(min(settings.top_k, tp * k), dim=1)
        cand_ids_Bk = torch.cat(parts_i, 1).gather(1, order)
    if settings.top_p < 1:
        log_z_B = _sharded_logsumexp(x_BV, tp_group)
        probs_Bk = torch.exp(values_Bk - log_z_B[:, None])  # sorted descending by topk
        mass_before_Bk = probs_Bk.cumsum(1) - probs_Bk
        values_Bk = values_Bk.masked_fill(mass_before_Bk > settings.top_p, float("-inf"))
    perturbed_Bk = values_Bk + gumbel_noise(keys_B2, cand_ids_Bk)
    return cand_ids_Bk.gather(1, perturbed_Bk.argmax(1, keepdim=True)).squeeze(1)


def _sharded_logsumexp(x_BV: torch.Tensor, tp_group) -> torch.Tensor:
    m_B = x_BV.max(dim=1).values
    if group_size(tp_group) > 1:
        dist.all_reduce(m_B, op=dist.ReduceOp.MAX, group=tp_group)
    s_B = torch.exp(x_BV - m_B[:, None]).sum(1)
    if group_size(tp_group) > 1:
        dist.all_reduce(s_B, group=tp_group)
    return m_B + torch.log(s_B)
