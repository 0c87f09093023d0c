"""policy_loss against docs/gspo.md: loss_sum / num_sequences == -J of GSPO eq. 5, GSPO-token eq. 13, GRPO eq. 2.

The reference below is written from docs/gspo.md alone, one sequence and one token at a time in float64, so
that it shares no code (and no vectorisation trick) with the implementation under test.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.loss.policy import policy_loss, reduce_metrics, summarize_metrics

ALGORITHMS = ["gspo", "gspo_token", "grpo"]
PAPER_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}


# ---------------------------------------------------------------------------------------------------
# Naive float64 reference (docs/gspo.md, section by section)
# ---------------------------------------------------------------------------------------------------

def _clip(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """clip(x, lo, hi) spelled out: outside the band the result is a constant (no gradient)."""
    if x < lo:
        return torch.tensor(lo, dtype=x.dtype)
    if x > hi:
        return torch.tensor(hi, dtype=x.dtype)
    return x


def reference_objective(logp, old, adv, mask, cu, algorithm, eps_low, eps_high) -> torch.Tensor:
    """J = (1/N) sum_i term_i, python loops over sequences and tokens. adv: [S] or [T]."""
    num_seqs = len(cu) - 1
    per_token_adv = adv.numel() != num_seqs
    lo, hi = 1 - eps_low, 1 + eps_high
    total = torch.zeros((), dtype=torch.float64)
    for i in range(num_seqs):
        tokens = [t for t in range(cu[i], cu[i + 1]) if mask[t]]
        if not tokens:  # |y_i| = 0: no term, but still one of the N sequences
            continue
        adv_t = {t: adv[t] if per_token_adv else adv[i] for t in tokens}
        # log s_i = (1/|y_i|) sum_t (logp_t - old_logp_t)
        log_s = sum(logp[t] - old[t] for t in tokens) / len(tokens)
        if algorithm == "gspo":
            s = torch.exp(log_s)
            a = adv_t[tokens[0]]
            total = total + min(s * a, _clip(s, lo, hi) * a)
        elif algorithm == "gspo_token":
            # s_it = sg[s_i] * exp(logp_t - sg[logp_t])
            term = 0.0
            for t in tokens:
                s_t = torch.exp(log_s).detach() * torch.exp(logp[t] - logp[t].detach())
                term = term + min(s_t * adv_t[t], _clip(s_t, lo, hi) * adv_t[t])
            total = total + term / len(tokens)
        elif algorithm == "grpo":
            term = 0.0
            for t in tokens:
                w = torch.exp(logp[t] - old[t])
                term = term + min(w * adv_t[t], _clip(w, lo, hi) * adv_t[t])
            total = total + term / len(tokens)
    return total / num_seqs


# ---------------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------------

def make_batch(prompt_lens, response_lens, mean_log_ratios, *, seed=0, noise=0.3):
    """A packed batch, float32: each sequence is its prompt (mask 0) then its response (mask 1).

    The response tokens' log-ratios logp - old_logp are mean_log_ratios[i] plus zero-mean noise, so
    the sequence ratio s_i = exp(mean_log_ratios[i]) is chosen by the caller, however noisy the tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    logp, old, mask, cu = [], [], [], [0]
    for p, r, m in zip(prompt_lens, response_lens, mean_log_ratios):
        seq_logp = -3 * torch.rand(p + r, generator=gen, dtype=torch.float64)
        log_ratio = noise * torch.randn(p + r, generator=gen, dtype=torch.float64)
        if r:
            log_ratio[p:] += m - log_ratio[p:].mean()
        logp.append(seq_logp)
        old.append(seq_logp - log_ratio)
        mask.append(torch.cat([torch.zeros(p), torch.ones(r)]))
        cu.append(cu[-1] + p + r)
    return (torch.cat(logp).float(), torch.cat(old).float(), torch.cat(mask), cu)


def run_loss(logp, old, adv, mask, cu, **kw):
    """(loss = loss_sum / num_sequences, d loss / d logprobs, loss_sum, num_sequences, metrics)."""
    logp = logp.detach().clone().requires_grad_(True)
    loss_sum, n, metrics = policy_loss(logp, old, adv, mask, cu, **kw)
    loss = loss_sum / n
    loss.backward()
    return loss.detach(), logp.grad, loss_sum.detach(), n, metrics


def reference_loss_and_grad(logp, old, adv, mask, cu, algorithm, eps_low, eps_high):
    logp64 = logp.detach().double().requires_grad_(True)
    loss = -reference_objective(logp64, old.double(), adv.double(), mask.bool().tolist(), cu,
                                algorithm, eps_low, eps_high)
    loss.backward()
    return loss.detach(), logp64.grad


