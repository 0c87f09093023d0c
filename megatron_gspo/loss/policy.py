"""Policy-gradient losses over packed tokens: GSPO (eq. 5), GSPO-token (eq. 13), GRPO (eq. 2).

Shapes: T = tokens this rank holds (packed, 1-D); S = sequences, delimited by `cu_seqlens` (S+1
offsets into the T tokens). Under context parallelism each rank holds a part of every sequence; the
per-sequence sums are all-reduced over `cp_group`.

Each function returns (loss_sum, num_sequences, metrics) with loss_sum / N_global = -J, where N_global
is num_sequences summed over every rank of the global batch (each sequence counted once: on CP rank 0).
Equation numbers are those of arXiv 2507.18071 (GSPO); the properties an implementation must have are
listed in docs/gspo.md and tested in tests/unit/test_policy_loss.py.
"""
from __future__ import annotations

from typing import Callable, Literal, NamedTuple

import torch
import torch.distributed as dist

from megatron_gspo.parallel.collectives import all_reduce_sum, group_rank, group_size

Algorithm = Literal["gspo", "gspo_token", "grpo"]

# (eps_low, eps_high): GSPO paper v2 section 5.1 for GSPO; GRPO's clip-higher values for GRPO.
DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    "grpo": (0.2, 0.27),
}

# How each raw metric combines across micro-batches and ranks (everything else is summed).
METRIC_REDUCTIONS: dict[str, str] = {"ratio_min": "min", "ratio_max": "max"}

LENGTH_BUCKETS: tuple[tuple[int, int | None], ...] = (
    (1, 16), (16, 32), (32, 64), (64, 96), (96, 128), (128, 192), (192, 256), (256, 512), (512, None))
"""Response-length buckets [low, high) of |y_i| for the ratio spreads by length (GSPO's case: token ratios
get noisier as responses grow, the sequence ratio averages them). Steps of 2x up to 64 and of 1.5x / 1.33x
from there, so that the long_addition_mixed task's responses (42, 74, 111, 148 tokens) fall in four buckets."""


def _bucket_name(low: int, high: int | None) -> str:
    return f"len_{low}-{high - 1}" if high is not None else f"len_{low}+"


class _Sequences(NamedTuple):
    """Per-token and per-sequence views of one packed batch, after masking and the CP reduction."""

    seq_T: torch.Tensor          # sequence index of each token (long)
    mask_T: torch.Tensor         # token counts in the loss: response token of a valid sequence
    logprobs_T: torch.Tensor     # current log-probs, 0 where not counted (NaN-free)
    log_ratio_T: torch.Tensor    # logp - old_logp where counted, else 0 (differentiable)
    log_ratio_sum_S: torch.Tensor  # sum over *all* CP ranks of log_ratio_T (differentiable)
    count_S: torch.Tensor        # response tokens per sequence over all CP ranks (float, no grad)
    valid_S: torch.Tensor        # non-empty and every response log-prob finite
    nonfinite_S: torch.Tensor    # some response token had a NaN/inf log-prob (current or old)
    owner: bool                  # this rank counts the sequences (CP rank 0)
    cp_group: object
    weights_T: torch.Tensor | None = None    # stop-gradient correction weight of each token's term (or None)
    weighted_log_ratio_sum_S: torch.Tensor | None = None  # value = log_ratio_sum_S, gradient weighted by w_t
    weight_mean_S: torch.Tensor | None = None  # mean w_t over each sequence's tokens (no grad)


