"""Where pi_old's log-probs come from: one strategy, chosen once at set-up, asked once per rollout batch.

    source = old_logprobs_source(config.gspo, policy.routing)               # at set-up (training/setup.py)
    olds = source.prepare(model, packed, minis, settings, pgs)               # per batch, before any update
    # then mini-batch k trains with olds[k] (training/step.py)

Each strategy fills every mini-batch's `old_logprobs_BS` it can before the first update and says, per
mini-batch, what the training forward must do besides (an `OldPolicy`):

- `FromRollout` (gspo.old_logprobs=rollout): pi_old is the sampler's log-probs, which packing already put
  in `old_logprobs_BS`. Mini-batch 1 trains on the sampling weights, so its policy ratio *is* the
  train-vs-rollout gap; the policy's entropy comes from each training forward. With routing_replay=rollout
  the sampler's routing is replayed in the training forwards (R3).
- `FusedRecompute` (gspo.recompute=fused, dense models): mini-batch 1 trains on-policy, its pi_old being
  its own training forward's log-probs, detached (s_i == 1 exactly, no pass of its own); mini-batches
  2..K are recomputed together in one forward-only pass over this rank's rows of all of them, re-packed by
  the token budget (a few large micro-batches instead of K-1 small ones).
- `PerMinibatchRecompute` (gspo.recompute=per_minibatch; MoE models): one forward-only pass per mini-batch
  on exactly the micro-batches it will train on (its training forward then reproduces them bitwise), which
  also records pi_old's routing per micro-batch: replayed in the training forwards with routing_replay=old
  (R2), compared with them in every case (`moe/routing_changed_fraction`). With routing_replay=rollout the
  recompute itself replays the sampler's routing (R3) and reports how far its own routing is from it.

The train-vs-rollout gap (`train/rollout_abs_delta_*`) and the policy's entropy are measured in whichever
forward gives pi_old. gspo.recompute=auto picks fused for dense models and per_minibatch for MoE models
(whose routing is recorded per micro-batch); `fused` on an MoE model is refused before the run starts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.utils import get_pp_last_rank, is_pp_last_stage
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo import profiling
from megatron_gspo.config import CorrectionConfig, GSPOConfig
from megatron_gspo.loss.correction import MISMATCH_SUMS, apply_correction, mismatch_metrics, mismatch_sums
from megatron_gspo.microbatch import sequence_sums
from megatron_gspo.model.routing import MoERouting, RoutingPass
from megatron_gspo.model.schedule import run_schedule
from megatron_gspo.parallel.collectives import group_rank, group_size
from megatron_gspo.parallel.context_parallel import gather_from_cp, split_for_cp
from megatron_gspo.parallel.groups import sequence_pad_multiple
from megatron_gspo.training.forward_step import LossSettings, logprobs_forward_step
from megatron_gspo.training.packing import PackedMiniBatch, Trainable, pack_minibatch


@dataclass(frozen=True)
class StepSettings:
    """How one rollout batch is cut and trained (training/setup.py:step_settings builds it from the config)."""

    loss: LossSettings
    """Algorithm, clip range, temperature, true vocabulary size."""
    num_minibatches: int
    """K: optimizer steps per rollout batch (gspo.num_minibatches)."""
    max_tokens_per_microbatch: int
    """Micro-batch token budget, rows x padded length (parallel.max_tokens_per_microbatch)."""
    pack_sequences: bool
    """Several responses per row, each attending only to itself (parallel.pack_sequences)."""
    correction: CorrectionConfig
    """Train-inference mismatch correction and its metrics (section `correction`)."""


@dataclass
class OldPolicy:
    """pi_old of one mini-batch, as its training forward needs it."""

    metrics: dict[str, float] = field(default_factory=dict)
    """What producing pi_old measured: train-vs-rollout gap, the policy's entropy, the recompute's time,
    the recompute's routing against the sampler's."""
    on_policy: bool = False
    """pi_old is this mini-batch's training forward's own log-probs, detached: the training step measures
    the gap and the entropy there."""
    entropy_in_training: bool = False
    """The policy's entropy is not in `metrics`: the training forward computes it."""
    ratio_is_gap: bool = False
    """pi_old is the sampler's and the weights are still those that sampled: the policy ratio of this
    training forward is the train-vs-rollout gap."""
    routing: RoutingPass | None = None
    """MoE: the routing pass of the training forward (what it replays, what it is compared with)."""
    correction: CorrectionConfig | None = None
    """on_policy: the settings of the mismatch metrics the training step measures with the gap."""