def seq_slices(cu):
    return [slice(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


# A batch for the clip band of GSPO (3e-4 / 4e-4): each row is
# (prompt tokens, response tokens, mean log-ratio = log s_i, advantage, clipped?)
# log(1 + 4e-4) = 4.0e-4 and log(1 - 3e-4) = -3.0e-4 bound the band in log space.
GSPO_ROWS = [
    (3, 5, 0.0, 1.3, False),      # s = 1
    (0, 1, 2e-4, -0.7, False),    # inside the band
    (4, 17, 1e-3, 0.9, True),     # s > 1 + eps_high, A > 0: too far up -> clipped
    (2, 9, 1e-3, -1.1, False),    # s > 1 + eps_high, A < 0: moving it down is allowed
    (6, 12, -1e-3, -0.4, True),   # s < 1 - eps_low, A < 0: too far down -> clipped
    (1, 3, -1e-3, 0.8, False),    # s < 1 - eps_low, A > 0: moving it up is allowed
    (10, 40, 0.5, 1.5, True),     # far above
    (0, 7, -0.5, -2.0, True),     # far below
    (5, 20, -2e-4, 0.3, False),   # inside the band
    (4, 0, 0.0, 1.0, False),      # prompt only: empty response, no term, still counted in N
]


def gspo_batch(seed=0):
    prompt, response, mean_lr, adv, clipped = zip(*GSPO_ROWS)
    logp, old, mask, cu = make_batch(prompt, response, mean_lr, seed=seed)
    return logp, old, torch.tensor(adv), mask, cu, list(clipped)


# ---------------------------------------------------------------------------------------------------
# Value and gradient vs the reference
# ---------------------------------------------------------------------------------------------------

# gspo takes one advantage per sequence only (per-token ones are rejected: tested below).
@pytest.mark.parametrize("algorithm, per_token_adv", [("gspo", False), ("gspo_token", False),
                                                      ("gspo_token", True)])
def test_gspo_family_matches_reference(algorithm, per_token_adv):
    logp, old, adv, mask, cu, clipped = gspo_batch()
    if per_token_adv:  # mixed signs inside a sequence: clip decisions become per token
        adv = torch.randn(logp.shape[0], generator=torch.Generator().manual_seed(1))
    eps_low, eps_high = 3e-4, 4e-4
    loss, grad, _, n, metrics = run_loss(logp, old, adv, mask, cu, algorithm=algorithm,
                                         eps_low=eps_low, eps_high=eps_high)
    ref_loss, ref_grad = reference_loss_and_grad(logp, old, adv, mask, cu, algorithm, eps_low, eps_high)
    assert n == len(GSPO_ROWS)  # the empty response is counted in N
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-7)
    if not per_token_adv:
        # The table's clip column, by hand: rows 2, 4, 6, 7.
        assert metrics["sequences_clipped"].item() == sum(clipped) == 4
        for sl, c in zip(seq_slices(cu), clipped):
            assert (grad[sl] == 0).all() == c or mask[sl].sum() == 0


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_grpo_matches_reference(per_token_adv):
    # Token log-ratios with noise 0.3 around each mean: many tokens fall outside 0.8 / 1.27 each way.
    logp, old, adv, mask, cu, _ = gspo_batch(seed=3)
    if per_token_adv:
        adv = torch.randn(logp.shape[0], generator=torch.Generator().manual_seed(2))
    loss, grad, _, n, metrics = run_loss(logp, old, adv, mask, cu, algorithm="grpo",
                                         eps_low=0.2, eps_high=0.27)
    ref_loss, ref_grad = reference_loss_and_grad(logp, old, adv, mask, cu, "grpo", 0.2, 0.27)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-7)
    # Clipping is really exercised: some response tokens have zero gradient, most do not.
    clipped = metrics["tokens_clipped"].item()
    assert 10 <= clipped <= metrics["tokens"].item() - 10
    assert ((grad == 0) & mask.bool()).sum().item() == clipped


