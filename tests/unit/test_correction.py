"""Train-inference correction (loss/correction.py + the weights in loss/policy.py) against an independent float64
reference written from docs/gspo.md's definitions, token by token: values and gradients, every mode of weight
and reject, every algorithm, with masked tokens (a stale prefix), an empty sequence and a fully rejected one."""
import itertools
import math

import pytest
import torch

from megatron_gspo.config import CorrectionConfig
from megatron_gspo.loss.correction import apply_correction, mismatch_metrics, mismatch_sums
from megatron_gspo.loss.policy import clip_range, policy_loss

MODES = ("off", "token", "sequence", "geometric")


def batch(seed: int = 0):
    """5 sequences: lengths 6, 4, 0 (empty), 5, 7; the first 2 tokens of sequence 0 are a stale prefix
    (m = 0); sequence 3's sampler log-probs are far from pi_old's (a sequence to reject)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 4, 0, 5, 7]
    T = sum(lengths)
    old = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    mu = old + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    start = sum(lengths[:3])
    mu[start:start + 5] = old[start:start + 5] + 1.5       # pi_old / mu = e^-1.5 per token
    logp = old + 0.05 * torch.randn(T, generator=g, dtype=torch.float64)
    mask = torch.ones(T, dtype=torch.bool)
    mask[:2] = False
    advantages = torch.tensor([0.7, -1.2, 0.4, 1.1, -0.3], dtype=torch.float64)
    return logp, old, mu, mask, lengths, advantages


def reference_loss(logp, old, mu, mask, lengths, advantages, algorithm, config: CorrectionConfig, eps):
    """-sum_i (1/|y_i|) sum_t m_t w_t min(rho_t A_i, clip(rho_t) A_i) in float64 (docs/gspo.md)."""
    low, high = config.reject_band
    total, start = 0.0, 0
    for i, n in enumerate(lengths):
        ts = range(start, start + n)
        start += n
        m = {t: bool(mask[t]) for t in ts}
        r = {t: math.exp(float(old[t] - mu[t])) for t in ts}
        kept = [t for t in ts if m[t]]
        if config.reject == "token":
            kept = [t for t in kept if low <= r[t] <= high]
        elif config.reject in ("sequence", "geometric") and kept:
            log_p = sum(math.log(r[t]) for t in kept)
            value = math.exp(log_p if config.reject == "sequence" else log_p / len(kept))
            if not low <= value <= high:
                kept = []
        if not kept:
            continue
        log_p = sum(math.log(r[t]) for t in kept)
        weight = {"off": lambda t: 1.0, "token": lambda t: min(config.weight_cap, r[t]),
                  "sequence": lambda t: min(config.weight_cap, math.exp(log_p)),
                  "geometric": lambda t: min(config.weight_cap, math.exp(log_p / len(kept)))}[config.weight]
        idx = torch.tensor(kept)
        if algorithm == "grpo":
            rho = torch.exp(logp[idx] - old[idx])
        else:
            s = torch.exp((logp[idx] - old[idx]).mean()).detach()
            rho = s * torch.exp(logp[idx] - logp[idx].detach())
        a = advantages[i]
        terms = torch.minimum(rho * a, rho.clamp(1 - eps[0], 1 + eps[1]) * a)
        w = torch.tensor([weight(t) for t in kept], dtype=torch.float64)
        total = total + (w * terms).sum() / len(kept)
    return -total


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
@pytest.mark.parametrize("weight, reject", list(itertools.product(MODES, MODES)))
def test_every_mode_matches_the_float64_reference(algorithm, weight, reject):
    logp, old, mu, mask, lengths, advantages = batch()
    config = CorrectionConfig(weight=weight, weight_cap=1.2, reject=reject, reject_band=(0.5, 2.0))
    eps = (0.1, 0.12) if algorithm == "grpo" else (0.02, 0.03)   # wide enough that some terms clip, not all
    seq_T = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    weights, kept = apply_correction(old, mu, mask, seq_T, len(lengths), config)

    want_leaf = logp.clone().requires_grad_(True)
    want = reference_loss(want_leaf, old, mu, mask, lengths, advantages, algorithm, config, eps)
    want.backward()

    got_leaf = logp.float().clone().requires_grad_(True)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    adv = advantages.float() if algorithm == "gspo" else advantages.float()[seq_T]
    loss_sum, n, _ = policy_loss(got_leaf, old.float(), adv, kept.float(), cu, algorithm=algorithm, eps_low=eps[0],
                                 eps_high=eps[1], weights=None if weight == "off" else weights)
    loss_sum.backward()
    assert n == len(lengths)
    assert loss_sum.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(got_leaf.grad.double(), want_leaf.grad, rtol=1e-4, atol=1e-6)


def test_the_modes_really_weight_and_reject():
    """The batch is built so that each mode changes something (the reference test above is not vacuous)."""
    logp, old, mu, mask, lengths, _ = batch()
    seq_T = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for mode in ("token", "sequence", "geometric"):
        weights, kept = apply_correction(old, mu, mask, seq_T, len(lengths), CorrectionConfig(weight=mode, weight_cap=1.2))
        assert torch.equal(kept, mask) and (weights[mask] != 1).any() and (weights[mask] <= 1.2).all()
        assert (weights[mask] == 1.2).any(), "nothing was truncated"
        _, kept = apply_correction(old, mu, mask, seq_T, len(lengths), CorrectionConfig(reject=mode))
        assert not kept[10:15].any(), "sequence 3 (ratio e^-1.5 per token) was not rejected"
        assert kept[2:6].all() or mode == "token"
    assert torch.equal(apply_correction(old, mu, mask, seq_T, 5, CorrectionConfig())[1], mask)


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_weights_of_one_are_bitwise_no_correction(algorithm):
    """mu == pi_old (the in-process sampler): every weight is exactly 1 and the loss and its gradient are the
    uncorrected ones bit for bit."""
    logp, old, _, mask, lengths, advantages = batch()
    seq_T = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    config = CorrectionConfig(weight="token", reject="geometric")
    weights, kept = apply_correction(old.float(), old.float(), mask, seq_T, len(lengths), config)
    assert (weights == 1).all() and torch.equal(kept, mask)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    adv = advantages.float() if algorithm == "gspo" else advantages.float()[seq_T]
    results = []
    for w in (None, weights):
        leaf = logp.float().clone().requires_grad_(True)
        loss_sum, _, _ = policy_loss(leaf, old.float(), adv, mask.float(), cu, algorithm=algorithm, weights=w)
        loss_sum.backward()
        results.append((loss_sum.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    sums = mismatch_sums(old, old, mask, seq_T, len(lengths), config)
    metrics = mismatch_metrics(sums)
    assert metrics["correction/kl_k3"] == 0 and metrics["correction/rejected_fraction"] == 0
    assert metrics["correction/weight_mean"] == metrics["correction/weight_max"] == 1 and metrics["correction/ess"] == 1


def test_mismatch_metrics_by_hand():
    # one sequence of 2 tokens with log r = (log 2, -log 2): k3 = (2 - 1 - log 2 + 0.5 - 1 + log 2) / 2 = 0.25
    old = torch.tensor([0.0, 0.0], dtype=torch.float64)
    mu = torch.tensor([-math.log(2), math.log(2)], dtype=torch.float64)
    mask, seq_T = torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long)
    config = CorrectionConfig(weight="token", weight_cap=1.5, reject="token", reject_band=(0.6, 1.9))
    metrics = mismatch_metrics(mismatch_sums(old, mu, mask, seq_T, 1, config))
    assert metrics["correction/kl_k3"] == pytest.approx(0.25)
    assert metrics["correction/log_ratio_abs_mean"] == pytest.approx(math.log(2))
    assert metrics["correction/rejected_fraction"] == 1.0          # 2 > 1.9 and 0.5 < 0.6: both tokens out
    assert metrics["correction/ess"] == 1.0                        # one sequence: its weight prod r = 1
    # reject off: weights over both tokens, min(1.5, 2) = 1.5 (truncated) and 0.5
    metrics = mismatch_metrics(mismatch_sums(old, mu, mask, seq_T, 1, CorrectionConfig(weight="token", weight_cap=1.5)))
    assert (metrics["correction/weight_mean"], metrics["correction/weight_max"]) == (1.0, 1.5)
    assert metrics["correction/truncated_fraction"] == 0.5
    # ESS of two sequences with weights 1 and 3: (1 + 3)^2 / (2 (1 + 9)) = 0.8
    old2 = torch.zeros(2, dtype=torch.float64)
    mu2 = torch.tensor([0.0, -math.log(3)], dtype=torch.float64)
    metrics = mismatch_metrics(mismatch_sums(old2, mu2, mask, torch.tensor([0, 1]), 2, CorrectionConfig()))
    assert metrics["correction/ess"] == pytest.approx(0.8)


def test_clip_range_untouched():
    assert clip_range("gspo") == (3e-4, 4e-4)
