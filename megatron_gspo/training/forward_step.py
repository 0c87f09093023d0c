"""Forward steps for Megatron-Core's `get_forward_backward_func` schedules.

Megatron's legacy loss contract (a 2-tuple `(loss, logs)`; pipeline_parallel/schedules.py:266) scales
the returned loss by cp_size / num_microbatches and DDP then averages gradients over the dp x cp ranks,
so the gradient is  sum over (dp, cp, micro-batch) of loss * cp / (num_microbatches * dp * cp).
Returning loss = loss_sum * num_microbatches * dp / N_global therefore gives exactly
d(sum loss_sum / N_global)/d(theta): the GSPO objective over the global batch of N_global sequences,
whatever its split into data-parallel ranks, CP ranks, micro-batches and pipeline stages.
The process groups come in as `pgs` (parallel/groups.py:init_megatron's collection): the loss reads
`pgs.tp` (vocabulary shards), `pgs.cp` (sequence shards) and the size of `pgs.dp` (the `dp` above:
data-parallel without CP).
We use this contract rather than `calculate_per_token_loss` because it leaves the MoE auxiliary loss
with Megatron's standard scaling (a mean over micro-batches and DP ranks); in per-token mode Megatron
rescales the aux loss by the local *token* count (transformer/moe/router.py:456), which assumes the
denominator counts tokens, not sequences.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo.loss.logprobs import vocab_parallel_logprobs
from megatron_gspo.loss.policy import Algorithm, policy_loss
from megatron_gspo.model.routing import RoutingPass
from megatron_gspo.parallel.collectives import group_rank, group_size
from megatron_gspo.microbatch import MicroBatch, sequence_sums


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings (training/setup.py:step_settings builds them from gspo.* and sampling.temperature)."""

    algorithm: Algorithm
    """gspo | gspo_token | grpo."""
    temperature: float
    """Sampling temperature; the training logits are divided by it as the sampler's were."""
    vocab_size: int | None
    """True vocabulary size; Megatron's padded rows above it are excluded from the softmax (None: no padding)."""
    eps_low: float | None = None
    """Lower clip range (None: the algorithm's default, loss.policy.DEFAULT_CLIP)."""
    eps_high: float | None = None
    """Upper clip range (None: the algorithm's default)."""


def _logprobs(logits_SBV, batch: MicroBatch, settings: LossSettings, pgs: ProcessGroupCollection, *,
              with_entropy: bool = False):
    """[B, S] log-probs (and entropy) of the labels from the model's [S, B, V] logits (model/gpt.py
    PolicyGPTModel: no [B, S, V] copy); the results are transposed, not the logits."""
    # inplace: the logits are the output layer's, read by nothing after this call (that layer's
    # backward needs its input and weight only), so they are overwritten and become their own
    # gradient buffer, as in Megatron's vocab_parallel_cross_entropy: no second logits-sized buffer.
    # Both steps use it: in the training step it saves the gradient allocation and the backward's
    # exp; in the forward-only step it saves the float32 working copy of each chunk, and above all
    # it keeps the recomputed old log-probs on the very code path of the training forward, so that
    # they stay bitwise equal to it (the in-place forward's values equal the copy path's bit for
    # bit in our tests, but one code path for both needs no such argument on every device).
    # with_entropy leaves the log-probs bitwise unchanged (tests/unit/test_logprobs.py).
    out = vocab_parallel_logprobs(logits_SBV, batch.labels_BS.t(), tp_group=pgs.tp,
                                  temperature=settings.temperature, vocab_size=settings.vocab_size,
                                  with_entropy=with_entropy, inplace=True)
    return tuple(x.t() for x in out) if with_entropy else out.t()


def _entropy_sum(entropy_BS, batch: MicroBatch) -> torch.Tensor:
    """Sum of the policy's entropy over this rank's response tokens (detached, float64)."""
    return torch.where(batch.loss_mask_BS.bool(), entropy_BS.detach().double(), 0.0).sum()


def _run_model(model, batch: MicroBatch, routing: RoutingPass | None = None, attention_mask=None):
    """The chunk's forward of this micro-batch; MoE routing recorded or replayed by `routing`.
    Packed rows: `attention_mask` = the rows' segment ids, and the sequences' own positions."""
    positions_BS = batch.positions_BS if batch.packed else \
        torch.arange(batch.tokens_BS.shape[1]).expand_as(batch.tokens_BS)
    with routing.forward(model, batch.loss_mask_BS) if routing is not None else contextlib.nullcontext():
        # labels: the logits come back as [S, B, V] (PolicyGPTModel), on the last pipeline stage
        return model(batch.tokens_BS, positions_BS, attention_mask, labels=batch.labels_BS)


def _this_rank(data_iterator, pgs: ProcessGroupCollection):
    """The next micro-batch's CP part, its attention mask and its sequence count (of the whole
    micro-batch, which a CP part of packed rows cannot tell). The mask: None (causal), or for packed rows
    the whole rows' segment ids, which the core attention (parallel/cp_attention.py) turns into
    per-sequence causal attention."""
    full = next(data_iterator)
    cp, cp_rank = group_size(pgs.cp), group_rank(pgs.cp)
    return full.for_cp_rank(cp, cp_rank), full.segments_BS, full.num_sequences