# ---------------------------------------------------------------------------------------------------
# GSPO-token == GSPO for sequence-constant advantages
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("adv_layout", ["per_sequence", "per_token"])
def test_gspo_token_equals_gspo_for_constant_advantages(seed, adv_layout):
    logp, old, adv_S, mask, cu, _ = gspo_batch(seed=seed)
    seq_T = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    adv = adv_S if adv_layout == "per_sequence" else adv_S[seq_T]
    loss_a, grad_a, _, _, m_a = run_loss(logp, old, adv_S, mask, cu, algorithm="gspo")
    loss_b, grad_b, _, _, m_b = run_loss(logp, old, adv, mask, cu, algorithm="gspo_token")
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grad_b, grad_a, rtol=1e-5, atol=1e-9)
    assert m_a["sequences_clipped"].item() == m_b["sequences_clipped"].item() == 4
    assert m_a["tokens_clipped"].item() == m_b["tokens_clipped"].item() == 17 + 12 + 40 + 7


# ---------------------------------------------------------------------------------------------------
# Length invariance: one term per sequence
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token"])
def test_gspo_weighs_a_1_token_and_a_1000_token_sequence_equally(algorithm):
    # GSPO gradient (clip inactive): d J / d logp_t = (1/N) s_i A_i (1/|y_i|) for each response token
    # (docs/gspo.md), so summed over sequence i's tokens it is s_i A_i / N whatever |y_i| is. Here
    # s = exp(1e-4) (inside the band), A = 0.7 for both, N = 2, and the loss is -J:
    #   sum_t d loss / d logp_t = -exp(1e-4) * 0.7 / 2 = -0.350035 for each sequence.
    # The long sequence's token log-ratios are noisy (+-0.3); only their mean, 1e-4, matters.
    logp, old, mask, cu = make_batch([0, 0], [1, 1000], [1e-4, 1e-4], seed=4)
    _, grad, _, _, metrics = run_loss(logp, old, torch.tensor([0.7, 0.7]), mask, cu, algorithm=algorithm)
    assert metrics["sequences_clipped"].item() == 0
    expected = -math.exp(1e-4) * 0.7 / 2
    short, long = grad[0:1].sum().item(), grad[1:1001].sum().item()
    assert short == pytest.approx(expected, rel=1e-5)
    assert long == pytest.approx(expected, rel=1e-5)
    # ... and every token of the long sequence gets the same 1/1000 share.
    torch.testing.assert_close(grad[1:1001], torch.full((1000,), expected / 1000), rtol=1e-5, atol=0)


def test_grpo_token_mean_also_weighs_sequences_equally():
    # GRPO with every token ratio w = exp(1e-4) (inside 0.8 / 1.27): d loss / d logp_t = -w A / (|y_i| N),
    # summed over the sequence: -w A / N = -exp(1e-4) * 0.7 / 2 for the 1-token and the 1000-token one.
    # (A token-sum over the batch would give the long one 1000x the weight: see the break-it notes.)
    logp, old, mask, cu = make_batch([0, 0], [1, 1000], [1e-4, 1e-4], seed=4, noise=0.0)
    _, grad, _, _, _ = run_loss(logp, old, torch.tensor([0.7, 0.7]), mask, cu, algorithm="grpo")
    expected = -math.exp(1e-4) * 0.7 / 2
    assert grad[0:1].sum().item() == pytest.approx(expected, rel=1e-4)
    assert grad[1:1001].sum().item() == pytest.approx(expected, rel=1e-4)


# ---------------------------------------------------------------------------------------------------
# Mini-batch 1: on-policy
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_on_policy_ratio_is_exactly_one(algorithm):
    # Four sequences, prompts of 2, 0, 3, 1 tokens, responses of 4, 2, 1, 8 tokens, N = 4.
    # old = logp.detach(): every log-ratio is 0, s_i = w_t = 1 exactly, so nothing is clipped and
    #   J = (1/N) sum_i A_i = (0.5 - 1.5 + 2 - 0.25) / 4 = 0.1875  -> loss = -0.1875
    #   d loss / d logp_t = -A_i / |y_i| / N:
    #     seq 0: -0.5 / 4 / 4 = -0.03125     seq 1: +1.5 / 2 / 4 = +0.1875
    #     seq 2: -2.0 / 1 / 4 = -0.5         seq 3: +0.25 / 8 / 4 = +0.0078125
    #   and 0 on prompt tokens.
    logp, _, mask, cu = make_batch([2, 0, 3, 1], [4, 2, 1, 8], [0.0] * 4, seed=5)
    adv = torch.tensor([0.5, -1.5, 2.0, -0.25])
    loss, grad, _, n, metrics = run_loss(logp, logp.detach(), adv, mask, cu, algorithm=algorithm)
    assert n == 4
    assert loss.item() == pytest.approx(-0.1875, abs=1e-7)
    expected = torch.tensor([0, 0] + [-0.03125] * 4
                            + [0.1875] * 2
                            + [0, 0, 0] + [-0.5]
                            + [0] + [0.0078125] * 8)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=0)
    assert metrics["ratio_min"].item() == metrics["ratio_max"].item() == 1.0
    assert metrics["sequences_clipped"].item() == 0
    assert metrics["tokens_clipped"].item() == 0