class OldLogprobs(Protocol):
    def prepare(self, model: list, packed: Sequence[PackedMiniBatch], minis: Sequence[Sequence[Trainable]],
                settings: StepSettings, pgs: ProcessGroupCollection) -> list[OldPolicy]:
        """Before any update of the rollout batch: fill what pi_old it can into the mini-batches `packed`
        (this rank's share of `minis`); one OldPolicy per mini-batch. Collective."""


RoutingReplay = Literal["off", "old", "rollout"]


def old_logprobs_source(gspo: GSPOConfig, routing: MoERouting | None) -> OldLogprobs:
    """The strategy for gspo.old_logprobs / gspo.recompute / gspo.routing_replay (a validated GSPOConfig: the
    combinations config.py refuses never reach here; preflight refuses replay on a dense model and fused
    recompute on an MoE one) on a model whose routers are `routing` (None: dense, or routing not tracked)."""
    if gspo.old_logprobs == "rollout":
        return FromRollout(routing if gspo.routing_replay == "rollout" else None)
    recompute = gspo.recompute
    if recompute == "auto":
        recompute = "fused" if routing is None else "per_minibatch"
    if recompute == "fused":
        return FusedRecompute()
    return PerMinibatchRecompute(routing, gspo.routing_replay)


class FromRollout:
    """pi_old = the sampler's log-probs (module docstring). `routing`: replay the sampler's routing (R3)."""

    def __init__(self, routing: MoERouting | None):
        self.routing = routing

    def prepare(self, model, packed, minis, settings, pgs) -> list[OldPolicy]:
        if any(r.rollout_logprobs is None for mini in minis for r in mini):
            raise ValueError("old_logprobs='rollout' needs rollout_logprobs on every response")
        olds = []
        for k, mini in enumerate(packed):
            targets = rollout_targets(mini, self.routing, pgs) if self.routing is not None else None
            olds.append(OldPolicy(entropy_in_training=True, ratio_is_gap=k == 0,
                                  routing=None if targets is None else self.routing.pass_(replay=targets, compare=targets)))
        return olds


class FusedRecompute:
    """Mini-batch 1 on-policy, mini-batches 2..K in one forward-only pass (module docstring). Dense models."""

    def prepare(self, model, packed, minis, settings, pgs) -> list[OldPolicy]:
        start = time.perf_counter()
        # With the correction on, mini-batch 1's weights are needed before its forward: it gets its own
        # recompute pass, on the micro-batches it trains on (its s_i stay exactly 1).
        on_policy = not settings.correction.active
        with profiling.span("train/recompute"):
            first = [] if on_policy else [recompute_old_logprobs(model, packed[0], settings.loss, pgs,
                                                                 correction=settings.correction)]
            metrics = first + _recompute_fused(model, packed[1:], minis[1:], settings, pgs)
        seconds = (time.perf_counter() - start) / len(packed)
        olds = [OldPolicy({**m, "time/minibatch_recompute_s": seconds}) for m in metrics]
        if on_policy:
            olds.insert(0, OldPolicy({"time/minibatch_recompute_s": seconds}, on_policy=True, entropy_in_training=True,
                                     correction=settings.correction))
        return olds