def _sequence_index(cu_seqlens, sequence_ids, num_sequences, num_tokens: int, device):
    """(seq_T, S): each token's sequence and the number of sequences, from cu_seqlens or sequence_ids."""
    if (cu_seqlens is None) == (sequence_ids is None):
        raise ValueError("give exactly one of cu_seqlens and sequence_ids")
    if sequence_ids is not None:
        seq_T = torch.as_tensor(sequence_ids, device=device)
        if seq_T.shape != (num_tokens,) or seq_T.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"sequence_ids must be [{num_tokens}] integers, got {tuple(seq_T.shape)} {seq_T.dtype}")
        if num_sequences is None or num_sequences < 0 or \
                (num_tokens and not 0 <= int(seq_T.min()) <= int(seq_T.max()) < num_sequences):
            raise ValueError(f"sequence_ids must lie in [0, num_sequences={num_sequences})")
        return seq_T.long(), num_sequences
    given = torch.as_tensor(cu_seqlens, device=device)
    cu_seqlens = given.long()
    # Checked on `given`: a cast to long alone would turn 2.5 into 2 (silently moving a boundary), and
    # an empty tensor has no [0] to compare.
    if given.dim() != 1 or given.numel() == 0 or (given != cu_seqlens).any() or cu_seqlens[0] != 0 \
            or cu_seqlens[-1] != num_tokens or (cu_seqlens.diff() < 0).any():
        raise ValueError(f"cu_seqlens must be integers rising from 0 to {num_tokens} tokens, "
                         f"got {given.tolist()}")
    num_seqs = cu_seqlens.numel() - 1
    return torch.repeat_interleave(torch.arange(num_seqs, device=cu_seqlens.device), cu_seqlens.diff()), num_seqs


def _sequences(logprobs_T, old_logprobs_T, loss_mask_T, cu_seqlens, cp_group, sequence_ids=None,
               num_sequences=None, weights_T=None) -> _Sequences:
    num_tokens = logprobs_T.shape[0]
    if not (old_logprobs_T.shape == loss_mask_T.shape == logprobs_T.shape) or logprobs_T.dim() != 1:
        raise ValueError(f"logprobs {tuple(logprobs_T.shape)}, old_logprobs {tuple(old_logprobs_T.shape)}"
                         f" and loss_mask {tuple(loss_mask_T.shape)} must be equal 1-D shapes")
    seq_T, num_seqs = _sequence_index(cu_seqlens, sequence_ids, num_sequences, num_tokens, logprobs_T.device)

    logprobs_T = logprobs_T.float()
    old_logprobs_T = old_logprobs_T.float()
    response_T = loss_mask_T.bool()
    finite_T = torch.isfinite(logprobs_T) & torch.isfinite(old_logprobs_T)
    usable_T = response_T & finite_T
    # torch.where, not multiplication: a NaN outside the mask must not reach values or gradients.
    logprobs_T = torch.where(usable_T, logprobs_T, torch.zeros_like(logprobs_T))
    old_logprobs_T = torch.where(usable_T, old_logprobs_T, torch.zeros_like(old_logprobs_T))
    log_ratio_T = logprobs_T - old_logprobs_T

    def per_seq(values_T: torch.Tensor) -> torch.Tensor:
        return values_T.new_zeros(num_seqs).index_add(0, seq_T, values_T)

    # One collective for the whole batch: [log-ratio sum, token count, non-finite count] per sequence (with
    # correction weights also the weighted-gradient log-ratio sum and the weight sum). Only the sums of
    # log-ratios carry gradient; the counts ride along to avoid a second round trip.
    columns = [per_seq(log_ratio_T), per_seq(response_T.float()), per_seq((response_T & ~finite_T).float())]
    if weights_T is not None:
        weights_T = torch.where(usable_T, weights_T.float().detach(), torch.ones_like(log_ratio_T))
        # value sum_t x_t, gradient sum_t w_t dx_t (w_t = 1: the same number, bit for bit)
        columns += [per_seq(weights_T * log_ratio_T + (1 - weights_T) * log_ratio_T.detach()),
                    per_seq(torch.where(usable_T, weights_T, torch.zeros_like(weights_T)))]
    stats_S = all_reduce_sum(torch.stack(columns, dim=1), cp_group)
    log_ratio_sum_S, count_S, nonfinite_count_S = stats_S[:, :3].unbind(dim=1)
    count_S, nonfinite_S = count_S.detach(), nonfinite_count_S.detach() > 0
    valid_S = (count_S > 0) & ~nonfinite_S
    mask_T = usable_T & valid_S[seq_T]
    weighted_S = weight_mean_S = None
    if weights_T is not None:
        weighted_S, weight_mean_S = stats_S[:, 3], stats_S[:, 4].detach() / count_S.clamp(min=1)
    return _Sequences(seq_T, mask_T, logprobs_T, log_ratio_T, log_ratio_sum_S, count_S, valid_S,
                      nonfinite_S, owner=group_rank(cp_group) == 0, cp_group=cp_group, weights_T=weights_T,
                      weighted_log_ratio_sum_S=weighted_S, weight_mean_S=weight_mean_S)


