"""Train-inference mismatch: importance correction of the behaviour policy mu (the sampler) towards pi_old.

Shapes: T = tokens (1-D, whole sequences: the correction is computed where every token of a sequence is at
hand, before the training forwards), S = sequences (`seq_T` gives each token's).

The sampler and the trainer never compute exactly the same probabilities, so the samples come from mu, not
from pi_old. With r_t = pi_old(y_t) / mu(y_t) on the trained tokens (m_t = 1):

- weight (TIS): a stop-gradient factor on each token's term of the policy objective:
    token:     w_t = min(cap, r_t)
    sequence:  w_t = W_i = min(cap, prod_t r_t)                     (every token of sequence i)
    geometric: w_t = W_i = min(cap, (prod_t r_t) ** (1/|y_i|))      (length-normalised, like GSPO's s_i)
- reject (MIS / IcePop's two-sided mask): m_t = 0 where the ratio lies outside [low, high]:
    token: the token's r_t; sequence: prod_t r_t, for all of i's tokens; geometric: its geometric mean.
  Rejected tokens then count nowhere, as a stale prefix does: not in |y_i|, not in log s_i, not in the
  weights (the rejection is applied first, the weights are computed over the tokens kept).

How the weights enter each objective is docs/gspo.md's "Train-inference mismatch" (loss/policy.py applies
them). `mismatch_sums` gives the metrics every peer logs, whether the correction is on or not.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_gspo.config import CorrectionConfig, CorrectionMode

MAX_LOG_RATIO = 20.0
"""log r is clamped to +-this before exp (GSPO.md, Numerics): a ratio of e^20 is already far past any cap."""


def _log_ratios(old_T: torch.Tensor, mu_T: torch.Tensor, mask_T: torch.Tensor) -> torch.Tensor:
    """log r_t in float64, 0 off the mask (and where either log-prob is not finite, which packing refuses
    for the sampler's and the loss reports for pi_old's)."""
    log_r = old_T.double() - mu_T.double()
    return torch.where(mask_T & torch.isfinite(log_r), log_r, 0.0).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _per_seq(values_T: torch.Tensor, seq_T: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return values_T.new_zeros(num_seqs).index_add(0, seq_T, values_T)


def _sequence_log_ratio(log_r_T, mask_T, seq_T, num_seqs: int, mode: CorrectionMode) -> torch.Tensor:
    """Per token, its sequence's log of prod r_t (sequence) or of the geometric mean (geometric)."""
    sum_S = _per_seq(log_r_T, seq_T, num_seqs)
    if mode == "geometric":
        sum_S = sum_S / _per_seq(mask_T.double(), seq_T, num_seqs).clamp(min=1)
    return sum_S[seq_T]


