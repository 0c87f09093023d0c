"""vocab_parallel_logprobs over TP ranks vs a float64 single-process reference: values and gradients.

usage: torchrun --nproc-per-node TP logprobs_tp.py

Every rank builds the same full logits [T, TP*V] from a fixed seed, keeps its vocab shard [T, V]
(rank r holds ids [r*V, (r+1)*V)), and runs vocab_parallel_logprobs with tp_group = the world. Its
log-probs and entropy must equal the reference's, and its gradient the reference gradient's shard.
Cases cover targets on every shard, padded vocabularies (a partly padded last shard; at TP >= 2 also
an all-padding last shard), chunked and unchunked, temperature, with and without entropy, and each
both with inplace=False and inplace=True (on a non-leaf copy of the shard; its values must equal the
copy path's bit for bit, its gradient to float32 rounding). The worker
also counts collectives: two all-reduces per forward at TP > 1, none in the backward, no gather.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.loss.logprobs import vocab_parallel_logprobs

from checks import check, done

T, V = 29, 24  # tokens; vocab shard per rank
TOL = dict(atol=1e-5, rtol=1e-5)


class CollectiveCounter:
    """Counts all-reduces; any gather or broadcast of the vocabulary fails the run."""

    def __init__(self):
        self.all_reduces = 0
        real = dist.all_reduce

        def counting_all_reduce(*args, **kwargs):
            self.all_reduces += 1
            return real(*args, **kwargs)

        def forbidden(*args, **kwargs):
            raise AssertionError("vocab_parallel_logprobs must not gather or broadcast")

        dist.all_reduce = counting_all_reduce
        for name in ("all_gather", "all_gather_into_tensor", "all_to_all", "broadcast", "gather"):
            setattr(dist, name, forbidden)


def cases(tp):
    full = V * tp
    vocab_sizes = [None, full - 5]                  # last shard partly padding
    if tp >= 2:
        vocab_sizes.append(V * (tp - 1) - 3)        # last shard all padding, the one before partly
    for vocab_size in vocab_sizes:
        for temperature, chunk_size, with_entropy in [(1.0, None, False), (0.7, 0, True),
                                                      (1.3, 4, True), (1.0, 7, False)]:
            yield vocab_size, temperature, chunk_size, with_entropy


def check_case(tp, rank, vocab_size, temperature, chunk_size, with_entropy, counter, inplace=False):
    n_ids = vocab_size or V * tp
    g = torch.Generator().manual_seed(n_ids * 100 + (chunk_size or 0))
    full_logits = torch.randn(T, V * tp, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(0, n_ids, (T,), generator=g)
    # A target on every shard that has valid ids (first and last valid id of each), whatever the seed.
    firsts = [r * V for r in range(tp) if r * V < n_ids]
    lasts = [min((r + 1) * V, n_ids) - 1 for r in range(tp) if r * V < n_ids]
    targets[: 2 * len(firsts)] = torch.tensor(firsts + lasts)
    up_lp, up_h = torch.randn(2, T, generator=g, dtype=torch.float64)

    # Reference on the whole vocabulary, float64.
    ref_logits = full_logits.clone().requires_grad_()
    logp = torch.log_softmax(ref_logits[:, :n_ids] / temperature, dim=-1)
    lp_ref = logp.gather(1, targets[:, None]).squeeze(1)
    h_ref = -(logp.exp() * logp).sum(-1)
    ((lp_ref * up_lp).sum() + ((h_ref * up_h).sum() if with_entropy else 0)).backward()
    grad_ref = ref_logits.grad[:, rank * V:(rank + 1) * V]

    shard = full_logits[:, rank * V:(rank + 1) * V].float().requires_grad_()
    before = counter.all_reduces
    # inplace: a non-leaf to overwrite (a leaf that requires grad is refused); the gradient reaches
    # `shard` through the copy.
    out = vocab_parallel_logprobs(shard.clone() if inplace else shard, targets, tp_group=dist.group.WORLD,
                                  temperature=temperature, vocab_size=vocab_size, chunk_size=chunk_size,
                                  with_entropy=with_entropy, inplace=inplace)
    lp, h = out if with_entropy else (out, None)
    forward_all_reduces = counter.all_reduces - before
    loss = (lp * up_lp.float()).sum() + ((h * up_h.float()).sum() if with_entropy else 0)
    loss.backward()
    backward_all_reduces = counter.all_reduces - before - forward_all_reduces

    what = (f"tp={tp} rank={rank} vocab_size={vocab_size} temp={temperature} chunk={chunk_size} "
            f"entropy={with_entropy} inplace={inplace}")
    assert lp.dtype == torch.float32, what
    close = torch.testing.assert_close
    close(lp.double(), lp_ref.detach(), **TOL, msg=lambda m: f"{what}: logprobs {m}")
    if with_entropy:
        close(h.double(), h_ref.detach(), **TOL, msg=lambda m: f"{what}: entropy {m}")
    close(shard.grad.double(), grad_ref, **TOL, msg=lambda m: f"{what}: grad {m}")
    n_pad = max(0, min(V, (rank + 1) * V - n_ids))
    assert shard.grad[:, V - n_pad:].eq(0).all(), f"{what}: padded columns got a gradient"
    expected = 2 if tp > 1 else 0  # a max, then one stacked sum; a group of one needs none
    assert (forward_all_reduces, backward_all_reduces) == (expected, 0), \
        f"{what}: {forward_all_reduces} all-reduces in forward, {backward_all_reduces} in backward"
    return (lp.double() - lp_ref.detach()).abs().max().item(), (lp.detach(), h, shard.grad)


def main():
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    counter = CollectiveCounter()
    errors, diffs = [], [0.0, 0.0, 0.0]  # inplace vs copy: max |d logprob|, |d entropy|, |d grad|
    for case in cases(tp):
        name = "vocab_size={} temperature={} chunk_size={} with_entropy={}".format(*case)
        with check(f"{name}: matches the float64 reference"):
            err, (lp, h, grad) = check_case(tp, rank, *case, counter)
        with check(f"{name}: inplace=True matches the float64 reference"):
            err_in, (lp_in, h_in, grad_in) = check_case(tp, rank, *case, counter, inplace=True)
        errors += [err, err_in]
        with check(f"{name}: inplace=True equals inplace=False"):
            what = f"tp={tp} rank={rank} case={case}: inplace vs copy"
            torch.testing.assert_close(lp_in, lp, atol=0, rtol=0, msg=lambda m: f"{what}: logprobs {m}")
            if h is not None:
                torch.testing.assert_close(h_in.detach(), h.detach(), atol=0, rtol=0,
                                           msg=lambda m: f"{what}: entropy {m}")
                diffs[1] = max(diffs[1], (h_in.detach() - h.detach()).abs().max().item())
            torch.testing.assert_close(grad_in, grad, atol=1e-7, rtol=1e-6, msg=lambda m: f"{what}: grad {m}")
            diffs[0] = max(diffs[0], (lp_in - lp).abs().max().item())
            diffs[2] = max(diffs[2], (grad_in - grad).abs().max().item())
    print(f"logprobs tp={tp} rank={rank}: {len(errors)} cases, max |logprob error| {max(errors):.1e}; "
          f"inplace vs copy max |diff| logprob {diffs[0]:.1e} entropy {diffs[1]:.1e} grad {diffs[2]:.1e}",
          flush=True)
    done()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