def _sequence_log_ratio(seqs: _Sequences, max_log_ratio: float, sum_S: torch.Tensor | None = None) -> torch.Tensor:
    """log s_i = mean per-token log-ratio (GSPO eq. 7 in log space), clamped so exp() stays finite.
    `sum_S`: another sum of the log-ratios to take the mean of (the correction's weighted-gradient one)."""
    mean_S = (seqs.log_ratio_sum_S if sum_S is None else sum_S) / seqs.count_S.clamp(min=1)
    mean_S = torch.where(seqs.valid_S, mean_S, torch.zeros_like(mean_S))
    return mean_S.clamp(-max_log_ratio, max_log_ratio)


def _clipped_surrogate(ratio, advantages, eps_low: float, eps_high: float):
    """min(r A, clip(r, 1-eps_low, 1+eps_high) A) and where clipping zeroes the gradient."""
    objective = torch.minimum(ratio * advantages, ratio.clamp(1 - eps_low, 1 + eps_high) * advantages)
    clipped = ((advantages > 0) & (ratio > 1 + eps_high)) | ((advantages < 0) & (ratio < 1 - eps_low))
    return objective, clipped


def _per_token(advantages: torch.Tensor, seqs: _Sequences) -> torch.Tensor:
    """Advantages given per sequence [S] or per token [T], as a float32 per-token tensor."""
    num_seqs, num_tokens = seqs.count_S.shape[0], seqs.seq_T.shape[0]
    advantages = advantages.float()
    if advantages.shape == (num_tokens,) and num_tokens != num_seqs:
        return advantages
    if advantages.shape == (num_seqs,):
        return advantages[seqs.seq_T]
    raise ValueError(f"advantages of shape {tuple(advantages.shape)}: expected [{num_seqs}] (per "
                     f"sequence) or [{num_tokens}] (per token)")


def gspo(seqs: _Sequences, advantages_S: torch.Tensor, eps_low: float, eps_high: float,
         max_log_ratio: float):
    """GSPO eq. 5: one importance ratio per sequence, s_i = exp(mean_t log-ratio), clipped as a whole."""
    num_seqs = seqs.count_S.shape[0]
    if advantages_S.shape != (num_seqs,):
        raise ValueError(f"gspo takes one advantage per sequence: expected [{num_seqs}], got "
                         f"{tuple(advantages_S.shape)} (per-token advantages: use gspo_token)")
    ratio_S = torch.exp(_sequence_log_ratio(seqs, max_log_ratio))
    objective_S, clipped_S = _clipped_surrogate(ratio_S, advantages_S.float(), eps_low, eps_high)
    if seqs.weights_T is not None:
        # Correction weights enter through the GSPO-token form, (1/|y_i|) sum_t w_t min(s_it A_i, clip(s_it) A_i)
        # (docs/gspo.md): value wbar_i * term_i, gradient that of the weighted log-ratio sum's s_i.
        weighted_S = torch.exp(_sequence_log_ratio(seqs, max_log_ratio, seqs.weighted_log_ratio_sum_S))
        surrogate_S, clipped_S = _clipped_surrogate(weighted_S, advantages_S.float(), eps_low, eps_high)
        objective_S = (seqs.weight_mean_S * objective_S).detach() + surrogate_S - surrogate_S.detach()
        ratio_S = ratio_S.detach()
    clipped_S &= seqs.valid_S
    # The sequence term lives on CP rank 0; other CP ranks add it with weight 0 so that they run the
    # all-reduce's backward too (it delivers dL/d(log-ratio sum) to every rank's tokens).
    weight = 1.0 if seqs.owner else 0.0
    loss_sum = -(weight * torch.where(seqs.valid_S, objective_S, torch.zeros_like(objective_S))).sum()
    return loss_sum, ratio_S, clipped_S, clipped_S[seqs.seq_T] & seqs.mask_T