# ---------------------------------------------------------------------------------------------------
# Clip semantics
# ---------------------------------------------------------------------------------------------------

def test_gspo_clip_band_edges():
    # eps_low = 3e-4, eps_high = 4e-4; each sequence's s is 2e-5 inside or outside an edge (the
    # float32 error of a mean log-ratio here is ~1e-7). Rows: (s, A, clipped?)
    # docs/gspo.md: clipping zeroes a sequence's gradient only on the side A's sign makes "too far".
    d = 2e-5
    rows = [
        (1 + 4e-4 - d, +1.0, False),  # A > 0, just inside the top edge
        (1 + 4e-4 + d, +1.0, True),   # A > 0, just above: clipped
        (1 - 3e-4 + d, +1.0, False),  # A > 0, just inside the bottom edge
        (1 - 3e-4 - d, +1.0, False),  # A > 0, below the band: not clipped (pushing s up is allowed)
        (1 - 3e-4 + d, -1.0, False),  # A < 0, just inside the bottom edge
        (1 - 3e-4 - d, -1.0, True),   # A < 0, just below: clipped
        (1 + 4e-4 - d, -1.0, False),  # A < 0, just inside the top edge
        (1 + 4e-4 + d, -1.0, False),  # A < 0, above the band: not clipped (pushing s down is allowed)
    ]
    ratios, adv, clipped = zip(*rows)
    logp, old, mask, cu = make_batch([1] * 8, [3] * 8, [math.log(s) for s in ratios], seed=6)
    _, grad, _, n, metrics = run_loss(logp, old, torch.tensor(adv), mask, cu, algorithm="gspo",
                                      eps_low=3e-4, eps_high=4e-4)
    for sl, s, a, c in zip(seq_slices(cu), ratios, adv, clipped):
        response = grad[sl][1:]
        if c:
            assert torch.equal(response, torch.zeros(3)), (s, a)
        else:  # unclipped: d loss / d logp_t = -s A / |y| / N
            torch.testing.assert_close(response, torch.full((3,), -s * a / 3 / n), rtol=1e-5, atol=0)
    assert metrics["sequences_clipped"].item() == 2
    assert metrics["tokens_clipped"].item() == 6


def _clipped_by_seq(algorithm, token_log_ratios, adv, **eps):
    """One single-token sequence per entry; which got a zero gradient (= clipped)."""
    n = len(token_log_ratios)
    logp = torch.full((n,), -1.0)
    old = (logp.double() - torch.tensor(token_log_ratios, dtype=torch.float64)).float()
    _, grad, _, _, _ = run_loss(logp, old, torch.tensor(adv), torch.ones(n), list(range(n + 1)),
                                algorithm=algorithm, **eps)
    return (grad == 0).tolist()


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token"])
def test_gspo_default_clip_is_3e4_low_4e4_high(algorithm):
    log = math.log
    # Under the defaults (3e-4, 4e-4): s = 1.00035 with A > 0 is inside, 1.00045 is clipped;
    # s = 1 - 2.5e-4 with A < 0 is inside, 1 - 3.5e-4 is clipped.
    ratios = [log(1.00035), log(1.00045), log(1 - 2.5e-4), log(1 - 3.5e-4)]
    adv = [1.0, 1.0, -1.0, -1.0]
    assert _clipped_by_seq(algorithm, ratios, adv) == [False, True, False, True]
    # With eps_high = 3e-4 given explicitly, 1.00035 is clipped too: the default is not 3e-4 / 3e-4.
    assert _clipped_by_seq(algorithm, ratios, adv, eps_high=3e-4) == [True, True, False, True]


def test_grpo_default_clip_is_02_low_027_high():
    log = math.log
    # GRPO defaults (0.2, 0.27): token ratio 1.25 with A > 0 is inside (< 1.27), 1.3 is clipped;
    # 0.85 with A < 0 is inside (> 0.8), 0.75 is clipped.
    ratios = [log(1.25), log(1.3), log(0.85), log(0.75)]
    adv = [1.0, 1.0, -1.0, -1.0]
    assert _clipped_by_seq("grpo", ratios, adv) == [False, True, False, True]
    # A symmetric 0.2 / 0.2 band would clip 1.25.
    assert _clipped_by_seq("grpo", ratios, adv, eps_high=0.2) == [True, True, False, True]


