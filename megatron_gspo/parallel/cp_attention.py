"""Core attention for Megatron-Core's *local* layer spec that also runs under context parallelism.

Stock Megatron-Core allows context parallelism only with Transformer Engine attention
(`transformer/dot_product_attention.py:56` asserts context_parallel_size == 1), and TE does not
exist on CPU. This module is a drop-in replacement for `DotProductAttention` (same constructor and
forward signature, same result at cp=1) that, at cp > 1, all-gathers keys and values over the CP
group and masks causally by *global* position, so CPU tests can exercise the CP layout.

It is the "all_gather" CP scheme (every rank holds all keys/values of the sequence for one layer
at a time): simple and exact, meant for CPU tests and small runs, not for long sequences on GPU.

Shapes: sq local query length, sk local key length, S full key length (sk * cp), b batch,
np query heads and ng key/value groups on this TP rank, hn head dim.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megatron_gspo.parallel.context_parallel import cp_chunk_indices, cp_gathered_positions

# Megatron's `attention_mask_func` fills masked scores with -10000 (not -inf); using the same
# value keeps cp=1 bitwise equal to DotProductAttention, including fully masked rows.
_MASKED_SCORE = -10000.0
_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (the sequence) over `group`, concatenated in rank order.

    Backward: every rank's queries attend to every rank's keys, so the gradient of this rank's
    keys is the sum of the gradients computed on all ranks, restricted to this rank's rows
    (reduce-scatter). Gloo has no reduce_scatter, hence all_reduce and slice.
    """

    @staticmethod
    def forward(ctx, x_sk: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x_sk) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_sk.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad_S: Tensor):
        grad_S = grad_S.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad_S, group=ctx.group)
        sk = grad_S.size(0) // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad_S[rank * sk:(rank + 1) * sk], None


