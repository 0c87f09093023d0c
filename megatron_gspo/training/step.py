"""One rollout batch -> K optimizer steps (GSPO's mini-batches), through Megatron's schedules.

    source = old_logprobs_source(...)    # how pi_old is obtained, chosen once (training/old_logprobs.py)
    records = train_on_batch(model, optimizer, responses, settings, source, pgs=pgs, scheduler=scheduler)

1. The batch is cut into K consecutive mini-batches and each is packed for this DP rank (packing.py).
2. pi_old's log-probs of every mini-batch, before any update: the source recomputes them or takes the
   sampler's, and says per mini-batch what its training forward does besides (on-policy, MoE routing
   replayed or compared; training/old_logprobs.py).
3. Each mini-batch: one forward/backward over its micro-batches (policy_forward_step's loss contract
   makes the gradient d(-J over the mini-batch's N sequences)), one optimizer step, metrics.

Every rank gets the same list of per-optimizer-step metric dicts (reduced over data/context
parallel ranks and sent from the last pipeline stage), under their logged names (training/metrics.py).
Process groups come only from `pgs` (parallel/groups.py:init_megatron's ProcessGroupCollection), passed
down to the loss and to Megatron's schedules (`pg_collection=`), never from Megatron's global parallel_state.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo import profiling
from megatron_gspo.loss.policy import reduce_metrics, summarize_metrics
from megatron_gspo.model.schedule import run_schedule
from megatron_gspo.parallel.context_parallel import gather_from_cp
from megatron_gspo.training.forward_step import LossSettings, logprobs_forward_step, policy_forward_step
from megatron_gspo.training.old_logprobs import (OldLogprobs, OldPolicy, StepSettings, from_last_stage, pack,
                                                 routing_metrics, set_old_logprobs)
from megatron_gspo.training.packing import PackedMiniBatch, Trainable

__all__ = ["StepSettings", "compute_logprobs", "split_minibatches", "train_on_batch"]


def split_minibatches(responses: Sequence[Trainable], k: int) -> list[Sequence[Trainable]]:
    if len(responses) % k:
        raise ValueError(f"{len(responses)} responses do not split into {k} equal mini-batches")
    size = len(responses) // k
    return [responses[i * size:(i + 1) * size] for i in range(k)]


def train_on_batch(model: list, optimizer, responses: Sequence[Trainable], settings: StepSettings,
                   old_logprobs: OldLogprobs, *, pgs: ProcessGroupCollection, scheduler=None
                   ) -> list[dict[str, float]]:
    """Train on one rollout batch (the same list on every rank); one metrics dict per optimizer step.

    Keys: loss/value (-J of the mini-batch), loss/clipped_fraction_seq / _token, loss/ratio_mean / _min /
    _max (s_i), loss/abs_log_ratio_per_token / _per_seq (|log ratio| vs. pi_old), train/rollout_abs_delta_token
    / _seq (|Megatron - rollout| log-prob: every step with recompute, step 1 with rollout log-probs),
    train/entropy (token mean of the policy's entropy over the mini-batch, before its update),
    train/rollout_nonfinite_tokens, train/response_tokens, train/sequences, loss/sequences_empty / _nonfinite,
    train/grad_norm, train/lr, train/update_successful, train/microbatches, train/padding_fraction (padded
    share of the micro-batches' positions), time/minibatch_train_s, time/minibatch_recompute_s,
    train/tokens_per_s (response tokens of every DP rank through fwd+bwd+optimizer per second of this
    optimizer step). MoE, with pi_old's routing known: moe/routing_changed_fraction and its /layer_NN
    (response tokens x layers whose top-k set under the weights of this step differs from pi_old's); with
    routing_replay=rollout also moe/routing_rollout_changed_fraction (the recompute's own routing vs the
    sampler's, before any update).
    """
    minis = split_minibatches(responses, settings.num_minibatches)
    with profiling.span("train/pack"):
        packed = [pack(mini, pgs, settings.max_tokens_per_microbatch, settings.pack_sequences) for mini in minis]
    olds = old_logprobs.prepare(model, packed, minis, settings, pgs)
    records = []
    for mini, old in zip(packed, olds):
        start = time.perf_counter()
        record = _optimizer_step(model, optimizer, mini, settings.loss, pgs, old)
        if scheduler is not None:
            scheduler.step(1)
        seconds = time.perf_counter() - start
        record.update({"time/minibatch_train_s": seconds, "train/padding_fraction": mini.padding_fraction,
                       "train/tokens_per_s": record["train/response_tokens"] / max(seconds, 1e-9)})
        records.append(record)
    return records


def _optimizer_step(model, optimizer, mini: PackedMiniBatch, loss: LossSettings, pgs: ProcessGroupCollection,
                    old: OldPolicy) -> dict:
    """One optimizer step on `mini` with pi_old as `old` gives it, and its metrics."""
    with profiling.span("train/zero_grad"):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    forward_step = policy_forward_step(loss, pgs=pgs, num_global_sequences=mini.num_global_sequences,
                                       num_microbatches=mini.num_microbatches, with_entropy=old.entropy_in_training,
                                       routing=old.routing, on_policy=old.on_policy)
    with profiling.span("train/forward_backward"):
        outputs = run_schedule(model, mini, forward_step, pgs=pgs, forward_only=False)
    with profiling.span("train/optimizer"):
        update_successful, grad_norm, _ = optimizer.step()
    with profiling.span("train/metrics"):
        record = {**old.metrics, **_step_metrics(optimizer, mini, outputs, pgs, update_successful, grad_norm)}
        if old.on_policy:  # pi_old was this forward's: it gives the train-vs-rollout gap, as a recompute would
            logprobs = [gather_from_cp(o["logprobs"], pgs.cp) for o in outputs] if is_pp_last_stage(pgs.pp) else []
            record.update(set_old_logprobs([mini], [logprobs], [None], pgs, old.correction)[0])
        if old.ratio_is_gap:  # weights still those that sampled: the policy ratio is the train/rollout gap
            record["train/rollout_abs_delta_token"] = record["loss/abs_log_ratio_per_token"]
            record["train/rollout_abs_delta_seq"] = record["loss/abs_log_ratio_per_seq"]
        if old.routing is not None:
            record.update(routing_metrics(old.routing, pgs, "moe/routing_changed_fraction"))
        return record


def _step_metrics(optimizer, mini: PackedMiniBatch, outputs: list, pgs: ProcessGroupCollection,
                  update_successful, grad_norm) -> dict:
    loss_metrics = {}
    if is_pp_last_stage(pgs.pp):
        raw = reduce_metrics([o["metrics"] for o in outputs], group=pgs.dp_cp)
        loss_sum = torch.stack([o["loss_sum"].double() for o in outputs]).sum()
        dist.all_reduce(loss_sum, group=pgs.dp_cp)
        loss_metrics = {"loss/value": loss_sum.item() / mini.num_global_sequences,
                        "train/sequences": float(mini.num_global_sequences), **summarize_metrics(raw)}
    # The optimizer's numbers are the same on every rank; the loss's live on the last stage.
    return {**from_last_stage(loss_metrics, pgs),
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/update_successful": float(bool(update_successful)),
            "train/lr": float(optimizer.param_groups[0]["lr"]),
            "train/microbatches": float(mini.num_microbatches)}


@torch.no_grad()
def compute_logprobs(model: list, responses: Sequence[Trainable], loss: LossSettings, *,
                     pgs: ProcessGroupCollection, max_tokens_per_microbatch: int,
                     pack_sequences: bool = False) -> list[list[float]]:
    """The current policy's log-prob of every response token (float32), for all responses on every rank.

    Data-parallel ranks each compute their share; the results are exchanged with all_gather_object.
    """
    mini = pack(responses, pgs, max_tokens_per_microbatch, pack_sequences)
    outputs = run_schedule(model, mini, logprobs_forward_step(loss, pgs=pgs), pgs=pgs, forward_only=True)
    mine: dict[int, list[float]] = {}
    if is_pp_last_stage(pgs.pp):
        for rows, places, out in zip(mini.rows, mini.places, outputs):
            logprobs_BS = gather_from_cp(out["logprobs"], pgs.cp)
            for i, (b, row_start) in zip(rows, places):
                start = row_start + len(responses[i].prompt_ids) - 1
                mine[i] = logprobs_BS[b, start:start + len(responses[i].response_ids)].float().tolist()
        parts: list = [None] * pgs.dp.size()
        dist.all_gather_object(parts, mine, group=pgs.dp)
        mine = {i: v for part in parts for i, v in part.items()}
    mine = from_last_stage(mine, pgs)
    return [mine[i] for i in range(len(responses))]