# ---------------------------------------------------------------------------------------------------
# Masking and non-finite values
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_masked_positions_may_hold_anything(algorithm):
    logp, old, adv, mask, cu, _ = gspo_batch(seed=7)
    masked = ~mask.bool()
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 3e38])
    k = int(masked.sum())
    dirty_logp, dirty_old = logp.clone(), old.clone()
    dirty_logp[masked] = junk.repeat(k)[:k]
    dirty_old[masked] = junk.flip(0).repeat(k)[:k]
    clean = run_loss(logp, old, adv, mask, cu, algorithm=algorithm)
    dirty = run_loss(dirty_logp, dirty_old, adv, mask, cu, algorithm=algorithm)
    # Masked values never enter the arithmetic, so the results are identical, bit for bit.
    assert torch.equal(dirty[0], clean[0])
    assert torch.equal(dirty[1], clean[1])
    assert torch.equal(dirty[1][masked], torch.zeros(k))
    assert all(torch.equal(dirty[4][key], clean[4][key]) for key in clean[4])
    assert clean[4]["sequences_nonfinite"].item() == 0


# (name, how to spoil sequence 1 of the batch) for the invalid-sequence test.
def _prompt_only(p):
    p["mask"][:] = 0


def _zero_length(p):
    p["logp"] = p["old"] = p["mask"] = p["logp"][:0]


def _old_neg_inf(p):
    p["old"][-2] = float("-inf")  # a token outside the rollout's top-p support


def _old_nan(p):
    p["old"][-1] = float("nan")


def _logp_nan(p):
    p["logp"][-3] = float("nan")


def _logp_neg_inf(p):
    p["logp"][-1] = float("-inf")


SPOILERS = {"prompt_only": (_prompt_only, "sequences_empty"),
            "zero_length": (_zero_length, "sequences_empty"),
            "old_neg_inf": (_old_neg_inf, "sequences_nonfinite"),
            "old_nan": (_old_nan, "sequences_nonfinite"),
            "logp_nan": (_logp_nan, "sequences_nonfinite"),
            "logp_neg_inf": (_logp_neg_inf, "sequences_nonfinite")}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("spoiler", list(SPOILERS))
def test_invalid_sequence_is_inert_but_counted(algorithm, spoiler):
    # Three good sequences (one clipped, one not, one in band) with a bad one inserted as sequence 1.
    spoil, counter = SPOILERS[spoiler]
    eps = {"eps_low": 0.05, "eps_high": 0.05}
    logp, old, mask, cu = make_batch([2, 3, 1, 2], [6, 5, 9, 4], [0.2, 0.0, -0.01, 0.3], seed=8)
    adv = torch.tensor([1.0, 2.0, -0.5, -1.0])
    parts = [{"logp": logp[sl].clone(), "old": old[sl].clone(), "mask": mask[sl].clone()}
             for sl in seq_slices(cu)]
    spoil(parts[1])
    cat = lambda key, ps: torch.cat([p[key] for p in ps])
    bad_cu = [0]
    for p in parts:
        bad_cu.append(bad_cu[-1] + p["logp"].numel())
    good = [parts[0]] + parts[2:]
    good_cu = [0]
    for p in good:
        good_cu.append(good_cu[-1] + p["logp"].numel())

    bad = run_loss(cat("logp", parts), cat("old", parts), adv, cat("mask", parts), bad_cu,
                   algorithm=algorithm, **eps)
    ref = run_loss(cat("logp", good), cat("old", good), adv[[0, 2, 3]], cat("mask", good), good_cu,
                   algorithm=algorithm, **eps)
    loss, grad, loss_sum, n, metrics = bad
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # The bad sequence adds nothing to loss_sum but is one of the N sequences.
    assert n == ref[3] + 1 == 4
    torch.testing.assert_close(loss_sum, ref[2], rtol=1e-6, atol=1e-7)
    # Its gradient is exactly zero; the others' gradients of loss_sum are those of the batch without
    # it (loss = loss_sum / N, so d loss / d logp differs by exactly the factor 3/4).
    bad_sl = slice(bad_cu[1], bad_cu[2])
    assert torch.equal(grad[bad_sl], torch.zeros(bad_sl.stop - bad_sl.start))
    keep = torch.ones(grad.numel(), dtype=torch.bool)
    keep[bad_sl] = False
    torch.testing.assert_close(grad[keep] * 4, ref[1] * 3, rtol=1e-6, atol=1e-9)
    assert (ref[1] != 0).sum() > 10  # the comparison above is not between two zero vectors
    assert metrics[counter].item() == 1
    assert metrics["sequences_valid"].item() == 3
    other = "sequences_nonfinite" if counter == "sequences_empty" else "sequences_empty"
    assert metrics[other].item() == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_huge_log_ratio_is_clamped_before_exp(algorithm, sign):
    # One single-token sequence with logp - old = +1000: exp(1000) overflows float32 to inf.
    # A < 0 wants s down, so it is unclipped and the term is s*A: without the clamp -inf*|A|, an
    # infinite loss; A > 0 is clipped, and without the clamp its zero gradient becomes 0 * inf = NaN.
    # With max_log_ratio = 20: s = e^20, and for A = -1: J = e^20 * -1 / N (N = 1) -> loss = e^20.
    logp, old = torch.tensor([-1.0]), torch.tensor([-1001.0])
    loss, grad, _, _, _ = run_loss(logp, old, torch.tensor([sign]), torch.ones(1), [0, 1], algorithm=algorithm)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    if sign < 0:
        assert loss.item() == pytest.approx(math.exp(20), rel=1e-5)
        loss5, _, _, _, _ = run_loss(logp, old, torch.tensor([sign]), torch.ones(1), [0, 1],
                                     algorithm=algorithm, max_log_ratio=5.0)
        assert loss5.item() == pytest.approx(math.exp(5), rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu_seqlens", [[1, 5], [0, 3], [0, 4, 2, 5], [0, 2, 5, 6], [], [[0, 5]],
                                        [0.0, 2.5, 5.0]])