class PerMinibatchRecompute:
    """One forward-only pass per mini-batch, recording (or replaying) its routing (module docstring)."""

    def __init__(self, routing: MoERouting | None, replay: RoutingReplay):
        self.routing, self.replay = routing, replay

    def prepare(self, model, packed, minis, settings, pgs) -> list[OldPolicy]:
        start = time.perf_counter()
        metrics, references = [], []
        with profiling.span("train/recompute"):
            for mini in packed:
                sampler = rollout_targets(mini, self.routing, pgs) if self.replay == "rollout" else None
                recording = None if self.routing is None else self.routing.pass_(replay=sampler, compare=sampler)
                metrics.append(recompute_old_logprobs(model, mini, settings.loss, pgs, routing=recording,
                                                      correction=settings.correction))
                if sampler is not None:
                    metrics[-1].update(routing_metrics(recording, pgs, "moe/routing_rollout_changed_fraction",
                                                       per_layer=False))
                references.append(sampler if sampler is not None else recording and recording.recorded)
        seconds = (time.perf_counter() - start) / len(packed)
        olds = []
        for m, reference in zip(metrics, references):
            routing = None
            if self.routing is not None:  # replayed (R2, R3) or routed freely, compared with pi_old's either way
                routing = self.routing.pass_(replay=None if self.replay == "off" else reference, compare=reference)
            olds.append(OldPolicy({**m, "time/minibatch_recompute_s": seconds}, routing=routing))
        return olds


# ---- the pieces ---------------------------------------------------------------------------------------

def pack(responses: Sequence[Trainable], pgs: ProcessGroupCollection, max_tokens: int,
         pack_sequences: bool) -> PackedMiniBatch:
    """This DP rank's share of `responses` in micro-batches (equal ones under PP: uniform shapes)."""
    rows = "uniform" if pgs.pp.size() > 1 else "packed" if pack_sequences else "padded"
    return pack_minibatch(responses, dp_size=pgs.dp.size(), dp_rank=pgs.dp.rank(), max_tokens=max_tokens,
                          pad_multiple=sequence_pad_multiple(pgs), rows=rows)


def rollout_targets(mini: PackedMiniBatch, routing: MoERouting, pgs: ProcessGroupCollection) -> list:
    """The sampler's routing of each micro-batch as this rank's routers take it (per chunk, per router)."""
    if any(mb.routing_BSLk is None for mb in mini.micro_batches):
        raise ValueError("routing_replay='rollout' needs routed_experts (the sampler's routing) on every response")
    cp, cp_rank = group_size(pgs.cp), group_rank(pgs.cp)
    return [routing.targets_from_full(split_for_cp(mb.routing_BSLk, cp, cp_rank, seq_dim=1))
            for mb in mini.micro_batches]


def routing_metrics(routing_pass: RoutingPass, pgs: ProcessGroupCollection, name: str, *,
                    per_layer: bool = True) -> dict[str, float]:
    """Changed fraction over all (response token, layer) pairs of the global batch, and per layer
    (`name`/layer_NN). Tokens are split over data/context/sequence-parallel ranks, layers over pipeline stages."""
    counts = torch.stack([routing_pass.counts.changed_L, routing_pass.counts.tokens_L])
    for group in (pgs.mp, pgs.dp_cp):
        if group.size() > 1:
            dist.all_reduce(counts, group=group)
    changed_L, tokens_L = counts
    out = {name: changed_L.sum().item() / max(tokens_L.sum().item(), 1.0)}
    if per_layer:
        out.update({f"{name}/layer_{layer:02d}": changed / max(tokens, 1.0)
                    for layer, (changed, tokens) in enumerate(zip(changed_L.tolist(), tokens_L.tolist()))})
    return out


def from_last_stage(values: dict, pgs: ProcessGroupCollection) -> dict:
    """`values` of the last pipeline stage, on every rank of the pipeline (identity without PP)."""
    if pgs.pp.size() == 1:
        return values
    box = [values]
    dist.broadcast_object_list(box, src=get_pp_last_rank(pgs.pp), group=pgs.pp)
    return box[0]