def apply_correction(old_T: torch.Tensor, mu_T: torch.Tensor, mask_T: torch.Tensor, seq_T: torch.Tensor,
                     num_seqs: int, correction: CorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_T float32, mask_T bool): the stop-gradient weight of each token's term and the trained-token
    mask after rejection, for whole sequences (module docstring). Weights are 1 where the mask is 0."""
    mask_T = mask_T.bool()
    low, high = correction.reject_band
    if correction.reject != "off":
        log_r = _log_ratios(old_T, mu_T, mask_T)
        if correction.reject != "token":
            log_r = _sequence_log_ratio(log_r, mask_T, seq_T, num_seqs, correction.reject)
        mask_T = mask_T & (log_r >= torch.log(torch.tensor(low, dtype=torch.float64))) \
            & (log_r <= torch.log(torch.tensor(high, dtype=torch.float64)))
    weights_T = torch.ones(mask_T.shape, dtype=torch.float32)
    if correction.weight != "off":
        log_w = _log_ratios(old_T, mu_T, mask_T)
        if correction.weight != "token":
            log_w = _sequence_log_ratio(log_w, mask_T, seq_T, num_seqs, correction.weight)
        weights_T = torch.where(mask_T, torch.exp(log_w).clamp(max=correction.weight_cap), 1.0).float()
    return weights_T, mask_T


MISMATCH_SUMS = ("tokens", "k3_sum", "abs_log_ratio_sum", "sequences", "seq_weight_sum", "seq_weight_sq_sum",
                 "weight_units", "weight_sum", "weight_max", "truncated", "rejected_units", "reject_units")
"""The columns of `mismatch_sums`, each summable over micro-batches and ranks (weight_max: a max)."""


def mismatch_sums(old_T: torch.Tensor, mu_T: torch.Tensor, mask_T: torch.Tensor, seq_T: torch.Tensor,
                  num_seqs: int, correction: CorrectionConfig) -> torch.Tensor:
    """[len(MISMATCH_SUMS)] float64 sums over whole sequences for the mismatch metrics (`mismatch_metrics`).

    k3 = r - 1 - log r estimates KL(mu || pi_old) from samples of mu; the effective sample size takes the
    untruncated sequence weights prod_t r_t (log clamped to +-300: float64 squares stay finite). The weight
    metrics describe the weights applied (with weight=off: what token TIS at weight_cap would apply), over
    their units (tokens for token, sequences otherwise) after the configured rejection; the rejected fraction
    is over the trained tokens (token) or sequences (sequence, geometric), with reject=off what the band
    would reject token by token."""
    mask_T = mask_T.bool()
    log_r = _log_ratios(old_T, mu_T, mask_T)
    has_S = _per_seq(mask_T.double(), seq_T, num_seqs) > 0
    log_W = _per_seq(log_r, seq_T, num_seqs).clamp(-300, 300)[has_S]
    k3 = torch.where(mask_T, torch.exp(log_r) - 1 - log_r, 0.0)
    weight = correction.weight if correction.weight != "off" else "token"
    reject = correction.reject if correction.reject != "off" else "token"
    weights_T, kept_T = apply_correction(old_T, mu_T, mask_T, seq_T, num_seqs,
                                         dataclasses.replace(correction, weight=weight))
    log_r_kept = _log_ratios(old_T, mu_T, kept_T)
    if weight == "token":
        weights, uncapped = weights_T[kept_T].double(), torch.exp(log_r_kept[kept_T])
    else:
        first = _first_token_of_each(seq_T, kept_T, num_seqs)
        weights = weights_T[first].double()
        uncapped = torch.exp(_sequence_log_ratio(log_r_kept, kept_T, seq_T, num_seqs, weight)[first])
    _, kept_by_band = apply_correction(old_T, mu_T, mask_T, seq_T, num_seqs,
                                       dataclasses.replace(correction, weight="off", reject=reject))
    if reject == "token":
        rejected, reject_units = (mask_T & ~kept_by_band).sum(), mask_T.sum()
    else:
        first = _first_token_of_each(seq_T, mask_T, num_seqs)
        rejected, reject_units = (~kept_by_band[first]).sum(), first.numel()
    return torch.tensor([
        float(mask_T.sum()), float(k3.sum()), float(log_r.abs().sum()),
        float(has_S.sum()), float(torch.exp(log_W).sum()), float(torch.exp(2 * log_W).sum()),
        float(weights.numel()), float(weights.sum()), float(weights.max()) if weights.numel() else 0.0,
        float((uncapped > correction.weight_cap).sum()), float(rejected), float(reject_units)],
        dtype=torch.float64)


def _first_token_of_each(seq_T: torch.Tensor, mask_T: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Index of one trained token of each sequence that has any (the sequence-level values repeat over them)."""
    positions = torch.arange(seq_T.numel())
    first = torch.full((num_seqs,), seq_T.numel(), dtype=torch.long)
    first = first.scatter_reduce(0, seq_T[mask_T], positions[mask_T], reduce="amin")
    return first[first < seq_T.numel()]


def mismatch_metrics(sums: torch.Tensor) -> dict[str, float]:
    """correction/* metrics from `mismatch_sums` summed over the batch (weight_max: its max)."""
    s = dict(zip(MISMATCH_SUMS, sums.tolist()))
    tokens, seqs = max(s["tokens"], 1.0), max(s["sequences"], 1.0)
    units = max(s["weight_units"], 1.0)
    return {"correction/kl_k3": s["k3_sum"] / tokens,
            "correction/log_ratio_abs_mean": s["abs_log_ratio_sum"] / tokens,
            "correction/ess": s["seq_weight_sum"] ** 2 / (seqs * s["seq_weight_sq_sum"]) if s["seq_weight_sq_sum"] else 1.0,
            "correction/weight_mean": s["weight_sum"] / units,
            "correction/weight_max": s["weight_max"],
            "correction/truncated_fraction": s["truncated"] / units,
            "correction/rejected_fraction": s["rejected_units"] / max(s["reject_units"], 1.0)}