def test_bad_cu_seqlens_raise(cu_seqlens):
    x = torch.zeros(5)
    with pytest.raises(ValueError, match="cu_seqlens"):
        policy_loss(x, x, torch.zeros(1), torch.ones(5), cu_seqlens)


def test_unknown_algorithm_raises():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="algorithm must be one of .*'gspo'.*got 'ppo'"):
        policy_loss(x, x, torch.zeros(1), torch.ones(3), [0, 3], algorithm="ppo")


def test_gspo_rejects_per_token_advantages_and_points_to_gspo_token():
    x = torch.zeros(5)
    with pytest.raises(ValueError, match="use gspo_token"):
        policy_loss(x, x, torch.zeros(5), torch.ones(5), [0, 2, 5], algorithm="gspo")
    # The same advantages are fine for gspo_token.
    policy_loss(x, x, torch.zeros(5), torch.ones(5), [0, 2, 5], algorithm="gspo_token")


@pytest.mark.parametrize("algorithm", ["gspo_token", "grpo"])
def test_advantages_of_wrong_length_raise(algorithm):
    x = torch.zeros(5)
    with pytest.raises(ValueError, match=r"expected \[2\] .* or \[5\]"):
        policy_loss(x, x, torch.zeros(3), torch.ones(5), [0, 2, 5], algorithm=algorithm)


def test_mismatched_shapes_and_bad_clip_range_raise():
    x = torch.zeros(5)
    with pytest.raises(ValueError, match="must be equal 1-D shapes"):
        policy_loss(x, torch.zeros(4), torch.zeros(1), torch.ones(5), [0, 5])
    with pytest.raises(ValueError, match="clip range"):
        policy_loss(x, x, torch.zeros(1), torch.ones(5), [0, 5], eps_low=1.0)


# ---------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------

def metrics_batch():
    """The hand example for the metric tests (eps 0.1 / 0.1, every A = +1):

    seq 0: 1 prompt token (junk), 2 response tokens with log-ratios +0.1, -0.1 -> log s = 0,    s = 1
    seq 1: 3 response tokens, each +0.5                                        -> s = e^0.5 = 1.6487
    seq 2: 1 response token, -0.5                                              -> s = e^-0.5 = 0.6065
    seq 3: 2 prompt tokens only                                                -> empty
    """
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -2.0, -2.0])
    lr = torch.tensor([0.0, 0.1, -0.1, 0.5, 0.5, 0.5, -0.5, 0.0, 0.0])
    mask = torch.tensor([0, 1, 1, 1, 1, 1, 1, 0, 0])
    logp = old + lr
    logp[0] = float("nan")
    return logp, old, torch.ones(4), mask, [0, 3, 6, 7, 9]


