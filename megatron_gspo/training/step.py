"""One rollout batch -> K optimizer steps (GSPO's mini-batches), through Megatron's schedules.

    records = train_on_batch(model, optimizer, responses, settings, pgs=pgs, scheduler=scheduler)

1. The batch is cut into K consecutive mini-batches and each is packed for this DP rank (packing.py).
2. old_logprobs="recompute", before any update. recompute="fused" (the default): mini-batch 1 trains
   on-policy, its pi_old log-probs being its own training forward's, detached, so its s_i is exactly 1
   (nothing clipped) with no pass of its own; mini-batches 2..K are recomputed together in one
   forward-only pass over this rank's rows of all of them, re-packed by the token budget (a few large
   micro-batches instead of K-1 small ones). recompute="per_minibatch": one forward-only pass per
   mini-batch on exactly the micro-batches it will train on (mini-batch 1's training forward then
   reproduces them bitwise). MoE models (routing given) always take per_minibatch: the routing of each
   micro-batch is recorded and compared there. The train-vs-rollout log-prob gap is measured in
   whichever forward gives pi_old.
   old_logprobs="rollout": the sampler's log-probs are pi_old; mini-batch 1's ratio *is* that gap.
3. Each mini-batch: one forward/backward over its micro-batches (policy_forward_step's loss contract
   makes the gradient d(-J over the mini-batch's N sequences)), one optimizer step, metrics.

MoE routing (`routing`, model/routing.py; arXiv 2507.18071 section 4.3): the recompute pass records
every micro-batch's routing: pi_old's. routing_replay="old" replays it in every training forward of
the mini-batch; "rollout" replays the rollout engine's routing (carried by each response) in the
recompute pass and the training forwards alike; "off" routes freely. In every case the routing the
current weights choose is compared with pi_old's on the response tokens (`moe_routing_changed_fraction`,
per layer too): no extra forward, one top-k per router while replaying.

Every rank gets the same list of per-optimizer-step metric dicts (reduced over data/context
parallel ranks and sent from the last pipeline stage). Process groups come only from `pgs`
(parallel/groups.py:init_megatron's ProcessGroupCollection), passed down to the loss and to
Megatron's schedules (`pg_collection=`), never from Megatron's global parallel_state.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.utils import get_pp_last_rank, is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo import profiling
from megatron_gspo.loss.policy import reduce_metrics, summarize_metrics
from megatron_gspo.model.routing import MoERouting, RoutingPass
from megatron_gspo.model.schedule import run_schedule
from megatron_gspo.parallel.context_parallel import gather_from_cp, split_for_cp
from megatron_gspo.parallel.collectives import group_rank, group_size
from megatron_gspo.parallel.groups import sequence_pad_multiple
from megatron_gspo.training.forward_step import LossSettings, logprobs_forward_step, policy_forward_step
from megatron_gspo.training.packing import PackedMiniBatch, Trainable, pack_minibatch
from megatron_gspo.microbatch import sequence_sums


@dataclass(frozen=True)
class StepSettings:
    loss: LossSettings
    """Algorithm, clip range, temperature, true vocabulary size."""
    num_minibatches: int = 4
    """K: optimizer steps per rollout batch."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """pi_old's log-probs: recomputed here before any update, or the rollout engine's."""
    max_tokens_per_microbatch: int = 8192
    """Micro-batch token budget (rows x padded length)."""
    routing_replay: Literal["off", "old", "rollout"] = "off"
    """MoE Routing Replay: off, old (pi_old's recorded routing; R2), rollout (the sampler's; R3)."""
    recompute: Literal["fused", "per_minibatch"] = "fused"
    """How old_logprobs="recompute" runs (module docstring, 2.); MoE with routing: per_minibatch."""
    pack_sequences: bool = False
    """Several responses per row (training/packing.py), each attending only to itself: less padding."""


def split_minibatches(responses: Sequence[Trainable], k: int) -> list[Sequence[Trainable]]:
    if len(responses) % k:
        raise ValueError(f"{len(responses)} responses do not split into {k} equal mini-batches")
    size = len(responses) // k
    return [responses[i * size:(i + 1) * size] for i in range(k)]


def train_on_batch(model: list, optimizer, responses: Sequence[Trainable], settings: StepSettings, *,
                   pgs: ProcessGroupCollection, scheduler=None, routing: MoERouting | None = None
                   ) -> list[dict[str, float]]:
    """Train on one rollout batch (the same list on every rank); one metrics dict per optimizer step.

    Keys: loss (-J of the mini-batch), clipped_fraction_seq / _token, ratio_mean / _min / _max (s_i),
    abs_log_ratio_per_token / _per_seq (|log ratio| vs. pi_old), train_rollout_abs_delta_token / _seq
    (|Megatron - rollout| log-prob: every step with recompute, step 1 with rollout log-probs),
    entropy (token mean of the policy's entropy over the mini-batch, before its update),
    rollout_nonfinite_tokens, response_tokens, sequences, sequences_empty / _nonfinite, grad_norm, lr,
    update_successful, microbatches, padding_fraction (padded share of the micro-batches' positions),
    train_time_s, recompute_time_s, train_tokens_per_s (response tokens
    of every DP rank through fwd+bwd+optimizer per second of this optimizer step).
    MoE (`routing` given, with pi_old's routing known): moe_routing_changed_fraction and _layer_NN
    (response tokens x layers whose top-k set under the weights of this step differs from pi_old's);
    with routing_replay="rollout" also moe_routing_rollout_changed_fraction (the recompute's own routing
    vs the sampler's, before any update).
    """
    if settings.old_logprobs == "rollout" and any(r.rollout_logprobs is None for r in responses):
        raise ValueError("old_logprobs='rollout' needs rollout_logprobs on every response")
    _check_routing(settings, routing, responses)
    minis = split_minibatches(responses, settings.num_minibatches)
    with profiling.span("train/pack"):
        packed = [_pack(mini, pgs, settings.max_tokens_per_microbatch, settings.pack_sequences) for mini in minis]
    # pi_old's routing of each mini-batch (per micro-batch, chunk, router), when known.
    references: list[list | None] = [None] * len(packed)
    if routing is not None and settings.routing_replay == "rollout":
        references = [_rollout_targets(mini, routing, pgs) for mini in packed]

    gaps: list[dict[str, float]] = [{} for _ in packed]
    fused = settings.old_logprobs == "recompute" and settings.recompute == "fused" and routing is None
    start = time.perf_counter()
    if fused:
        with profiling.span("train/recompute"):
            gaps[1:] = _recompute_fused(model, packed[1:], minis[1:], settings, pgs)
    elif settings.old_logprobs == "recompute":
        with profiling.span("train/recompute"):
            for k, mini in enumerate(packed):
                routing_pass = None if routing is None else routing.pass_(replay=references[k], compare=references[k])
                gaps[k] = _recompute_old_logprobs(model, mini, settings.loss, pgs, routing=routing_pass)
                if routing_pass is not None:
                    if references[k] is None:
                        references[k] = routing_pass.recorded
                    else:
                        gaps[k].update(_routing_metrics(routing_pass, pgs, "moe_routing_rollout_changed_fraction",
                                                        per_layer=False))
    recompute_s = time.perf_counter() - start

    records = []
    for k, mini in enumerate(packed):
        start = time.perf_counter()
        routing_pass = None
        if routing is not None and references[k] is not None:
            replay = references[k] if settings.routing_replay != "off" else None
            routing_pass = routing.pass_(replay=replay, compare=references[k])
        # The policy's entropy comes with the recompute pass; without one, from the training forward.
        on_policy = fused and k == 0
        record = _optimizer_step(model, optimizer, mini, settings.loss, pgs, on_policy=on_policy,
                                 with_entropy=settings.old_logprobs == "rollout" or on_policy, routing=routing_pass)
        if routing_pass is not None and references[k] is not None:
            record.update(_routing_metrics(routing_pass, pgs, "moe_routing_changed_fraction"))
        if scheduler is not None:
            scheduler.step(1)
        record["train_time_s"] = time.perf_counter() - start
        record["padding_fraction"] = mini.padding_fraction
        record["train_tokens_per_s"] = record["response_tokens"] / max(record["train_time_s"], 1e-9)
        if settings.old_logprobs == "recompute":
            record.update(gaps[k])
            record["recompute_time_s"] = recompute_s / len(packed)
        elif k == 0:  # weights still those that sampled: the policy ratio is the train/rollout gap
            record["train_rollout_abs_delta_token"] = record["abs_log_ratio_per_token"]
            record["train_rollout_abs_delta_seq"] = record["abs_log_ratio_per_seq"]
        records.append(record)
    return records


def _check_routing(settings: StepSettings, routing: MoERouting | None, responses: Sequence[Trainable]) -> None:
    if settings.routing_replay == "off":
        return
    if routing is None:
        raise ValueError(f"routing_replay={settings.routing_replay!r} needs an MoE model (and its MoERouting)")
    if settings.routing_replay == "old" and settings.old_logprobs != "recompute":
        raise ValueError("routing_replay='old' replays the routing recorded while recomputing pi_old's "
                         "log-probs: it needs old_logprobs='recompute'")
    if settings.routing_replay == "rollout" and any(getattr(r, "routed_experts", None) is None for r in responses):
        raise ValueError("routing_replay='rollout' needs routed_experts (the sampler's routing) on every response")


def _rollout_targets(mini: PackedMiniBatch, routing: MoERouting, pgs: ProcessGroupCollection) -> list:
    """The rollout routing of each micro-batch as this rank's routers take it (per chunk, per router)."""
    cp, cp_rank = group_size(pgs.cp), group_rank(pgs.cp)
    return [routing.targets_from_full(split_for_cp(mb.routing_BSLk, cp, cp_rank, seq_dim=1))
            for mb in mini.micro_batches]


def _routing_metrics(routing_pass: RoutingPass, pgs: ProcessGroupCollection, name: str, *,
                     per_layer: bool = True) -> dict[str, float]:
    """Changed fraction over all (response token, layer) pairs of the global batch, and per layer.
    Tokens are split over data/context/sequence-parallel ranks, layers over pipeline stages."""
    counts = torch.stack([routing_pass.counts.changed_L, routing_pass.counts.tokens_L])
    for group in (pgs.mp, pgs.dp_cp):
        if group.size() > 1:
            dist.all_reduce(counts, group=group)
    changed_L, tokens_L = counts
    out = {name: changed_L.sum().item() / max(tokens_L.sum().item(), 1.0)}
    if per_layer:
        out.update({f"{name}_layer_{layer:02d}": changed / max(tokens, 1.0)
                    for layer, (changed, tokens) in enumerate(zip(changed_L.tolist(), tokens_L.tolist()))})
    return out


def _pack(responses: Sequence[Trainable], pgs: ProcessGroupCollection, max_tokens: int,
          pack_sequences: bool = False) -> PackedMiniBatch:
    """This DP rank's share of `responses` in micro-batches (equal ones under PP: uniform shapes)."""
    return pack_minibatch(responses, dp_size=pgs.dp.size(), dp_rank=pgs.dp.rank(), max_tokens=max_tokens,
                          pad_multiple=sequence_pad_multiple(pgs), uniform=pgs.pp.size() > 1,
                          pack_sequences=pack_sequences)


@torch.no_grad()
def _recompute_old_logprobs(model, mini: PackedMiniBatch, loss: LossSettings, pgs: ProcessGroupCollection, *,
                            routing: RoutingPass | None = None) -> dict:
    """Fill every micro-batch's old_logprobs_BS with the current policy's; return the rollout gap."""
    # Same modules, same mode, same micro-batches as the training forward: bitwise the same log-probs.
    with profiling.span("train/recompute/forward"):
        outputs = run_schedule(model, mini, logprobs_forward_step(loss, pgs=pgs, routing=routing), pgs=pgs,
                               forward_only=True)
    with profiling.span("train/recompute/metrics"):
        return _recompute_metrics(mini, outputs, pgs)


def _recompute_metrics(mini: PackedMiniBatch, outputs: list, pgs: ProcessGroupCollection) -> dict:
    if not is_pp_last_stage(pgs.pp):
        return _old_logprob_metrics([mini], [[]], [None], pgs)[0]
    logprobs = [gather_from_cp(out["logprobs"], pgs.cp) for out in outputs]
    entropy = torch.stack([sum(out["entropy_token_sum"] for out in outputs),
                           sum(out["response_tokens"] for out in outputs)])
    return _old_logprob_metrics([mini], [logprobs], [entropy], pgs)[0]


def _old_logprob_metrics(minis: Sequence[PackedMiniBatch], logprobs: Sequence[list], entropy: Sequence,
                         pgs: ProcessGroupCollection) -> list[dict]:
    """Set each mini-batch's old_logprobs_BS from pi_old's log-probs (per micro-batch, [B, S], whole rows:
    gathered over CP) and return its metrics: the train-vs-rollout gap and, where `entropy` gives its
    (entropy sum, tokens) over this rank's response tokens, the entropy. One all-reduce for all of them;
    the values reach every pipeline stage (only the last one has log-probs: the others pass [])."""
    if not is_pp_last_stage(pgs.pp):
        return _from_last_stage([{} for _ in minis], pgs)
    # per mini-batch: |delta| token sum, tokens, |seq delta| sum, seqs, non-finite; entropy sum, its tokens
    sums = torch.zeros(len(minis), 7, dtype=torch.float64)
    for k, (mini, mini_logprobs) in enumerate(zip(minis, logprobs)):
        for i, (mb, logprobs_BS) in enumerate(zip(mini.micro_batches, mini_logprobs)):
            mb.old_logprobs_BS = torch.where(mb.loss_mask_BS.bool(), logprobs_BS.float(), 0.0)
            if mini.rollout_logprobs and group_rank(pgs.cp) == 0:
                sums[k, :5] += _gap_sums(mb.old_logprobs_BS, mini.rollout_logprobs[i], mb.loss_mask_BS,
                                         mb.segments_BS, mb.num_sequences)
        if entropy[k] is not None:
            sums[k, 5:] += entropy[k]
    dist.all_reduce(sums, group=pgs.dp_cp)
    values = []
    for mini, e, row in zip(minis, entropy, sums.tolist()):
        abs_token, tokens, abs_seq, seqs, nonfinite, entropy_sum, entropy_tokens = row
        v = {} if e is None else {"entropy": entropy_sum / max(entropy_tokens, 1.0)}
        if mini.rollout_logprobs:
            v.update({"train_rollout_abs_delta_token": abs_token / max(tokens, 1.0),
                      "train_rollout_abs_delta_seq": abs_seq / max(seqs, 1.0),
                      "rollout_nonfinite_tokens": nonfinite})
        values.append(v)
    return _from_last_stage(values, pgs)


@torch.no_grad()
def _recompute_fused(model, packed: Sequence[PackedMiniBatch], minis: Sequence[Sequence[Trainable]],
                     settings: StepSettings, pgs: ProcessGroupCollection) -> list[dict]:
    """pi_old's log-probs of mini-batches 2..K (`packed`, with their responses `minis`) in one
    forward-only pass: this rank's rows of all of them, re-packed by the token budget; each row's
    log-probs go back to its place in its own micro-batch. The metrics of each mini-batch, as
    _recompute_metrics gives them. Dense models only (no routing to record per micro-batch); under
    PP the merged micro-batches are uniform, as the schedule needs."""
    if not packed:
        return []
    homes, rows = [], []   # (mini-batch, micro-batch, (row, start)) of each of this rank's responses, and it
    for k, mini in enumerate(packed):
        for j, (indices, places) in enumerate(zip(mini.rows, mini.places)):
            for i, place in zip(indices, places):
                homes.append((k, j, place))
                rows.append(minis[k][i])
    pack = dict(dp_size=1, dp_rank=0, max_tokens=settings.max_tokens_per_microbatch,
                pad_multiple=sequence_pad_multiple(pgs), uniform=pgs.pp.size() > 1,
                pack_sequences=settings.pack_sequences)
    merged = pack_minibatch(rows, **pack)
    if pgs.ep.size() > 1 and pgs.dp.size() > 1 and pgs.pp.size() == 1:
        # Each DP rank re-packs its own rows, but the experts' all-to-all spans DP ranks: every rank must
        # run as many micro-batches as the one with the most.
        count = torch.tensor(merged.num_microbatches)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=pgs.dp)
        if int(count) > merged.num_microbatches:
            merged = pack_minibatch(rows, **pack, min_microbatches=int(count))
    with profiling.span("train/recompute/forward"):
        outputs = run_schedule(model, merged, logprobs_forward_step(settings.loss, pgs=pgs), pgs=pgs,
                               forward_only=True)
    with profiling.span("train/recompute/metrics"):
        if not is_pp_last_stage(pgs.pp):
            return _old_logprob_metrics(packed, [[] for _ in packed], [None] * len(packed), pgs)
        # Scatter each response's positions back, gathered over CP (a row's CP split depends on its length).
        logprobs = [[torch.zeros(mb.tokens_BS.shape) for mb in mini.micro_batches] for mini in packed]
        entropy = torch.zeros(len(packed), 2, dtype=torch.float64)
        for indices, places, out in zip(merged.rows, merged.places, outputs):
            full_BS = gather_from_cp(out["logprobs"], pgs.cp)
            for q, (l, (row, start)) in enumerate(zip(indices, places)):
                k, j, (home_row, home_start) = homes[l]
                n = len(rows[l].prompt_ids) + len(rows[l].response_ids)
                logprobs[k][j][home_row, home_start:home_start + n] = full_BS[row, start:start + n]
                entropy[k] += torch.stack([out["entropy_seq_sum"][q], out["response_tokens_seq"][q]])
        return _old_logprob_metrics(packed, logprobs, list(entropy), pgs)


def _gap_sums(train_BS, rollout_BS, mask_BS, segments_BS=None, num_sequences: int | None = None) -> torch.Tensor:
    """Sums for the mean |train - rollout| log-prob per token and per sequence (mean over its tokens).
    Sequences: rows, or (packed rows) the `num_sequences` segments of `segments_BS`."""
    delta_BS = (train_BS.double() - rollout_BS.double())
    finite_BS = mask_BS.bool() & torch.isfinite(delta_BS)
    delta_BS = torch.where(finite_BS, delta_BS, 0.0)
    count_N = sequence_sums(finite_BS.long(), segments_BS, num_sequences)   # padding is never finite_BS: adds 0
    delta_N = sequence_sums(delta_BS, segments_BS, num_sequences)
    has = count_N > 0
    seq_N = delta_N.abs() / count_N.clamp(min=1)
    return torch.stack([delta_BS.abs().sum(), count_N.sum().double(), seq_N[has].sum(),
                        has.sum().double(), (mask_BS.bool() & ~finite_BS).sum().double()])


def _optimizer_step(model, optimizer, mini: PackedMiniBatch, loss: LossSettings, pgs: ProcessGroupCollection, *,
                    with_entropy: bool = False, routing: RoutingPass | None = None, on_policy: bool = False) -> dict:
    """One optimizer step on `mini`. on_policy: pi_old is this forward's own log-probs (policy_forward_step),
    which also fill old_logprobs_BS and give the train-vs-rollout gap, as a recompute pass would."""
    with profiling.span("train/zero_grad"):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    forward_step = policy_forward_step(loss, pgs=pgs, num_global_sequences=mini.num_global_sequences,
                                       num_microbatches=mini.num_microbatches, with_entropy=with_entropy,
                                       routing=routing, on_policy=on_policy)
    with profiling.span("train/forward_backward"):
        outputs = run_schedule(model, mini, forward_step, pgs=pgs, forward_only=False)
    with profiling.span("train/optimizer"):
        update_successful, grad_norm, _ = optimizer.step()
    with profiling.span("train/metrics"):
        record = _step_metrics(optimizer, mini, outputs, pgs, update_successful, grad_norm)
        if on_policy:
            logprobs = [gather_from_cp(o["logprobs"], pgs.cp) for o in outputs] if is_pp_last_stage(pgs.pp) else []
            record.update(_old_logprob_metrics([mini], [logprobs], [None], pgs)[0])
        return record


def _step_metrics(optimizer, mini: PackedMiniBatch, outputs: list, pgs: ProcessGroupCollection,
                  update_successful, grad_norm) -> dict:
    loss_metrics = {}
    if is_pp_last_stage(pgs.pp):
        raw = reduce_metrics([o["metrics"] for o in outputs], group=pgs.dp_cp)
        loss_sum = torch.stack([o["loss_sum"].double() for o in outputs]).sum()
        dist.all_reduce(loss_sum, group=pgs.dp_cp)
        loss_metrics = {"loss": loss_sum.item() / mini.num_global_sequences,
                        "sequences": float(mini.num_global_sequences), **summarize_metrics(raw)}
    # The optimizer's numbers are the same on every rank; the loss's live on the last stage.
    return {**_from_last_stage(loss_metrics, pgs),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_successful": float(bool(update_successful)),
            "lr": float(optimizer.param_groups[0]["lr"]),
            "microbatches": float(mini.num_microbatches)}


def _from_last_stage(values: dict, pgs: ProcessGroupCollection) -> dict:
    """`values` of the last pipeline stage, on every rank of the pipeline (identity without PP)."""
    if pgs.pp.size() == 1:
        return values
    box = [values]
    dist.broadcast_object_list(box, src=get_pp_last_rank(pgs.pp), group=pgs.pp)
    return box[0]


@torch.no_grad()
def compute_logprobs(model: list, responses: Sequence[Trainable], loss: LossSettings, *,
                     pgs: ProcessGroupCollection, max_tokens_per_microbatch: int = 8192,
                     pack_sequences: bool = False) -> list[list[float]]:
    """The current policy's log-prob of every response token (float32), for all responses on every rank.

    Data-parallel ranks each compute their share; the results are exchanged with all_gather_object.
    """
    mini = _pack(responses, pgs, max_tokens_per_microbatch, pack_sequences)
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
    mine = _from_last_stage(mine, pgs)
    return [mine[i] for i in range(len(responses))]