@torch.no_grad()
def recompute_old_logprobs(model, mini: PackedMiniBatch, loss: LossSettings, pgs: ProcessGroupCollection, *,
                           routing: RoutingPass | None = None, correction: CorrectionConfig | None = None) -> dict:
    """Fill every micro-batch's old_logprobs_BS with the current policy's (and the correction, when given
    and on); return the rollout gap and the mismatch metrics (set_old_logprobs)."""
    # Same modules, same mode, same micro-batches as the training forward: bitwise the same log-probs.
    with profiling.span("train/recompute/forward"):
        outputs = run_schedule(model, mini, logprobs_forward_step(loss, pgs=pgs, routing=routing), pgs=pgs,
                               forward_only=True)
    with profiling.span("train/recompute/metrics"):
        if not is_pp_last_stage(pgs.pp):
            return set_old_logprobs([mini], [[]], [None], pgs, correction)[0]
        logprobs = [gather_from_cp(out["logprobs"], pgs.cp) for out in outputs]
        entropy = torch.stack([sum(out["entropy_token_sum"] for out in outputs),
                               sum(out["response_tokens"] for out in outputs)])
        return set_old_logprobs([mini], [logprobs], [entropy], pgs, correction)[0]


def set_old_logprobs(minis: Sequence[PackedMiniBatch], logprobs: Sequence[list], entropy: Sequence,
                     pgs: ProcessGroupCollection, correction: CorrectionConfig | None) -> list[dict]:
    """Set each mini-batch's old_logprobs_BS from pi_old's log-probs (per micro-batch, [B, S], whole rows:
    gathered over CP) and return its metrics: the train-vs-rollout gap and, where `entropy` gives its
    (entropy sum, tokens) over this rank's response tokens, the entropy. Where the sampler's log-probs mu are
    known and `correction` is given: the mismatch metrics (correction/*, loss/correction.py), and with the
    correction on, its weights (correction_BS) and rejection (loss_mask_BS) for the training forwards. One
    sum all-reduce for all of them (and a max one for correction/weight_max); the values reach every pipeline
    stage (only the last one has log-probs: the others pass [] and keep their loss masks: there they only
    count the tokens of the routing metrics)."""
    if not is_pp_last_stage(pgs.pp):
        return from_last_stage([{} for _ in minis], pgs)
    # per mini-batch: |delta| token sum, tokens, |seq delta| sum, seqs, non-finite; entropy sum, its tokens;
    # then the mismatch sums (MISMATCH_SUMS; its weight_max travels in `maxes`)
    sums = torch.zeros(len(minis), 7 + len(MISMATCH_SUMS), dtype=torch.float64)
    maxes = torch.zeros(len(minis), dtype=torch.float64)
    at_max = 7 + MISMATCH_SUMS.index("weight_max")
    for k, (mini, mini_logprobs) in enumerate(zip(minis, logprobs)):
        for i, (mb, logprobs_BS) in enumerate(zip(mini.micro_batches, mini_logprobs)):
            mb.old_logprobs_BS = torch.where(mb.loss_mask_BS.bool(), logprobs_BS.float(), 0.0)
            if not mini.rollout_logprobs:
                continue
            if group_rank(pgs.cp) == 0:  # whole rows on every CP rank: counted once
                sums[k, :5] += _gap_sums(mb.old_logprobs_BS, mini.rollout_logprobs[i], mb.loss_mask_BS,
                                         mb.segments_BS, mb.num_sequences)
            if correction is not None:
                _correct(mb, mini.rollout_logprobs[i], correction, sums[k, 7:] if group_rank(pgs.cp) == 0 else None)
                maxes[k] = max(maxes[k], sums[k, at_max])
                sums[k, at_max] = 0.0
        if entropy[k] is not None:
            sums[k, 5:7] += entropy[k]
    dist.all_reduce(sums, group=pgs.dp_cp)
    if correction is not None:
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=pgs.dp_cp)
    values = []
    for mini, e, row, most in zip(minis, entropy, sums, maxes.tolist()):
        abs_token, tokens, abs_seq, seqs, nonfinite, entropy_sum, entropy_tokens = row[:7].tolist()
        v = {} if e is None else {"train/entropy": entropy_sum / max(entropy_tokens, 1.0)}
        if mini.rollout_logprobs:
            v.update({"train/rollout_abs_delta_token": abs_token / max(tokens, 1.0),
                      "train/rollout_abs_delta_seq": abs_seq / max(seqs, 1.0),
                      "train/rollout_nonfinite_tokens": nonfinite})
            if correction is not None:
                mismatch = row[7:].clone()
                mismatch[at_max - 7] = most
                v.update(mismatch_metrics(mismatch))
        values.append(v)
    return from_last_stage(values, pgs)