class ContextParallelDotProductAttention(MegatronModule):
    """`DotProductAttention` with context-parallel support (all-gather K/V, global causal mask).

    Constructor and forward match `megatron.core.transformer.dot_product_attention.
    DotProductAttention` (megatron-core 0.16.1) so it can stand in `SelfAttentionSubmodules.
    core_attention`. `cp_comm_type` is accepted and ignored: this module always all-gathers.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        # SelfAttention passes its own collection (with tp and cp); standalone use falls back to
        # Megatron's global groups, as DotProductAttention does.
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        if not hasattr(pg_collection, "tp"):
            raise ValueError("pg_collection must have a tp process group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        # A tp-only collection (as DotProductAttention accepts) means no context parallelism.
        self.cp_group = pg_collection.cp if hasattr(pg_collection, "cp") else None
        self.cp_size = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        if self.cp_size != config.context_parallel_size:
            raise ValueError(
                f"CP group has {self.cp_size} ranks but config.context_parallel_size="
                f"{config.context_parallel_size}"
            )

        tp_size = dist.get_world_size(self.tp_group)
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)

        # Same arithmetic as DotProductAttention: with query-key layer scaling the matmul is scaled
        # down by layer_number and the fp32 softmax input scaled back up (avoids fp16 overflow).
        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head)
            if softmax_scale is None
            else softmax_scale
        )
        self.layer_scaling_coeff = None
        if config.apply_query_key_layer_scaling:
            self.layer_scaling_coeff = float(self.layer_number)
            self.softmax_scale /= self.layer_scaling_coeff

        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError("sliding-window attention is not supported by this module")
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"softmax_type={config.softmax_type!r} is not supported")

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout > 0 and self.cp_size > 1:
            # Each CP rank would draw its dropout mask from the same tracker state; refuse rather
            # than silently correlate the masks of different query chunks.
            raise ValueError(
                f"attention dropout ({dropout}) is not supported with context parallelism; set "
                "attention_dropout=0"
            )
        self.attention_dropout = torch.nn.Dropout(dropout)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np*hn].

        attention_mask (bool, True = masked), if given, is used as is, like DotProductAttention:
        shape broadcastable to [b, np, sq, S] with keys in natural order. Under CP that is a full
        [b, 1, S, S] mask with this rank's query rows selected (what Megatron-LM's
        `get_batch_on_this_cp_rank` does to 'attention_mask'). Without a mask, causal mask types
        mask by global position.

        An *integer* attention_mask [b, S] is packed rows' segment ids (microbatch.MicroBatch.segments_BS,
        the whole row in natural order, -1 on padding): each sequence attends causally to itself only,
        computed sequence by sequence (varlen, like TE's THD path on GPU) instead of as a masked S x S
        product per row; see _segment_attention.
        """
        if packed_seq_params is not None:
            raise NotImplementedError(
                "packed sequences (THD, packed_seq_params) need Transformer Engine attention"
            )
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type

        sq, sk = query.size(0), key.size(0)
        if self.cp_size > 1:
            if sq != sk:
                raise NotImplementedError("a KV cache (sq != sk) is not supported with CP")
            key = _AllGatherSequence.apply(key, self.cp_group)
            value = _AllGatherSequence.apply(value, self.cp_group)
            # The gather is in rank order (r0's two chunks, r1's two chunks, ...); put the keys in
            # natural order so key index == global position, for the mask and a caller's mask.
            S = key.size(0)
            natural = torch.argsort(cp_gathered_positions(S, self.cp_size)).to(key.device)
            key = key.index_select(0, natural)
            value = value.index_select(0, natural)
            q_pos = cp_chunk_indices(S, self.cp_size, dist.get_rank(self.cp_group))
        else:
            S = sk
            # With a KV cache the queries are the last sq positions (sq == sk without one).
            q_pos = torch.arange(S - sq, S)

        segments = attention_mask if attention_mask is not None and not attention_mask.is_floating_point() \
            and attention_mask.dtype != torch.bool else None
        if segments is None and attention_mask is None and mask_type in _CAUSAL_TYPES:
            # [sq, S]: query at global position i sees keys at positions <= i.
            k_pos = torch.arange(S)
            attention_mask = (k_pos[None, :] > q_pos[:, None]).to(query.device)
        if segments is None and attention_mask is not None and (
            attention_mask.size(-1) != S or attention_mask.size(-2) not in (1, sq)
        ):
            raise ValueError(
                f"attention_mask must end in [sq={sq} or 1, S={S}] (keys in natural order), "
                f"got {tuple(attention_mask.shape)}"
            )

        # GQA: each key/value group serves np/ng query heads; repeat to one per query head,
        # in the same (interleaved) order as DotProductAttention.
        heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if heads_per_group > 1:
            key = key.repeat_interleave(heads_per_group, dim=2)
            value = value.repeat_interleave(heads_per_group, dim=2)
        if segments is not None:
            return self._segment_attention(query, key, value, segments, q_pos)

        b, n_heads, hn = query.size(1), query.size(2), query.size(3)
        q_Bqh = query.reshape(sq, b * n_heads, hn).transpose(0, 1)  # B = b*np
        k_BSh = key.reshape(S, b * n_heads, hn).transpose(0, 1)
        v_BSh = value.reshape(S, b * n_heads, hn).transpose(0, 1)
        context_Bqh = self._attend(q_Bqh, k_BSh, v_BSh, attention_mask, b)
        context_qbnh = context_Bqh.view(b, n_heads, sq, hn).permute(2, 0, 1, 3).contiguous()
        return context_qbnh.view(sq, b, self.hidden_size_per_partition)

    def _attend(self, q_Bqh: Tensor, k_BSh: Tensor, v_BSh: Tensor, mask: Optional[Tensor], batch: int) -> Tensor:
        """DotProductAttention's arithmetic: q [B*np, sq, hn], k/v [B*np, S, hn] and a bool mask broadcastable
        to [B, np, sq, S] (True = masked; None: none) -> context [B*np, sq, hn]."""
        Bn, sq, _ = q_Bqh.shape
        S = k_BSh.size(1)
        # baddbmm with beta=0 is the exact arithmetic DotProductAttention uses.
        scores_BqS = torch.baddbmm(
            q_Bqh.new_empty(Bn, sq, S), q_Bqh, k_BSh.transpose(1, 2),
            beta=0.0, alpha=self.softmax_scale,
        )
        # Softmax in at least float32 (bf16/fp16 scores are upcast, float64 stays float64).
        softmax_dtype = torch.promote_types(scores_BqS.dtype, torch.float32)
        scores_bnqS = scores_BqS.view(batch, Bn // batch, sq, S).to(softmax_dtype)
        if self.layer_scaling_coeff is not None:
            scores_bnqS = scores_bnqS * self.layer_scaling_coeff
        if mask is not None:
            scores_bnqS = scores_bnqS.masked_fill(mask, _MASKED_SCORE)
        probs_bnqS = torch.softmax(scores_bnqS, dim=-1).to(q_Bqh.dtype)

        if self.training and self.attention_dropout.p > 0:
            # As DotProductAttention: without sequence parallelism every TP rank holds different
            # heads, so draw the mask from the model-parallel RNG stream.
            if self.config.sequence_parallel:
                probs_bnqS = self.attention_dropout(probs_bnqS)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs_bnqS = self.attention_dropout(probs_bnqS)
        return torch.bmm(probs_bnqS.reshape(Bn, sq, S), v_BSh)

    def _segment_attention(self, query: Tensor, key: Tensor, value: Tensor, segments_BS: Tensor,
                           q_pos: Tensor) -> Tensor:
        """Causal attention within each segment of packed rows: query [sq, b, np, hn] (this rank's
        positions q_pos), key/value [S, b, np, hn] (all positions, natural order, GQA groups already
        repeated) -> [sq, b, np*hn].

        The (row, segment) pairs are bucketed by length and each bucket runs as one batched product
        padded to its longest member, so the work is about sum(L_i^2) instead of rows x S^2. Each bucket
        goes through the dense path's arithmetic (_attend) over its own sequences' keys only.
        """
        sq, b, n_q, hn = query.shape
        S = key.size(0)
        if segments_BS.shape != (b, S):
            raise ValueError(f"segment ids must be [b={b}, S={S}], got {tuple(segments_BS.shape)}")
        q_flat = query.transpose(0, 1).reshape(b * sq, n_q, hn)
        k_flat = key.transpose(0, 1).reshape(b * S, n_q, hn)
        v_flat = value.transpose(0, 1).reshape(b * S, n_q, hn)
        contexts, targets = [], []
        for idx_q, idx_k, masked in _segment_plan(segments_BS, q_pos):
            G, Lq = idx_q.shape
            Lk = idx_k.shape[1]

            def heads_first(x_flat, idx, length):  # [G, L, np, hn] gathered -> [G*np, L, hn]
                return x_flat[idx.clamp(min=0)].permute(0, 2, 1, 3).reshape(G * n_q, length, hn)

            context = self._attend(heads_first(q_flat, idx_q, Lq), heads_first(k_flat, idx_k, Lk),
                                   heads_first(v_flat, idx_k, Lk), masked[:, None], G)   # [G*np, Lq, hn]
            context = context.view(G, n_q, Lq, hn).permute(0, 2, 1, 3).reshape(G * Lq, n_q * hn)
            valid = idx_q.flatten() >= 0
            contexts.append(context[valid])
            targets.append(idx_q.flatten()[valid])
        # every query is in exactly one bucket: one scatter puts them all back in place
        out_flat = query.new_zeros(b * sq, n_q * hn).index_copy(0, torch.cat(targets), torch.cat(contexts))
        return out_flat.view(b, sq, n_q * hn).transpose(0, 1).contiguous()


def _segment_plan(segments_BS: Tensor, q_pos: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Buckets of (row, segment) pairs: [G, Lq] flat query indices (row * sq + local position, -1 =
    pad), [G, Lk] flat key indices (row * S + position, -1 = pad) and the [G, Lq, Lk] mask (True =
    masked: a later key or padding). Vectorised (no Python loop over sequences); cached on the segment
    tensor, since every layer of a forward reuses it."""
    cached = getattr(segments_BS, "_gspo_segment_plan", None)
    if cached is not None and torch.equal(cached[0], q_pos):
        return cached[1]
    b, S = segments_BS.shape
    sq = q_pos.numel()
    rows = torch.arange(b)[:, None]
    key_k = (rows * (S + 2) + segments_BS + 1).flatten()                 # one id per (row, segment)
    key_q = (rows * (S + 2) + segments_BS[:, q_pos] + 1).flatten()
    pair_ids, k_pair, Lk = torch.unique(key_k, return_inverse=True, return_counts=True)
    q_pair = torch.searchsorted(pair_ids, key_q)   # a query's own position is one of its pair's keys
    Lq = torch.bincount(q_pair, minlength=pair_ids.numel())
    k_at = torch.arange(S).repeat(b)                                       # global position of each key
    q_at = q_pos.repeat(b)

    def ranks(pair_of: Tensor, counts: Tensor) -> Tensor:
        """Each element's index within its pair, in flat order."""
        order = torch.argsort(pair_of, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(pair_of)
        rank[order] = torch.arange(pair_of.numel()) - starts[pair_of[order]]
        return rank

    k_rank, q_rank = ranks(k_pair, Lk), ranks(q_pair, Lq)
    active = torch.nonzero(Lq > 0).flatten()
    active = active[torch.argsort(Lk[active], descending=True, stable=True)]
    lengths = Lk[active].tolist()
    plan, start = [], 0
    while start < len(lengths):
        end = start + 1
        while end < len(lengths) and 4 * lengths[end] >= 3 * lengths[start]:
            end += 1    # a bucket's members are at least 3/4 of its longest: <= ~44% padded work
        members = active[start:end]
        G, L_k, L_q = len(members), lengths[start], int(Lq[members].max())
        slot = torch.full((pair_ids.numel(),), -1, dtype=torch.long)
        slot[members] = torch.arange(G)
        idx_q = torch.full((G, L_q), -1, dtype=torch.long)
        idx_k = torch.full((G, L_k), -1, dtype=torch.long)
        at_q = torch.full((G, L_q), -1, dtype=torch.long)
        at_k = torch.full((G, L_k), torch.iinfo(torch.long).max, dtype=torch.long)
        in_k, in_q = slot[k_pair] >= 0, slot[q_pair] >= 0
        gk, rk = slot[k_pair][in_k], k_rank[in_k]
        gq, rq = slot[q_pair][in_q], q_rank[in_q]
        idx_k[gk, rk] = torch.nonzero(in_k).flatten()
        at_k[gk, rk] = k_at[in_k]
        idx_q[gq, rq] = torch.nonzero(in_q).flatten()
        at_q[gq, rq] = q_at[in_q]
        # masked: the key lies after the query (padding keys sit at +inf), or the key is padding
        masked = (at_k[:, None, :] > at_q[:, :, None]) & (at_q[:, :, None] >= 0)
        masked |= (idx_k < 0)[:, None, :]
        plan.append((idx_q, idx_k, masked))
        start = end
    segments_BS._gspo_segment_plan = (q_pos, plan)
    return plan