def test_summarize_metrics_gspo_hand_example():
    # GSPO, A > 0: only seq 1 (s = 1.6487 > 1.1) is clipped; seq 2 (s < 0.9) is not, A > 0.
    #   clipped_fraction_seq   = 1 clipped / 3 valid (the empty one is not in the denominator)
    #   clipped_fraction_token = 3 / 6 response tokens
    #   ratio_mean = (1 + e^0.5 + e^-0.5) / 3 = 1.0850841, min e^-0.5, max e^0.5
    #   abs_log_ratio_per_token = (0.1 + 0.1 + 3 * 0.5 + 0.5) / 6 = 2.2 / 6
    #   abs_log_ratio_per_seq   = (0 + 0.5 + 0.5) / 3
    logp, old, adv, mask, cu = metrics_batch()
    _, n, raw = policy_loss(logp, old, adv, mask, cu, eps_low=0.1, eps_high=0.1)
    s = summarize_metrics(raw)
    assert n == 4
    assert s["loss/clipped_fraction_seq"] == pytest.approx(1 / 3)
    assert s["loss/clipped_fraction_token"] == pytest.approx(3 / 6)
    assert s["loss/ratio_mean"] == pytest.approx((1 + math.exp(0.5) + math.exp(-0.5)) / 3, rel=1e-6)
    assert s["loss/ratio_mean"] == pytest.approx(1.0850841, rel=1e-6)
    assert s["loss/ratio_min"] == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert s["loss/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-6)
    assert s["loss/abs_log_ratio_per_token"] == pytest.approx(2.2 / 6, rel=1e-6)
    assert s["loss/abs_log_ratio_per_seq"] == pytest.approx(1 / 3, rel=1e-6)
    assert s["loss/sequences_empty"] == 1 and s["loss/sequences_nonfinite"] == 0
    assert s["train/response_tokens"] == 6


def test_summarize_metrics_grpo_counts_clipped_tokens():
    # GRPO clips per token: seq 0's +0.1 token (w = 1.105 > 1.1, A > 0) and seq 1's three tokens.
    # tokens: 4 / 6 clipped; sequences with a clipped token: seq 0 and seq 1 -> 2 / 3.
    logp, old, adv, mask, cu = metrics_batch()
    _, _, raw = policy_loss(logp, old, adv, mask, cu, algorithm="grpo", eps_low=0.1, eps_high=0.1)
    s = summarize_metrics(raw)
    assert s["loss/clipped_fraction_token"] == pytest.approx(4 / 6)
    assert s["loss/clipped_fraction_seq"] == pytest.approx(2 / 3)


def test_reduce_metrics_over_micro_batches_equals_one_batch():
    # Micro-batch A = seqs 0, 1 of the hand example (ratios 1, e^0.5); micro-batch B = seqs 2, 3
    # (e^-0.5, empty); micro-batch C = the empty seq alone, whose ratio_min / max are +inf / -inf.
    # Reduced: counts add up (sequences 2 + 2 + 1 = 5, tokens 5 + 1 + 0 = 6, clipped 1 + 0 + 0),
    # ratio_min = e^-0.5 comes from B, ratio_max = e^0.5 from A, and C's infinities change neither.
    logp, old, adv, mask, cu = metrics_batch()
    kw = {"eps_low": 0.1, "eps_high": 0.1}
    mb_a = policy_loss(logp[:6], old[:6], adv[:2], mask[:6], [0, 3, 6], **kw)[2]
    mb_b = policy_loss(logp[6:], old[6:], adv[2:], mask[6:], [0, 1, 3], **kw)[2]
    mb_c = policy_loss(logp[7:], old[7:], adv[3:], mask[7:], [0, 2], **kw)[2]
    assert mb_c["ratio_min"].item() == math.inf and mb_c["ratio_max"].item() == -math.inf
    reduced = reduce_metrics([mb_a, mb_b, mb_c])
    assert reduced["sequences"].item() == 5
    assert reduced["sequences_valid"].item() == 3
    assert reduced["sequences_empty"].item() == 2
    assert reduced["tokens"].item() == 6
    assert reduced["sequences_clipped"].item() == 1 and reduced["tokens_clipped"].item() == 3
    assert reduced["ratio_min"].item() == pytest.approx(math.exp(-0.5), rel=1e-6)
    assert reduced["ratio_max"].item() == pytest.approx(math.exp(0.5), rel=1e-6)
    # Summaries of the reduced micro-batches equal those of the whole batch at once (A + B).
    whole = policy_loss(logp, old, adv, mask, cu, **kw)[2]
    ab = summarize_metrics(reduce_metrics([mb_a, mb_b]))
    assert ab == pytest.approx(summarize_metrics(whole), rel=1e-6)


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_sequence_ids_in_any_order_equal_cu_seqlens(algorithm):
    """Packed rows under CP hold each sequence in two separate chunks: sequence_ids (any token order)
    give the loss, gradient and metrics of the same tokens delimited by cu_seqlens."""
    logp, old, adv, mask, cu, _ = gspo_batch()
    ref_loss, ref_grad, _, ref_n, ref_metrics = run_loss(logp, old, adv, mask, cu, algorithm=algorithm)
    seq_T = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    perm = torch.randperm(logp.shape[0], generator=torch.Generator().manual_seed(3))
    x = logp[perm].clone().requires_grad_(True)
    loss_sum, n, metrics = policy_loss(x, old[perm], adv, mask[perm], None, sequence_ids=seq_T[perm],
                                       num_sequences=len(cu) - 1, algorithm=algorithm)
    loss = loss_sum / n
    loss.backward()
    assert n == ref_n
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x.grad[torch.argsort(perm)], ref_grad, rtol=1e-6, atol=1e-8)
    for key in ref_metrics:
        # sums of float32 terms in another order: 1e-6 absolute
        torch.testing.assert_close(metrics[key].double(), ref_metrics[key].double(), rtol=1e-6, atol=1e-6)


