"""Group-normalised advantages (GSPO eq. 6; GRPO's group baseline), and per-turn ones for GSPO-token.

Shapes: R = number of responses = groups * G; rewards are ordered group-major
(group 0 samples 0..G-1, group 1 ...), the order SGLang returns `n=G` samples in.

Multi-turn episodes (docs/gspo.md, "Per-turn rewards"): sample i has model turns k = 1..K_i with rewards
r_{i,k} (the outcome reward on its last turn) and reward r_i = sum_k r_{i,k}. GSPO and GRPO give it one
advantage, `group_advantages` of the r_i. GSPO-token gives each turn's tokens the group-normalised return from
that turn on (`turn_advantages`):

    R_{i,k} = sum_{k' >= k} r_{i,k'}          A_{i,k} = (R_{i,k} - mean_j r_j) / (std_j r_j + eps)

with the group's baseline and scale those of the whole-episode rewards r_j. When all reward is at the end,
R_{i,k} = r_i for every k and A_{i,k} is A_i bit for bit, so GSPO-token is GSPO (paper section 4.1). A
group whose r_j are all equal gets 0 everywhere, as in `group_advantages` (dynamic sampling drops it alike),
even when its rewards differ turn by turn: its scale would be 0.
"""
from __future__ import annotations

from typing import Literal, NamedTuple, Sequence

import torch

StdKind = Literal["sample", "population"]


class GroupAdvantages(NamedTuple):
    advantages_R: torch.Tensor
    """One float32 advantage per response."""
    zero_signal_G: torch.Tensor
    """Bool per group: all rewards equal, so every advantage in it is exactly 0 (no signal)."""

    @property
    def num_zero_signal_groups(self) -> int:
        return int(self.zero_signal_G.sum())


def group_advantages(rewards: torch.Tensor, group_size: int, *, std: StdKind | None = "sample",
                     eps: float = 1e-6) -> GroupAdvantages:
    """A_i = (r_i - mean_group r) / (std_group r + eps).

    std="sample" divides the variance by G-1 (torch.std's default; what the GSPO/GRPO papers' code
    uses), "population" by G, and None skips the division (Dr. GRPO: A_i = r_i - mean).
    A group whose rewards are all equal gets exactly zero advantages, whatever rounding the mean has.
    """
    rewards_R = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if group_size < 1 or rewards_R.numel() % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {rewards_R.numel()} rewards")
    if std not in ("sample", "population", None):
        raise ValueError(f"std must be 'sample', 'population' or None, got {std!r}")
    if std == "sample" and group_size < 2:
        raise ValueError("std='sample' needs group_size >= 2")
    if not torch.isfinite(rewards_R).all():
        bad = torch.nonzero(~torch.isfinite(rewards_R)).flatten().tolist()
        raise ValueError(f"non-finite rewards at indices {bad[:10]}")
    rewards_GS = rewards_R.view(-1, group_size)
    mean_G1, scale_G1, zero_signal_G = _group_stats(rewards_GS, std, eps)
    return GroupAdvantages(_normalise(rewards_GS, mean_G1, scale_G1, zero_signal_G[:, None]).flatten().to(torch.float32),
                           zero_signal_G)


def _group_stats(rewards_GS: torch.Tensor, std: StdKind | None, eps: float):
    """Each group's baseline [G, 1], scale [G, 1] (std + eps, or None: no division) and zero-signal flag [G]."""
    mean_G1 = rewards_GS.mean(dim=1, keepdim=True)
    scale_G1 = None
    if std is not None:
        scale_G1 = rewards_GS.std(dim=1, keepdim=True, correction=1 if std == "sample" else 0) + eps
    return mean_G1, scale_G1, rewards_GS.max(dim=1).values == rewards_GS.min(dim=1).values


def _normalise(values: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor) -> torch.Tensor:
    """(values - mean) / scale, exactly 0 where `zero`: the one formula of both advantages (so that equal inputs
    give equal bits)."""
    centred = values - mean
    if scale is not None:
        centred = centred / scale
    return torch.where(zero, torch.zeros_like(centred), centred)


def turn_advantages(turn_rewards: Sequence[Sequence[float]], rewards: Sequence[float], group_size: int, *,
                    std: StdKind | None = "sample", eps: float = 1e-6) -> list[list[float]]:
    """GSPO-token's advantage of each model turn of each sample (module doc): A_{i,k} from the returns
    R_{i,k} = sum of turn_rewards[i][k:], normalised by the group statistics of `rewards` (r_i, each sample's
    reward: the sum of its turn rewards). Samples in group-major order, as group_advantages takes them."""
    if len(turn_rewards) != len(rewards):
        raise ValueError(f"{len(turn_rewards)} samples' turn rewards but {len(rewards)} rewards")
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {len(rewards)} rewards")
    if std not in ("sample", "population", None):
        raise ValueError(f"std must be 'sample', 'population' or None, got {std!r}")
    if std == "sample" and group_size < 2:
        raise ValueError("std='sample' needs group_size >= 2")
    rewards_GS = torch.as_tensor(rewards, dtype=torch.float64).view(-1, group_size)
    if not torch.isfinite(rewards_GS).all():
        raise ValueError("non-finite rewards")
    mean_G1, scale_G1, zero_signal_G = _group_stats(rewards_GS, std, eps)
    returns, group_of = [], []
    for i, per_turn in enumerate(turn_rewards):
        following = 0.0
        tail = []
        for r in reversed(per_turn):      # R_{i,k} = r_{i,k} + R_{i,k+1}
            following += r
            tail.append(following)
        returns.extend(reversed(tail))
        group_of.extend([i // group_size] * len(per_turn))
    returns_T = torch.tensor(returns, dtype=torch.float64)
    g = torch.tensor(group_of, dtype=torch.long)
    values = _normalise(returns_T, mean_G1[g, 0], None if scale_G1 is None else scale_G1[g, 0], zero_signal_G[g])
    flat, out, at = values.to(torch.float32).tolist(), [], 0
    for per_turn in turn_rewards:
        out.append(flat[at:at + len(per_turn)])
        at += len(per_turn)
    return out


def spread_over_turns(turn_values: Sequence[float], spans: Sequence[tuple[int, int]], length: int) -> list[float]:
    """A per-response-token list of `length`: each turn's value on its span [start, end), 0.0 elsewhere (the
    environment's tokens, which the loss mask leaves out)."""
    out = [0.0] * length
    for value, (start, end) in zip(turn_values, spans, strict=True):
        out[start:end] = [value] * (end - start)
    return out
