"""Autograd-aware collectives used by the loss (process groups always passed explicitly)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x, on every rank.

    Each rank's y feeds that rank's own loss, so dL/dx on a rank is the sum over ranks of dL_r/dy_r:
    the backward is again a sum all-reduce. Every rank must therefore run the backward (give y a
    place in its loss, if only with weight 0) or the collective deadlocks.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        grad_x = grad_y.contiguous().clone()
        dist.all_reduce(grad_x, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_x, None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum all-reduce; the identity when `group` is None or has one rank."""
    if group_size(group) == 1:
        return x
    return _AllReduceSum.apply(x, group)