def gspo_token(seqs: _Sequences, advantages: torch.Tensor, eps_low: float, eps_high: float,
               max_log_ratio: float):
    """GSPO-token eq. 13: s_it = sg[s_i] * exp(logp_t - sg[logp_t]), value s_i, per-token advantage."""
    ratio_S = torch.exp(_sequence_log_ratio(seqs, max_log_ratio)).detach()
    ratio_T = ratio_S[seqs.seq_T] * torch.exp(seqs.logprobs_T - seqs.logprobs_T.detach())
    objective_T, clipped_T = _clipped_surrogate(ratio_T, _per_token(advantages, seqs), eps_low, eps_high)
    return _token_mean_loss(objective_T, clipped_T, ratio_S, seqs)


def grpo(seqs: _Sequences, advantages: torch.Tensor, eps_low: float, eps_high: float,
         max_log_ratio: float):
    """GRPO eq. 2: per-token ratio w_t = exp(logp_t - old_logp_t), per-token clip, sequence mean."""
    ratio_S = torch.exp(_sequence_log_ratio(seqs, max_log_ratio)).detach()  # reported only
    ratio_T = torch.exp(seqs.log_ratio_T.clamp(-max_log_ratio, max_log_ratio))
    objective_T, clipped_T = _clipped_surrogate(ratio_T, _per_token(advantages, seqs), eps_low, eps_high)
    return _token_mean_loss(objective_T, clipped_T, ratio_S, seqs)


def _token_mean_loss(objective_T, clipped_T, ratio_S, seqs: _Sequences):
    """-(1/|y_i|) sum_t objective over each sequence's tokens; tokens local, |y_i| global (CP)."""
    scale_T = 1.0 / seqs.count_S.clamp(min=1)[seqs.seq_T]
    if seqs.weights_T is not None:  # correction weights: each token's term times its w_t
        objective_T = objective_T * seqs.weights_T
    loss_sum = -torch.where(seqs.mask_T, objective_T * scale_T, torch.zeros_like(objective_T)).sum()
    clipped_T = clipped_T & seqs.mask_T
    # A sequence counts as clipped when any of its tokens is; its tokens may sit on other CP ranks.
    clipped_tokens_S = torch.zeros_like(seqs.count_S).index_add(0, seqs.seq_T, clipped_T.float())
    if group_size(seqs.cp_group) > 1:
        torch.distributed.all_reduce(clipped_tokens_S, group=seqs.cp_group)
    return loss_sum, ratio_S, clipped_tokens_S > 0, clipped_T


_ALGORITHMS: dict[str, Callable] = {"gspo": gspo, "gspo_token": gspo_token, "grpo": grpo}


def clip_range(algorithm: Algorithm, eps_low: float | None = None, eps_high: float | None = None
               ) -> tuple[float, float]:
    """(eps_low, eps_high) with the algorithm's defaults (DEFAULT_CLIP) in place of None."""
    default_low, default_high = DEFAULT_CLIP[algorithm]
    return (default_low if eps_low is None else eps_low, default_high if eps_high is None else eps_high)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                loss_mask: torch.Tensor, cu_seqlens, *, algorithm: Algorithm = "gspo",
                eps_low: float | None = None, eps_high: float | None = None, cp_group=None,
                max_log_ratio: float = 20.0, sequence_ids=None, num_sequences: int | None = None,
                weights: torch.Tensor | None = None):
    """(loss_sum, num_sequences, metrics) with loss_sum / N_global = -J of the chosen algorithm.

    logprobs: [T] current log-probs (grad flows); old_logprobs: [T] behaviour policy's; loss_mask: [T]
    1 on trained response tokens; advantages: [S] per sequence (any algorithm) or [T] per token
    (gspo_token, grpo). eps_low/eps_high default to the algorithm's own (DEFAULT_CLIP).
    The sequences are contiguous runs given by `cu_seqlens`, or (cu_seqlens=None) any positions:
    `sequence_ids` [T] gives each token's sequence in 0..num_sequences-1 (packed rows under CP, where a
    rank holds two separate chunks of each row); num_sequences must then be the same on every CP rank.
    Sequences that are empty or hold a non-finite response log-prob contribute 0 and no gradient,
    are still counted in num_sequences, and are reported in the metrics.
    `weights`: [T] stop-gradient train-inference correction weights (loss/correction.py), each multiplying its
    token's term (GSPO: in its GSPO-token form, docs/gspo.md); None: no correction.
    """
    if algorithm not in _ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(_ALGORITHMS)}, got {algorithm!r}")
    eps_low, eps_high = clip_range(algorithm, eps_low, eps_high)
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    seqs = _sequences(logprobs, old_logprobs, loss_mask, cu_seqlens, cp_group, sequence_ids, num_sequences,
                      None if weights is None else weights.to(logprobs.device))
    loss_sum, ratio_S, clipped_S, clipped_T = _ALGORITHMS[algorithm](
        seqs, advantages.to(logprobs.device), eps_low, eps_high, max_log_ratio)
    num_sequences = seqs.count_S.shape[0] if seqs.owner else 0
    return loss_sum, num_sequences, _metrics(seqs, ratio_S.detach(), clipped_S, clipped_T)