def test_sequence_ids_are_validated():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="exactly one of cu_seqlens and sequence_ids"):
        policy_loss(x, x, torch.zeros(2), torch.ones(4), [0, 2, 4], sequence_ids=torch.tensor([0, 0, 1, 1]),
                    num_sequences=2)
    with pytest.raises(ValueError, match=r"sequence_ids must lie in \[0, num_sequences=2\)"):
        policy_loss(x, x, torch.zeros(2), torch.ones(4), None, sequence_ids=torch.tensor([0, 0, 2, 1]),
                    num_sequences=2)
    with pytest.raises(ValueError, match=r"sequence_ids must be \[4\] integers"):
        policy_loss(x, x, torch.zeros(2), torch.ones(4), None, sequence_ids=torch.tensor([0.0, 0, 1, 1]),
                    num_sequences=2)


def test_ratio_spreads_by_response_length_bucket():
    """loss/log_ratio_{token,seq}_std/len_A-B: the spreads of log w_t and log s_i over the responses whose
    length lies in the bucket (here: 2 responses of 2 tokens, 1 of 20)."""
    log_w = [[0.1, -0.1], [0.3, 0.1], [0.01 * t for t in range(20)]]
    logp = torch.tensor([x for seq in log_w for x in seq])
    old = torch.zeros_like(logp)
    cu = torch.tensor([0, 2, 4, 24])
    _, _, raw = policy_loss(logp, old, torch.tensor([1.0, -1.0, 0.5]), torch.ones_like(logp), cu)
    s = summarize_metrics(reduce_metrics([raw]))
    short = torch.tensor([0.1, -0.1, 0.3, 0.1], dtype=torch.float64)
    assert s["loss/sequences/len_1-15"] == 2 and s["loss/sequences/len_16-31"] == 1
    assert s["loss/log_ratio_token_std/len_1-15"] == pytest.approx(short.std(unbiased=False).item(), rel=1e-5)
    assert s["loss/log_ratio_seq_std/len_1-15"] == pytest.approx(0.1, rel=1e-5)       # log s = 0.0 and 0.2
    assert s["loss/log_ratio_seq_std/len_16-31"] == 0.0                               # one sequence
    assert s["loss/log_ratio_token_std/len_16-31"] == pytest.approx(
        torch.tensor(log_w[2], dtype=torch.float64).std(unbiased=False).item(), rel=1e-5)
    assert "loss/sequences/len_32-63" not in s                                         # an empty bucket: no entry
    # GRPO's band 0.2/0.27 with A > 0: of the short responses' tokens only exp(0.3) = 1.35 is clipped (1 of 4); the
    # long response's ratios exp(0.01 t) would pass 1.27 at t >= 24 (it has 20 tokens) -> 0 of 20
    _, _, raw = policy_loss(logp, old, torch.tensor([1.0, 1.0, 0.5]), torch.ones_like(logp), cu, algorithm="grpo")
    g = summarize_metrics(reduce_metrics([raw]))
    assert g["loss/clipped_fraction_token/len_1-15"] == pytest.approx(0.25)
    assert g["loss/clipped_fraction_token/len_16-31"] == 0.0
    assert g["loss/clipped_fraction_token"] == pytest.approx(1 / 24)