def _sequence_ids(batch: MicroBatch, num_sequences: int):
    """policy_loss's delimitation of the sequences: row offsets, or (packed) each position's sequence."""
    rows, seq_len = batch.loss_mask_BS.shape
    if not batch.packed:
        return {"cu_seqlens": torch.arange(rows + 1) * seq_len}
    # padding (-1) is never in the loss mask: any valid index will do
    return {"cu_seqlens": None, "sequence_ids": batch.segments_BS.flatten().clamp(min=0),
            "num_sequences": num_sequences}


def policy_forward_step(settings: LossSettings, *, pgs: ProcessGroupCollection, num_global_sequences: int,
                        num_microbatches: int, with_entropy: bool = False, routing: RoutingPass | None = None,
                        on_policy: bool = False):
    """A forward step whose gradients are d(loss_sum / num_global_sequences)/d(theta) (see above).

    The data iterator yields full-length MicroBatch objects; this step takes its CP rank's part.
    The logs dict carries the unscaled `loss_sum`, `num_sequences` and the policy-loss metrics
    (with_entropy: also `entropy_token_sum`, which costs the float32 backward one exp per logit).
    `routing` (MoE): records or replays each micro-batch's routing (model/routing.py).
    `on_policy`: the weights are pi_old's (mini-batch 1 of a recompute step), so pi_old's log-probs are
    this forward's own, detached: s_i == 1 exactly, the gradient that of the recomputed case, and no
    separate recompute pass. The logs then also carry them (`logprobs`, [B, S/cp], detached).
    """
    if num_global_sequences < 1:
        raise ValueError(f"num_global_sequences must be >= 1, got {num_global_sequences}")
    scale = num_microbatches * pgs.dp.size() / num_global_sequences

    def loss_func(batch: MicroBatch, sequences: int, logits_SBV):
        out = _logprobs(logits_SBV, batch, settings, pgs, with_entropy=with_entropy)
        logprobs_BS, entropy_BS = out if with_entropy else (out, None)
        advantages = batch.advantages.flatten() if batch.advantages.dim() == 2 else batch.advantages
        old_logprobs_BS = logprobs_BS.detach() if on_policy else batch.old_logprobs_BS
        ids = _sequence_ids(batch, sequences)
        loss_sum, num_sequences, metrics = policy_loss(
            logprobs_BS.flatten(), old_logprobs_BS.flatten(), advantages,
            batch.loss_mask_BS.flatten(), ids.pop("cu_seqlens"), **ids,
            algorithm=settings.algorithm, eps_low=settings.eps_low, eps_high=settings.eps_high,
            cp_group=pgs.cp, weights=None if batch.correction_BS is None else batch.correction_BS.flatten())
        if with_entropy:
            metrics["entropy_token_sum"] = _entropy_sum(entropy_BS, batch)
        logs = {"loss_sum": loss_sum.detach(), "num_sequences": num_sequences, "metrics": metrics}
        if on_policy:
            logs["logprobs"] = logprobs_BS.detach()
        return loss_sum * scale, logs

    def forward_step(data_iterator, model):
        batch, mask, sequences = _this_rank(data_iterator, pgs)
        return _run_model(model, batch, routing, mask), functools.partial(loss_func, batch, sequences)

    return forward_step


def logprobs_forward_step(settings: LossSettings, *, pgs: ProcessGroupCollection,
                          routing: RoutingPass | None = None):
    """A forward-only step whose logs hold this rank's per-token log-probs ([B, S/cp], float32) and
    the sum of the entropy over its response tokens (`entropy_token_sum`; nearly free without a backward),
    also per sequence (`entropy_seq_sum`, `response_tokens_seq`: [N] in the micro-batch's sequence order,
    over this CP rank's positions)."""

    def loss_func(batch: MicroBatch, sequences: int, logits_SBV):
        logprobs_BS, entropy_BS = _logprobs(logits_SBV, batch, settings, pgs, with_entropy=True)
        mask_BS = batch.loss_mask_BS.bool()
        entropy_N = sequence_sums(torch.where(mask_BS, entropy_BS.detach().double(), 0.0), batch.segments_BS,
                                  sequences)
        tokens_N = sequence_sums(mask_BS.double(), batch.segments_BS, sequences)
        return logits_SBV.new_zeros(()), {"logprobs": logprobs_BS.detach(),
                                          "entropy_token_sum": entropy_N.sum(), "response_tokens": tokens_N.sum(),
                                          "entropy_seq_sum": entropy_N, "response_tokens_seq": tokens_N}

    def forward_step(data_iterator, model):
        batch, mask, sequences = _this_rank(data_iterator, pgs)
        return _run_model(model, batch, routing, mask), functools.partial(loss_func, batch, sequences)

    return forward_step
