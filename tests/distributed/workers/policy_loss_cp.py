"""policy_loss under context parallelism vs the same batch in one process: values and gradients.

usage: torchrun --nproc-per-node CP policy_loss_cp.py

Every rank builds the same full batch, keeps its CP part (Megatron's 2*cp-chunk layout), and runs
policy_loss with cp_group = the world. Summed over CP ranks, loss_sum and num_sequences must equal
the single-process values, and each rank's gradient must equal its part of the reference gradient.
Batch 2 puts every response token in chunk 0, so the other CP ranks hold none: they must still join
the collectives and get a finite loss with exactly zero gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.loss.policy import policy_loss, reduce_metrics
from megatron_gspo.parallel.context_parallel import split_for_cp

from checks import check, done

B, S = 6, 16
CLIP = dict(eps_low=3e-4, eps_high=4e-4)  # GSPO's band for every algorithm, so GRPO clips too


def batch(all_in_first_chunk: bool):
    g = torch.Generator().manual_seed(3 + all_in_first_chunk)
    logprobs = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    shift = torch.tensor([0.0, 1e-4, -1e-4, 1e-3, -1e-3, 0.05])[:, None]
    old = logprobs + shift + 1e-5 * torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, S)
    chunk = S // (2 * dist.get_world_size())
    for i in range(B):
        if all_in_first_chunk:
            mask[i, 1:chunk] = 1
        else:
            start = int(torch.randint(1, S // 2, (), generator=g))
            mask[i, start: start + int(torch.randint(1, S - start, (), generator=g))] = 1
    mask[2] = 0                       # an empty response
    old[3, 5] = float("nan")          # a masked-out NaN: must change nothing
    mask[3, 5] = 0
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -2.0])
    return logprobs.float(), old.float(), mask, advantages


def check_case(algorithm: str, all_in_first_chunk: bool) -> None:
    cp, rank = dist.get_world_size(), dist.get_rank()
    logprobs, old, mask, advantages = batch(all_in_first_chunk)
    per_token = algorithm == "gspo_token"
    adv = advantages[:, None].expand(B, S).contiguous() if per_token else advantages

    ref_lp = logprobs.clone().requires_grad_()
    ref_loss, ref_n, ref_metrics = policy_loss(
        ref_lp.flatten(), old.flatten(), adv.flatten() if per_token else adv, mask.flatten(),
        torch.arange(B + 1) * S, algorithm=algorithm, **CLIP)
    ref_loss.backward()

    local = lambda t: split_for_cp(t, cp, rank, seq_dim=1)
    lp = local(logprobs).clone().requires_grad_()
    s_local = lp.shape[1]
    loss, n, metrics = policy_loss(
        lp.flatten(), local(old).flatten(), local(adv).flatten() if per_token else adv,
        local(mask).flatten(), torch.arange(B + 1) * s_local, algorithm=algorithm, cp_group=dist.group.WORLD,
        **CLIP)
    loss.backward()

    where = f"[{algorithm} first_chunk={all_in_first_chunk} rank {rank}]"
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), where
    total = loss.detach().clone()
    dist.all_reduce(total)
    counted = torch.tensor(float(n))
    dist.all_reduce(counted)
    assert torch.allclose(total, ref_loss.detach(), rtol=1e-5, atol=1e-7), f"{where} loss {total} vs {ref_loss}"
    assert counted == ref_n == B, f"{where} num_sequences {counted} vs {ref_n}"
    grad_err = (lp.grad - local(ref_lp.grad)).abs().max().item()
    assert grad_err <= 1e-6, f"{where} gradient differs by {grad_err:.2e}"
    reduced = reduce_metrics([metrics], dist.group.WORLD)
    for key in ("sequences_clipped", "tokens_clipped", "sequences_empty", "tokens", "ratio_min", "ratio_max"):
        assert torch.allclose(reduced[key], ref_metrics[key].double()), f"{where} metric {key}: " \
            f"{reduced[key]} vs {ref_metrics[key]}"
    if all_in_first_chunk and rank > 0:
        assert (lp.grad == 0).all(), f"{where} a rank without response tokens got gradient"
    if not all_in_first_chunk:
        assert ref_metrics["sequences_clipped"] > 0, "the batch should clip something"


def main() -> None:
    dist.init_process_group("gloo")
    for algorithm in ("gspo", "gspo_token", "grpo"):
        for all_in_first_chunk in (False, True):
            tokens = "all in chunk 0" if all_in_first_chunk else "spread"
            with check(f"{algorithm}, response tokens {tokens}: matches one process"):
                check_case(algorithm, all_in_first_chunk)
    done()
    dist.barrier()
    dist.destroy_process_group()  # without it gloo can abort at exit ("terminate called ...")


if __name__ == "__main__":
    main()