@torch.no_grad()
def _metrics(seqs: _Sequences, ratio_S, clipped_S, clipped_T) -> dict[str, torch.Tensor]:
    """Raw aggregates, summable across micro-batches and ranks (see METRIC_REDUCTIONS).

    Sequence-level entries are counted by the owning CP rank only; token-level ones by every rank for
    the tokens it holds, so sums over all ranks count each sequence and each token once.
    """
    own = seqs.valid_S if seqs.owner else torch.zeros_like(seqs.valid_S)
    f64 = lambda x: torch.as_tensor(x, dtype=torch.float64)
    ratio = ratio_S.double()
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    log_w = seqs.log_ratio_T.detach().double()
    log_s = (seqs.log_ratio_sum_S.detach() / seqs.count_S.clamp(min=1)).double()
    return {
        "sequences": f64(own.numel() if seqs.owner else 0),
        "sequences_valid": f64(own.sum()),
        "sequences_empty": f64((seqs.count_S == 0).sum() if seqs.owner else 0),
        "sequences_nonfinite": f64(seqs.nonfinite_S.sum() if seqs.owner else 0),
        "sequences_clipped": f64((clipped_S & own).sum()),
        "tokens": f64(seqs.mask_T.sum()),
        "tokens_clipped": f64(clipped_T.sum()),
        "ratio_sum": torch.where(own, ratio, 0).sum(),
        "ratio_min": torch.where(own, ratio, inf).min() if own.numel() else inf,
        "ratio_max": torch.where(own, ratio, -inf).max() if own.numel() else -inf,
        "abs_log_ratio_token_sum": torch.where(seqs.mask_T, seqs.log_ratio_T.detach().abs(), 0).sum().double(),
        "abs_log_ratio_seq_sum": torch.where(own, log_s.abs(), 0).sum().double(),
        # Spreads of log w_t (token ratios, GRPO's) and log s_i (sequence ratios, GSPO's): Fig. 3's argument.
        "log_ratio_token_sum": torch.where(seqs.mask_T, log_w, 0).sum().double(),
        "log_ratio_token_sq_sum": torch.where(seqs.mask_T, log_w.square(), 0).sum().double(),
        "log_ratio_seq_sum": torch.where(own, log_s, 0).sum().double(),
        "log_ratio_seq_sq_sum": torch.where(own, log_s.square(), 0).sum().double(),
        **_spreads_by_length(seqs, own, log_w, log_s, clipped_T),
    }


def _spreads_by_length(seqs: _Sequences, own, log_w, log_s, clipped_T) -> dict[str, torch.Tensor]:
    """The same sums per response-length bucket (LENGTH_BUCKETS; |y_i| over all CP ranks), and the clipped
    tokens."""
    out = {}
    for low, high in LENGTH_BUCKETS:
        in_S = (seqs.count_S >= low) & ((seqs.count_S < high) if high is not None else True)
        seq_in, tok_in = own & in_S, seqs.mask_T & in_S[seqs.seq_T]
        name = _bucket_name(low, high)
        out.update({f"{name}_seqs": seq_in.sum().double(), f"{name}_log_s_sum": torch.where(seq_in, log_s, 0).sum(),
                    f"{name}_log_s_sq_sum": torch.where(seq_in, log_s.square(), 0).sum(),
                    f"{name}_tokens": tok_in.sum().double(), f"{name}_log_w_sum": torch.where(tok_in, log_w, 0).sum(),
                    f"{name}_log_w_sq_sum": torch.where(tok_in, log_w.square(), 0).sum(),
                    f"{name}_tokens_clipped": (clipped_T & tok_in).sum().double()})
    return out