def _correct(mb, mu_BS: torch.Tensor, correction: CorrectionConfig, sums: torch.Tensor | None) -> None:
    """One micro-batch (whole rows): add its mismatch sums to `sums` (None: another CP rank counts them) and,
    with the correction on, set its weights and rejected tokens."""
    seq_T, num_seqs = mb.sequence_index()
    old_T, mu_T, mask_T = mb.old_logprobs_BS.flatten(), mu_BS.flatten(), mb.loss_mask_BS.flatten().bool()
    if sums is not None:
        sums += mismatch_sums(old_T, mu_T, mask_T, seq_T, num_seqs, correction)
    if correction.active:
        weights_T, kept_T = apply_correction(old_T, mu_T, mask_T, seq_T, num_seqs, correction)
        if correction.weight != "off":
            mb.correction_BS = weights_T.view_as(mb.loss_mask_BS)
        if correction.reject != "off":
            mb.loss_mask_BS = kept_T.to(mb.loss_mask_BS.dtype).view_as(mb.loss_mask_BS)


@torch.no_grad()
def _recompute_fused(model, packed: Sequence[PackedMiniBatch], minis: Sequence[Sequence[Trainable]],
                     settings: StepSettings, pgs: ProcessGroupCollection) -> list[dict]:
    """pi_old's log-probs of mini-batches 2..K (`packed`, with their responses `minis`) in one
    forward-only pass: this rank's rows of all of them, re-packed by the token budget; each row's
    log-probs go back to its place in its own micro-batch. The metrics of each mini-batch, as
    recompute_old_logprobs gives them. Dense models only (no routing to record per micro-batch); under
    PP the merged micro-batches are uniform, as the schedule needs."""
    if not packed:
        return []
    homes, rows = [], []   # (mini-batch, micro-batch, (row, start)) of each of this rank's responses, and it
    for k, mini in enumerate(packed):
        for j, (indices, places) in enumerate(zip(mini.rows, mini.places)):
            for i, place in zip(indices, places):
                homes.append((k, j, place))
                rows.append(minis[k][i])
    layout = "uniform" if pgs.pp.size() > 1 else "packed" if settings.pack_sequences else "padded"
    repack = dict(dp_size=1, dp_rank=0, max_tokens=settings.max_tokens_per_microbatch,
                  pad_multiple=sequence_pad_multiple(pgs), rows=layout)
    merged = pack_minibatch(rows, **repack)
    if pgs.ep.size() > 1 and pgs.dp.size() > 1 and pgs.pp.size() == 1:
        # Each DP rank re-packs its own rows, but the experts' all-to-all spans DP ranks: every rank must
        # run as many micro-batches as the one with the most.
        count = torch.tensor(merged.num_microbatches)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=pgs.dp)
        if int(count) > merged.num_microbatches:
            merged = pack_minibatch(rows, **repack, min_microbatches=int(count))
    with profiling.span("train/recompute/forward"):
        outputs = run_schedule(model, merged, logprobs_forward_step(settings.loss, pgs=pgs), pgs=pgs,
                               forward_only=True)
    with profiling.span("train/recompute/metrics"):
        if not is_pp_last_stage(pgs.pp):
            return set_old_logprobs(packed, [[] for _ in packed], [None] * len(packed), pgs, settings.correction)
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
        return set_old_logprobs(packed, logprobs, list(entropy), pgs, settings.correction)


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
