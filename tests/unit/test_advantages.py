"""Group advantages A_i = (r_i - mean_group r) / (std_group r + eps) against hand-derived vectors.

Every expected value below is derived in its comment from the rewards alone (sums of squares done by
hand), so a change of convention (sample vs population std, where eps goes, group order) shows up as a
mismatch with arithmetic a reader can check, not with a number nobody can explain.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.loss.advantages import group_advantages

EPS = 1e-6  # the default eps of group_advantages


def assert_advantages(actual: torch.Tensor, expected: list[float]) -> None:
    # The result is float32: compare with float32 resolution (~1e-7 relative).
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# G = 2
# ---------------------------------------------------------------------------------------------------

def test_g2_sample_std():
    # rewards [1, 0]: mean 0.5, deviations +-0.5, sum of squares 0.5.
    # sample std = sqrt(0.5 / (G-1)) = sqrt(0.5) = 0.70710678
    # A = +-0.5 / (0.70710678 + 1e-6) = +-0.70710578  (slightly under 1/sqrt(2) because of eps)
    out = group_advantages(torch.tensor([1.0, 0.0]), 2, std="sample")
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert_advantages(out.advantages_R, [a, -a])
    assert abs(a - 0.70710578) < 1e-8
    assert out.zero_signal_G.tolist() == [False]


def test_g2_population_std():
    # rewards [1, 0]: population std = sqrt(0.5 / G) = 0.5
    # A = +-0.5 / (0.5 + 1e-6) = +-1 / (1 + 2e-6) = +-0.999998000004: visibly below 1 in float32
    # (float32 spacing just below 1 is 6e-8), so a missing eps would fail this test.
    out = group_advantages(torch.tensor([1.0, 0.0]), 2, std="population")
    a = 1.0 / (1.0 + 2e-6)
    assert_advantages(out.advantages_R, [a, -a])
    assert out.advantages_R[0].item() < 1.0


def test_sample_is_the_default_std():
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9])
    torch.testing.assert_close(group_advantages(rewards, 2).advantages_R,
                               group_advantages(rewards, 2, std="sample").advantages_R, rtol=0, atol=0)


def test_eps_is_configurable():
    # rewards [1, 0], population std 0.5, eps 0.5: A = +-0.5 / (0.5 + 0.5) = +-0.5
    out = group_advantages(torch.tensor([1.0, 0.0]), 2, std="population", eps=0.5)
    assert_advantages(out.advantages_R, [0.5, -0.5])


def test_groups_are_consecutive_rewards():
    # Group-major order: [1, 0 | 0, 1] are two groups, not [1, 0] interleaved with [0, 1].
    # Each group is the G=2 population case above: A = +-1/(1+2e-6).
    out = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, std="population")
    a = 1.0 / (1.0 + 2e-6)
    assert_advantages(out.advantages_R, [a, -a, -a, a])


# ---------------------------------------------------------------------------------------------------
# G = 8, 0/1 rewards, and an all-equal group in the same batch
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("std, divisor", [("sample", 7), ("population", 8)])
def test_g8_binary_rewards(std, divisor):
    # Group 0: two successes in 8: mean 0.25, deviations +0.75 (x2) and -0.25 (x6).
    #   sum of squares = 2 * 0.5625 + 6 * 0.0625 = 1.5
    #   sample std     = sqrt(1.5 / 7) = 0.46291005 -> A = +1.62018167 / -0.54006056
    #   population std = sqrt(1.5 / 8) = 0.43301270 -> A = +1.73204681 / -0.57734894
    # Group 1: all eight failed -> exactly zero, flagged. Group 2: all eight succeeded -> same.
    rewards = [1, 1, 0, 0, 0, 0, 0, 0] + [0] * 8 + [1] * 8
    out = group_advantages(torch.tensor(rewards, dtype=torch.float32), 8, std=std)
    sd = math.sqrt(1.5 / divisor)
    hi, lo = 0.75 / (sd + EPS), -0.25 / (sd + EPS)
    assert_advantages(out.advantages_R, [hi, hi] + [lo] * 6 + [0.0] * 16)
    assert out.zero_signal_G.tolist() == [False, True, True]
    assert out.num_zero_signal_groups == 2
    # A non-degenerate group's advantages sum to zero (mean subtracted) ...
    assert abs(out.advantages_R[:8].double().sum().item()) < 1e-6
    # ... and the all-equal groups are exactly zero, not merely tiny.
    assert torch.equal(out.advantages_R[8:], torch.zeros(16))


def test_g8_hand_numbers():
    # Pin the decimals once, so the closed forms used above cannot both be wrong the same way.
    out = group_advantages(torch.tensor([1.0, 1, 0, 0, 0, 0, 0, 0]), 8, std="sample")
    assert out.advantages_R[0].item() == pytest.approx(1.6201817, abs=1e-6)
    assert out.advantages_R[2].item() == pytest.approx(-0.5400606, abs=1e-6)


# ---------------------------------------------------------------------------------------------------
# G = 16
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("std, divisor", [("sample", 15), ("population", 16)])
def test_g16_binary_rewards(std, divisor):
    # Four successes in 16: mean 0.25; sum of squares = 4 * 0.5625 + 12 * 0.0625 = 3.
    #   sample std     = sqrt(3 / 15) = sqrt(0.2) = 0.44721360 -> A(success) = 1.67704723
    #   population std = sqrt(3 / 16)            = 0.43301270 -> A(success) = 1.73204681
    rewards = torch.zeros(16)
    rewards[[0, 5, 10, 15]] = 1.0
    out = group_advantages(rewards, 16, std=std)
    sd = math.sqrt(3 / divisor)
    expected = [0.75 / (sd + EPS) if r == 1 else -0.25 / (sd + EPS) for r in rewards.tolist()]
    assert_advantages(out.advantages_R, expected)
    assert out.zero_signal_G.tolist() == [False]


@pytest.mark.parametrize("std, divisor", [("sample", 15), ("population", 16)])
def test_g16_graded_rewards(std, divisor):
    # Rewards 0, 1, ..., 15: mean 7.5; sum of squares = sum_k (k - 7.5)^2 = G (G^2 - 1) / 12 = 340.
    #   sample std     = sqrt(340 / 15) = 4.76095229 -> A(15) = 7.5 / 4.76095329 = 1.57531476
    #   population std = sqrt(340 / 16) = 4.60977223
    out = group_advantages(torch.arange(16, dtype=torch.float32), 16, std=std)
    sd = math.sqrt(340 / divisor)
    assert_advantages(out.advantages_R, [(k - 7.5) / (sd + EPS) for k in range(16)])
    if std == "sample":
        assert out.advantages_R[15].item() == pytest.approx(1.5753148, abs=1e-6)


# ---------------------------------------------------------------------------------------------------
# std=None (mean only) and all-equal groups
# ---------------------------------------------------------------------------------------------------

def test_std_none_subtracts_the_mean_only():
    # [1, 0, 0, 0]: mean 0.25 -> [0.75, -0.25, -0.25, -0.25]
    # [0.5, 0.7, 0.2, 0.2]: mean 1.6 / 4 = 0.4 -> [0.1, 0.3, -0.2, -0.2]
    # Nothing is divided: with population std the first group would be scaled by 1/0.433.
    out = group_advantages(torch.tensor([1.0, 0, 0, 0, 0.5, 0.7, 0.2, 0.2]), 4, std=None)
    assert_advantages(out.advantages_R, [0.75, -0.25, -0.25, -0.25, 0.1, 0.3, -0.2, -0.2])
    assert out.zero_signal_G.tolist() == [False, False]


def test_std_none_all_equal_group_is_zero():
    out = group_advantages(torch.tensor([0.1, 0.1, 0.1, 3.0, 3.0, 3.0]), 3, std=None)
    assert torch.equal(out.advantages_R, torch.zeros(6))
    assert out.zero_signal_G.tolist() == [True, True]


@pytest.mark.parametrize("std", ["sample", "population", None])
def test_all_equal_float_rewards_give_exact_zeros(std):
    # In float64, mean([0.1, 0.1, 0.1]) = 0.30000000000000004 / 3 = 0.10000000000000002, so the naive
    # formula gives r - mean = -1.4e-17 for every member: A = -1.4e-17 / (1.7e-17 + 1e-6) = -1.4e-11
    # instead of 0. The contract is an exact zero for a group that carries no signal.
    # (float64 input on purpose: float32 0.1 happens to average exactly.)
    out = group_advantages(torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64), 3, std=std)
    assert torch.equal(out.advantages_R, torch.zeros(3))
    assert out.zero_signal_G.tolist() == [True]


def test_all_equal_group_is_exact_zero_even_without_eps():
    # eps = 0 turns that rounding residue into -1.4e-17 / 1.7e-17 = -0.816 (sample std): a full-size
    # advantage out of nothing. The zero-signal rule must override it.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 0.5], dtype=torch.float64)
    out = group_advantages(rewards, 3, std="sample", eps=0.0)
    assert torch.equal(out.advantages_R[:3], torch.zeros(3))
    assert torch.isfinite(out.advantages_R).all()
    # Group 1: [1, 0, 0.5], mean 0.5, sample std = sqrt(0.5 / 2) = 0.5 -> [1, -1, 0]
    assert_advantages(out.advantages_R[3:], [1.0, -1.0, 0.0])


def test_population_std_allows_group_size_one():
    # G = 1: every group is trivially all-equal -> zero advantages, all flagged.
    out = group_advantages(torch.tensor([0.3, 0.9]), 1, std="population")
    assert torch.equal(out.advantages_R, torch.zeros(2))
    assert out.num_zero_signal_groups == 2


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rewards, group_size", [([1.0, 0.0, 1.0], 2), ([1.0, 0.0], 0), ([1.0] * 8, 3)])
def test_group_size_must_divide_the_rewards(rewards, group_size):
    with pytest.raises(ValueError, match="does not divide"):
        group_advantages(torch.tensor(rewards), group_size)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_is_rejected(bad):
    with pytest.raises(ValueError, match=r"non-finite rewards at indices \[2\]"):
        group_advantages(torch.tensor([1.0, 0.0, bad, 0.0]), 2)


def test_sample_std_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.tensor([1.0, 0.0]), 1, std="sample")


def test_unknown_std_kind_is_rejected():
    with pytest.raises(ValueError, match="std must be"):
        group_advantages(torch.tensor([1.0, 0.0]), 2, std="unbiased")
