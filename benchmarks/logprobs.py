"""Benchmark: per-token log-probs (+ entropy) from vocab-sharded logits, forward + backward, on CPU.

Side by side on the same shards (same seed per rank), at TP = 1 and 2 (gloo, one process per rank):
  ours      megatron_gspo.loss.vocab_parallel_logprobs (chunked, custom backward)
  ours-inplace  the same with inplace=True: overwrites the logits and returns them as the gradient,
            as Megatron does (on a non-leaf alias of the logits shard: a leaf that requires grad is
            refused, and in training the logits are the output layer's, a non-leaf)
  megatron  -megatron.core.tensor_parallel.vocab_parallel_cross_entropy (log-prob only; no entropy)
  naive     float32 autograd ops: log_softmax + gather at TP1; at TP>1 the same math unfused on the
            shard with differentiable all-reduces (no all-gather of the vocabulary)

Each (TP, variant, method) runs in fresh processes (torchrun), so one method's memory does not
colour another's. Time: median wall time of forward + torch.autograd.grad (gradient wrt the logits
shard) over --reps after one warm-up, max over ranks. Memory: peak RSS (VmHWM, reset through
/proc/self/clear_refs before each rep) minus the RSS just before the forward, with the logits,
targets and upstream gradient already resident; max over reps and ranks. This counts everything the
call allocates, including the returned gradient. Megatron's fp32 path works in place: it overwrites
the logits with the softmax and returns that buffer as the gradient, so the logits are refilled
before each rep (outside the timing) for every method.

    python benchmarks/logprobs.py                 # T=4096, V=151936 (Qwen3), TP 1 and 2
    python benchmarks/logprobs.py --quick         # smoke size
    python benchmarks/logprobs.py --baseline      # ours vs ours at commit 8824b49, side by side

--baseline [REV] also times megatron_gspo/loss/logprobs.py as it was at REV (`git show`, loaded as a
temporary module) in the same processes as the current one, on the same shards: each rep runs both,
in alternating order (new, old, old, new, ...), so that the noise of a shared machine hits both.
A second table gives new / old ratios of time and extra peak memory (then over the reps after the
warm-up only, for both) and checks that the values agree.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch.distributed.nn.functional import all_reduce as d_all_reduce

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, also where another is installed

from benchmarks.rss import mem_kb, reset_peak_rss  # noqa: E402
from devtools.torchrun import torchrun  # noqa: E402  (the repository root is on sys.path above)
from megatron_gspo.loss import logprobs as logprobs_module  # noqa: E402

BASELINE_REV = "8824b49"  # the last commit with three autograd Functions (issue 10)

METHODS = ("ours", "ours-inplace", "megatron", "naive")
VARIANTS = ("logprob", "logprob+entropy")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936, help="global vocab (divisible by every TP)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="logits dtype")
    p.add_argument("--chunk-size", type=int, default=None, help="ours: tokens per chunk (default: its own)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--quick", action="store_true", help="tiny smoke size: T=64, V=4096, 1 rep")
    p.add_argument("--baseline", nargs="?", const=BASELINE_REV, default=None, metavar="REV",
                   help=f"also time ours as of git commit REV (default {BASELINE_REV}), side by side")
    p.add_argument("--worker", nargs=2, metavar=("METHOD", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--baseline-file", help=argparse.SUPPRESS)  # worker: the baseline's source
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.vocab, args.reps = 64, 4096, 1
    return args


# ----------------------------------------------------------------------------------------- worker


def _method_fn(method, variant, tp_group, tp, chunk_size, impl=logprobs_module):
    """run(logits, targets) -> outputs of `method`, or None where it lacks `variant`. impl: the
    module whose vocab_parallel_logprobs the ours methods call."""
    entropy = variant == "logprob+entropy"
    if method in ("ours", "ours-inplace"):
        inplace = method == "ours-inplace"

        def run(logits, targets):
            out = impl.vocab_parallel_logprobs(_NonLeafAlias.apply(logits) if inplace else logits,
                                               targets, tp_group=tp_group, chunk_size=chunk_size,
                                               with_entropy=entropy, inplace=inplace)
            return out if entropy else (out,)
        return run
    if method == "megatron":
        if entropy:
            return None  # Megatron-Core has no vocab-parallel entropy
        return lambda logits, targets: (-vocab_parallel_cross_entropy(logits, targets),)

    # naive
    if tp == 1:
        def run(logits, targets):
            logp_TV = torch.log_softmax(logits.float(), dim=-1)
            out = (logp_TV.gather(1, targets[:, None]).squeeze(1),)
            if entropy:
                out += (-(logp_TV.exp() * logp_TV).sum(-1),)
            return out
        return run

    # torch's differentiable all-reduce sums the gradients over ranks in its backward, which is right
    # for lse (every rank's terms depend on every shard) but counts a replicated loss TP times: the
    # worker divides the upstream gradients of this method by TP to compensate.
    rank = dist.get_rank(tp_group)

    def run(logits, targets):
        x_TV = logits.float()
        m_T = x_TV.detach().amax(-1)
        dist.all_reduce(m_T, op=dist.ReduceOp.MAX, group=tp_group)
        z_TV = x_TV - m_T[:, None]
        lse_T = d_all_reduce(z_TV.exp().sum(-1), group=tp_group).log()
        logp_TV = z_TV - lse_T[:, None]
        V = logits.shape[-1]
        idx_T = targets - rank * V
        here_T = (idx_T >= 0) & (idx_T < V)
        tgt_T = logp_TV.gather(1, idx_T.clamp(0, V - 1)[:, None]).squeeze(1)
        out = (d_all_reduce(torch.where(here_T, tgt_T, 0.0), group=tp_group),)
        if entropy:
            out += (-d_all_reduce((logp_TV.exp() * logp_TV).sum(-1), group=tp_group),)
        return out
    return run


class _NonLeafAlias(torch.autograd.Function):
    """Identity whose output shares the input's storage without being a view of it: stands in, at
    no cost, for the output layer that makes the logits in training (in-place needs a non-leaf)."""

    @staticmethod
    def forward(ctx, x):
        return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.size(), x.stride())

    @staticmethod
    def backward(ctx, grad):
        return grad


def _load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker(args):
    method, variant = args.worker
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    if method == "megatron":
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = dist.group.WORLD
    # (label, run): the method, then with --baseline the same method on the baseline's code.
    runs = [(method, _method_fn(method, variant, group, tp, args.chunk_size))]
    if args.baseline_file and method in ("ours", "ours-inplace"):
        old = _load_module(args.baseline_file, "logprobs_baseline")
        runs.append((f"{method}@{args.baseline}",
                     _method_fn(method, variant, group, tp, args.chunk_size, impl=old)))
    T, V = args.tokens, args.vocab // tp

    gen = torch.Generator().manual_seed(1234)
    targets_T = torch.randint(0, args.vocab, (T,), generator=gen)
    grads = [torch.randn(T, generator=gen) for _ in range(2)]  # upstream: logprob, entropy
    logits_TV = torch.empty(T, V, dtype=getattr(torch, args.dtype), requires_grad=True)
    shard_gen = torch.Generator()
    up_scale = 1 / tp if method == "naive" else 1  # see _method_fn

    times = {label: [] for label, _ in runs}
    extra_kb = {label: [] for label, _ in runs}
    checks = {}
    for rep in range(args.reps + 1):  # rep 0 is the warm-up
        for label, run in runs if rep % 2 == 0 else runs[::-1]:  # new, old, old, new, ...
            with torch.no_grad():  # Megatron overwrites its input: refill before every run
                logits_TV.normal_(0.0, 3.0, generator=shard_gen.manual_seed(100 + rank))
            base_kb = mem_kb("VmRSS")
            reset_peak_rss()
            dist.barrier()
            t0 = time.perf_counter()
            outs = run(logits_TV, targets_T)
            (grad_TV,) = torch.autograd.grad(outs, logits_TV, [g * up_scale for g in grads[:len(outs)]])
            dist.barrier()
            dt = time.perf_counter() - t0
            # With a baseline alongside, the warm-up's peak is left out of the memory too: the second
            # run of rep 0 would find the first's freed pages still mapped and look smaller.
            if rep > 0 or len(runs) == 1:
                extra_kb[label].append(mem_kb("VmHWM") - base_kb)
            if rep > 0:
                times[label].append(dt)
            checks[label] = [o.detach().double().mean().item() for o in outs] + [
                grad_TV.double().norm().item()]
            del outs, grad_TV

    for label, _ in runs:
        stats = torch.tensor([statistics.median(times[label]), max(extra_kb[label])], dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        grad_sq = torch.tensor([checks[label][-1] ** 2], dtype=torch.float64)
        dist.all_reduce(grad_sq)  # the full gradient's norm, over all shards
        if rank == 0:
            c = checks[label]
            print("RESULT " + json.dumps({
                "tp": tp, "method": label, "variant": variant, "time_s": stats[0].item(),
                "extra_gb": stats[1].item() / 2**20, "logprob_mean": c[0],
                "entropy_mean": c[1] if len(c) > 2 else None, "grad_norm": grad_sq.sqrt().item()}),
                  flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter teardown: gloo occasionally aborts there ("terminate called without an active
    # exception", cf. pytorch/pytorch PR 179291) after all the work is done and reported.
    sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------- driver

def main(args):
    print(f"T={args.tokens} tokens, V={args.vocab} vocab, {args.dtype} logits, reps={args.reps} "
          f"(+1 warm-up), 1 thread per rank (OMP_NUM_THREADS=1), gloo, CPU; ours = "
          f"{Path(logprobs_module.__file__).relative_to(REPO)} of {REPO}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        extra = ["--chunk-size", str(args.chunk_size)] if args.chunk_size is not None else []
        if args.baseline:
            path = Path(tmp) / "logprobs_baseline.py"
            path.write_text(subprocess.run(
                ["git", "-C", str(REPO), "show", f"{args.baseline}:megatron_gspo/loss/logprobs.py"],
                check=True, capture_output=True, text=True).stdout)
            extra += ["--baseline", args.baseline, "--baseline-file", str(path)]
        rows = []
        for tp in args.tp:
            for variant in args.variants:
                for method in args.methods:
                    if method == "megatron" and variant != "logprob":
                        continue
                    out = torchrun(__file__, tp, "--worker", method, variant, "--tokens", str(args.tokens),
                                   "--vocab", str(args.vocab), "--reps", str(args.reps), "--dtype",
                                   args.dtype, *extra, timeout=1800)
                    for line in out.splitlines():
                        if line.startswith("RESULT "):
                            res = json.loads(line[7:])
                            print(f"  done tp={tp} {variant:16s} {res['method']:20s} {res['time_s']:.3f} s "
                                  f"{res['extra_gb']:.3f} GB", flush=True)
                            rows.append(res)
    print_table(rows, args)
    if args.baseline:
        print_baseline_table(rows, args.baseline)


def print_table(rows, args):
    itemsize = 4 if args.dtype == "float32" else 2
    logits_gb = {tp: args.tokens * (args.vocab // tp) * itemsize / 2**30 for tp in args.tp}
    meg = {r["tp"]: r for r in rows if r["method"] == "megatron"}
    print()
    print("time = median fwd+bwd wall s; extra peak = peak RSS above RSS with logits resident, GB per rank;")
    print("ratios vs Megatron's log-prob run at the same TP (targets: time <= 1.0x, memory <= 0.25x)")
    w = max(12, *(len(r["method"]) for r in rows))
    head = (f"{'TP':>2} {'variant':16s} {'method':{w}s} {'time s':>8} {'x meg':>7} {'extra GB':>9} "
            f"{'x meg':>7} {'x logits':>8} {'mean logp':>11} {'mean H':>9} {'|grad|':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        m = meg.get(r["tp"])
        t_ratio = f"{r['time_s'] / m['time_s']:.2f}" if m else "-"
        m_ratio = f"{r['extra_gb'] / m['extra_gb']:.2f}" if m and m["extra_gb"] > 0.01 else "-"
        ent = f"{r['entropy_mean']:.5f}" if r["entropy_mean"] is not None else "-"
        print(f"{r['tp']:>2} {r['variant']:16s} {r['method']:{w}s} {r['time_s']:8.3f} {t_ratio:>7} "
              f"{r['extra_gb']:9.3f} {m_ratio:>7} {r['extra_gb'] / logits_gb[r['tp']]:8.2f} "
              f"{r['logprob_mean']:11.5f} {ent:>9} {r['grad_norm']:9.4f}")
    print(f"(logits shard: {', '.join(f'TP{tp} {gb:.2f} GB' for tp, gb in logits_gb.items())})")
    print("Megatron with float32 logits overwrites them in place (softmax, then gradient, in the same\n"
          "buffer): its extra memory is ~0 and the logits are gone afterwards. With bf16 logits it makes\n"
          "a float32 copy. ours and naive leave the logits intact and return a new gradient (>= 1x logits).\n"
          "ours-inplace overwrites float32 logits the way Megatron does (bf16: the gradient is written into\n"
          "them in the backward, the forward's chunk buffers stay).")


def print_baseline_table(rows, rev):
    """new / old per (TP, variant, method), from the same processes (interleaved reps)."""
    old = {(r["tp"], r["variant"], r["method"].split("@")[0]): r for r in rows if "@" in r["method"]}
    print()
    print(f"ours now vs ours at {rev} (same processes, reps interleaved); ratio = now / {rev}")
    head = (f"{'TP':>2} {'variant':16s} {'method':12s} {'time now':>9} {'time old':>9} {'ratio':>6} "
            f"{'GB now':>7} {'GB old':>7} {'ratio':>6} {'same values':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        o = old.get((r["tp"], r["variant"], r["method"]))
        if o is None:
            continue
        m_ratio = f"{r['extra_gb'] / o['extra_gb']:.2f}" if o["extra_gb"] > 0.01 else "-"
        same = all(r[k] == o[k] for k in ("logprob_mean", "entropy_mean", "grad_norm"))
        print(f"{r['tp']:>2} {r['variant']:16s} {r['method']:12s} {r['time_s']:9.3f} {o['time_s']:9.3f} "
              f"{r['time_s'] / o['time_s']:6.2f} {r['extra_gb']:7.3f} {o['extra_gb']:7.3f} {m_ratio:>6} "
              f"{'yes' if same else 'NO':>11}")


if __name__ == "__main__":
    _args = parse_args()
    if _args.worker:
        worker(_args)
    else:
        main(_args)