def summarize_metrics(raw: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """User-facing numbers from reduced raw aggregates (docs/gspo.md's metric list), under their logged names:
    loss/ for the objective's ratios and clipping, train/ for the tokens and the policy's entropy."""
    get = lambda k: float(raw[k])
    valid, tokens = max(get("sequences_valid"), 1.0), max(get("tokens"), 1.0)
    return {
        "loss/clipped_fraction_seq": get("sequences_clipped") / valid,
        "loss/clipped_fraction_token": get("tokens_clipped") / tokens,
        "loss/ratio_mean": get("ratio_sum") / valid,
        "loss/ratio_min": get("ratio_min"),
        "loss/ratio_max": get("ratio_max"),
        "loss/abs_log_ratio_per_token": get("abs_log_ratio_token_sum") / tokens,
        "loss/abs_log_ratio_per_seq": get("abs_log_ratio_seq_sum") / valid,
        "loss/log_ratio_token_std": _std(get("log_ratio_token_sum"), get("log_ratio_token_sq_sum"), tokens),
        "loss/log_ratio_seq_std": _std(get("log_ratio_seq_sum"), get("log_ratio_seq_sq_sum"), valid),
        "loss/sequences_empty": get("sequences_empty"),
        "loss/sequences_nonfinite": get("sequences_nonfinite"),
        "train/response_tokens": get("tokens"),
        **({"train/entropy": get("entropy_token_sum") / tokens} if "entropy_token_sum" in raw else {}),
        **{metric: value for low, high in LENGTH_BUCKETS for metric, value in _bucket_spreads(raw, low, high).items()},
    }


def _bucket_spreads(raw, low: int, high: int | None) -> dict[str, float]:
    """loss/log_ratio_{token,seq}_std/len_A-B, loss/clipped_fraction_token/len_A-B and the bucket's sequence
    count, where it has sequences."""
    name = _bucket_name(low, high)
    if f"{name}_seqs" not in raw or float(raw[f"{name}_seqs"]) < 1:
        return {}
    get = lambda k: float(raw[f"{name}_{k}"])  # noqa: E731
    return {f"loss/sequences/{name}": get("seqs"),
            f"loss/log_ratio_token_std/{name}": _std(get("log_w_sum"), get("log_w_sq_sum"), get("tokens")),
            f"loss/log_ratio_seq_std/{name}": _std(get("log_s_sum"), get("log_s_sq_sum"), get("seqs")),
            f"loss/clipped_fraction_token/{name}": get("tokens_clipped") / max(get("tokens"), 1.0)}


def _std(total: float, sq_total: float, count: float) -> float:
    """Population standard deviation from a sum and a sum of squares (0 for fewer than 2 values)."""
    if count < 2:
        return 0.0
    mean = total / count
    return max(sq_total / count - mean * mean, 0.0) ** 0.5


def reduce_metrics(metrics: list[dict[str, torch.Tensor]], group=None) -> dict[str, torch.Tensor]:
    """Combine raw metrics of several micro-batches, then across `group` (None: this rank only): one
    all-reduce per kind of reduction (sum, min, max) for all the keys."""
    out: dict[str, torch.Tensor] = {}
    for how, op in (("sum", dist.ReduceOp.SUM), ("min", dist.ReduceOp.MIN), ("max", dist.ReduceOp.MAX)):
        keys = [k for k in metrics[0] if METRIC_REDUCTIONS.get(k, "sum") == how]
        if not keys:
            continue
        values = torch.stack([torch.stack([m[k].double() for k in keys]) for m in metrics])  # [micro-batch, key]
        combined = values.min(0).values if how == "min" else values.max(0).values if how == "max" else values.sum(0)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(combined, op=op, group=group)
        out.update(zip(keys, combined.unbind()))
    return out
