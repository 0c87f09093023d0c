"""Group-normalised advantages (GSPO eq. 6; GRPO's group baseline).

Shapes: R = number of responses = groups * G; rewards are ordered group-major
(group 0 samples 0..G-1, group 1 ...), the order SGLang returns `n=G` samples in.
"""
from __future__ import annotations

from typing import Literal, NamedTuple

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
    centred_GS = rewards_GS - rewards_GS.mean(dim=1, keepdim=True)
    if std is not None:
        std_G1 = rewards_GS.std(dim=1, keepdim=True, correction=1 if std == "sample" else 0)
        centred_GS = centred_GS / (std_G1 + eps)
    zero_signal_G = (rewards_GS.max(dim=1).values == rewards_GS.min(dim=1).values)
    centred_GS = torch.where(zero_signal_G[:, None], torch.zeros_like(centred_GS), centred_GS)
    return GroupAdvantages(centred_GS.flatten().to(torch.float32), zero_signal_G)
