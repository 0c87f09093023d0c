"""Benchmark: this project's GSPO training step vs Megatron-Core's own, same model, same micro-batches.

Four passes over one packed mini-batch, in the same processes, on the same weights:
  (a) gspo train       training/step.py:_optimizer_step with policy_forward_step (the trainer's
                       recompute mode: no entropy in the training forward): logits ->
                       vocab_parallel_logprobs (in place) -> GSPO policy_loss -> backward ->
                       Megatron's optimizer step, through model/schedule.py:run_schedule
  (b) megatron train   the same schedule, DDP and optimizer with Megatron-LM pretraining's loss:
                       GPTModel(..., labels=) runs tensor_parallel.vocab_parallel_cross_entropy
                       inside the model, loss_func is the masked mean over the micro-batch's
                       response tokens (pretrain_gpt.py's legacy two-tuple contract, as
                       calculate_per_token_loss=False here), its value averaged over DP for logging
  (c) gspo recompute   training/old_logprobs.py:recompute_old_logprobs: forward-only, log-probs + entropy
                       of every response token, the rollout-gap / entropy reduction
  (d) megatron forward (b)'s forward step with forward_only=True under torch.no_grad(), as
                       Megatron-LM's evaluate() runs it
Both step functions are private (underscore) names of training/step.py, imported as they are.
Besides the loss itself, (a) and (b) differ in: the softmax (ours leaves Megatron's padded vocab
rows out, Megatron's cross entropy includes them), the logits layout (see the measurements below),
and the logging reductions (ours: reduce_metrics' all-reduce per metric plus one of the loss sum,
per step; Megatron-LM: one all-reduce of the loss per micro-batch). CP is not covered.

The mini-batch: N responses in groups of G, prompts of 20-60 tokens, response lengths lognormal
(median --median-len, log-std --sigma, capped at --max-len, like a max_new_tokens), random token
ids and group advantages from random 0/1 rewards, packed by training/packing.py:pack_minibatch
exactly as the trainer packs it (training/step.py:_pack). padding_fraction = padded positions /
all positions of this DP rank's micro-batches (mean over DP ranks).

Each rep runs all four passes, in the order a b c d on even reps and b a d c on odd ones, so the
noise of a shared machine hits both sides of each ratio; rep 0 is a warm-up, left out. The
learning rate is 0 (Adam's arithmetic still runs in full), so every rep sees the same weights and
pass (a) is always on-policy (s_i = 1), as mini-batch 1 of a recompute step is. Time: wall time
of the pass between two barriers (so the slowest rank's), and the CPU time of the busiest rank
(time.process_time, all its threads: what the pass cost, less coloured by the other jobs of a
shared machine than its wall time), medians over reps; the ratio columns are the medians of the
per-rep ratios a/b and c/d (paired, same rep). Per trained token: divided by
the response tokens (loss-mask positions) and by all real tokens (prompt + response) of the
mini-batch over every DP rank. Memory, per rank, max over ranks: after a warm-up of every pass,
each pass once with malloc's mmap threshold at 256 KiB (MALLOC_MMAP_THRESHOLD_), so that RSS follows
the live tensors and the order of the passes does not colour their peaks (with glibc's default the
same pass's peak varied by +-30 MB from rep to rep; with this, a pass's peak is the same to 0.1 MB);
peak = VmHWM, reset through /proc/self/clear_refs just before the pass, `extra` = that peak minus
the RSS just before it. The timed reps come after, with the threshold at 32 MiB (mallopt), where
glibc's dynamic threshold ends up by default. `logits` is the largest micro-batch's float32 logits
shard (rows x length x padded vocab / TP), the unit of the issue's memory target.

    python benchmarks/train_overhead.py                      # tp1, tp2, ep2; 64 responses, 4 reps (~4 min)
    python benchmarks/train_overhead.py --layouts tp1,tp2 --vocab 16384 --reps 3
    python benchmarks/train_overhead.py --quick              # smoke run (tests/distributed/...)

Layouts: tp1 = 1 process, tiny_dense; tp2 = 2 processes, tiny_dense at TP2; ep2 = 2 processes,
tiny_moe (4 experts, top-2) with its experts over 2 ranks (DP 2). 1 thread per rank, gloo, CPU.

Measured 2026-12-04 on this 2-core CPU machine, shared with two other jobs (load 3-6), `nice -n 10`,
defaults (N=64, G=8, median 160, sigma 0.9, cap 1024, 4096 tokens per micro-batch: 18727 response /
21415 real tokens), --reps 5. CPU-time ratios; wall ratios in brackets (wall time is at the mercy
of the other jobs: tp2 train 0.75 is noise, its CPU ratio is 1.00):

    layout  V    micro-batches  padding_fraction  train a/b      forward c/d    extra peak a-b, c-d
    tp1     500  7              0.146             1.041 (1.046)  1.031 (1.025)  -0.1 MB, -0.2 MB
    tp2     500  7 per rank     0.149             1.000 (0.754)  1.005 (0.947)  -0.7 MB, +0.2 MB
    ep2     500  4 per rank     0.246             1.000 (1.014)  1.008 (0.978)  +0.0 MB, +0.8 MB
    tp1 train: 1.96 s CPU per step = 105 us per response token, 92 us per real token; peak RSS
    628 MB, 245 MB above the resting model, 32x the largest logits shard (7.6 MB): the peak is
    the CPU attention's S x S scores of the longest micro-batch, not the loss, at this vocabulary.

At V=500 the loss is a small part of the step (the profile of tp1 puts the log-prob kernel,
GSPO loss and metrics at ~1-2% of it), so the per-rep noise (+-5% on the identical attention
ops) is as large as the difference.

With a vocabulary that makes the logits matter (--layouts tp1,tp2 --vocab 16384 --reps 3; the
largest logits shard 243 MB at TP1, 123 MB at TP2):

    layout  V      train a/b      forward c/d    extra peak a-b          c-d
    tp1     16384  1.270 (1.355)  1.124 (1.001)  +237.5 MB = +0.98 x logits  +243.0 MB = +1.00 x
    tp2     16384  1.263 (1.010)  1.095 (1.019)  +119.0 MB = +0.97 x logits  +122.9 MB = +1.00 x
    tp1 train: 6.68 s CPU (a) vs 5.24 s (b); 357 vs 280 us per response token.

What dominates the excess, both in time and memory (torch.profiler of tp1 at V=16384, one step
each): two logits-sized copies per micro-batch that Megatron's own path does not make. Without
labels, GPTModel.forward returns `logits.transpose(0, 1).contiguous()` ([s, b, V] -> [b, s, V]),
and in the backward the [b, s, V] gradient is copied back into [s, b, V] for the output layer's
matmul: aten::copy_ 2368 ms vs 383 ms over the step, ~100 ms per copy of [1074, 3, 16384], i.e.
~1.4 s of the ~1.5 s difference; the copy also holds the second logits-sized buffer that is the
+1.0 x logits of extra peak. Megatron's labels path computes the cross entropy on the [s, b, V]
logits where they lie and transposes only the [s, b] loss. The log-prob kernel itself is faster
than Megatron's cross entropy here (roughly 0.6 s vs 1.1 s in their max / exp / sub / sum / div ops).

Fixed since (model/gpt.py PolicyGPTModel: the trainer calls the model with labels and gets the
[s, b, V] logits Megatron's loss would get; log-probs are computed on [s, b] and the small result
transposed). The same command afterwards, on a quiet machine (CPU-time ratios, wall in brackets):

    layout  V      train a/b      forward c/d    extra peak a-b          c-d
    tp1     16384  0.888 (0.886)  0.872 (0.872)  +0.1 MB = +0.00 x logits  +2.1 MB = +0.01 x
    tp2     16384  0.889 (0.903)  0.888 (0.884)  +0.8 MB = +0.01 x logits  +2.0 MB = +0.02 x
    tp1 train: 5.18 s CPU (a) vs 5.89 s (b); 277 vs 315 us per response token.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel.utils import is_pp_last_stage

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, also where another is installed

# noqa: E402 below: these need the path above
from benchmarks.rss import mem_kb, reset_peak_rss  # noqa: E402
from devtools.torchrun import torchrun  # noqa: E402
from megatron_gspo.config import OptimizerConfig, ParallelConfig  # noqa: E402
from megatron_gspo.loss.advantages import group_advantages  # noqa: E402
from megatron_gspo.model.gpt import build_model, padded_vocab_size, transformer_config  # noqa: E402
from megatron_gspo.model.presets import PRESETS  # noqa: E402
from megatron_gspo.model.schedule import run_schedule  # noqa: E402
from megatron_gspo.parallel.groups import init_megatron, manual_seed  # noqa: E402
from megatron_gspo.training.forward_step import LossSettings  # noqa: E402
from megatron_gspo.training.optimizer import build_optimizer  # noqa: E402
from megatron_gspo.training.packing import Response  # noqa: E402
# private helpers of the trainer's step, used as they are (the path under measurement)
from megatron_gspo.training.old_logprobs import OldPolicy, pack, recompute_old_logprobs  # noqa: E402
from megatron_gspo.training.step import _optimizer_step  # noqa: E402

SHORT = {"loss/value": "loss", "loss": "loss", "train/entropy": "entropy", "train/grad_norm": "grad_norm"}
"""The record keys shown, by their short names."""


@dataclass(frozen=True)
class Layout:
    nproc: int
    tp: int
    ep: int
    preset: str

    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, ep=self.ep, dp=self.nproc // self.tp)


LAYOUTS = {"tp1": Layout(1, 1, 1, "tiny_dense"), "tp2": Layout(2, 2, 1, "tiny_dense"),
           "ep2": Layout(2, 1, 2, "tiny_moe")}
PASSES = ("gspo train", "megatron train", "gspo recompute", "megatron forward")
ORDER = ((0, 1, 2, 3), (1, 0, 3, 2))  # even reps, odd reps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="tp1,tp2,ep2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    p.add_argument("--reps", type=int, default=4, help="timed reps per pass (after one warm-up)")
    p.add_argument("--responses", type=int, default=64, help="N: responses in the mini-batch")
    p.add_argument("--group-size", type=int, default=8, help="G: responses per prompt (advantage groups)")
    p.add_argument("--median-len", type=float, default=160.0, help="median response length (tokens)")
    p.add_argument("--sigma", type=float, default=0.9, help="log-std of the lognormal response length")
    p.add_argument("--max-len", type=int, default=1024, help="response length cap (max_new_tokens)")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="parallel.max_tokens_per_microbatch (the demo's: 4096)")
    p.add_argument("--vocab", type=int, default=None, help="true vocabulary size (default: the preset's, 500)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="smoke size: 8 short responses, 1 rep")
    p.add_argument("--worker", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.responses, args.group_size = 1, 8, 4
        args.median_len, args.max_len, args.max_tokens = 12.0, 48, 256
    args.layouts = args.layouts.split(",")
    for name in args.layouts:
        if name not in LAYOUTS:
            p.error(f"--layouts: unknown layout {name!r} (known: {', '.join(LAYOUTS)})")
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    if args.responses % args.group_size:
        p.error(f"--responses {args.responses} is not a multiple of --group-size {args.group_size}")
    return args


def model_shape(layout: Layout, vocab: int | None):
    shape = PRESETS[layout.preset]
    return shape if vocab is None else dataclasses.replace(shape, vocab_size=vocab)


def long_tailed_responses(args, vocab_size: int) -> list[Response]:
    """N responses: prompts of 20-60 tokens, lognormal response lengths, group advantages."""
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.empty(args.responses).log_normal_(math.log(args.median_len), args.sigma, generator=g)
    lengths = lengths.round().clamp(1, args.max_len).long().tolist()
    rewards = torch.randint(0, 2, (args.responses,), generator=g).float()
    advantages = group_advantages(rewards, args.group_size).advantages_R.tolist()
    responses = []
    for i, length in enumerate(lengths):
        if i % args.group_size == 0:  # one prompt per group
            prompt = torch.randint(1, vocab_size, (int(torch.randint(20, 61, (), generator=g)),), generator=g)
        response = torch.randint(1, vocab_size, (length,), generator=g)
        responses.append(Response(prompt.tolist(), response.tolist(), advantages[i]))
    return responses


def real_tokens(packed, responses) -> int:
    """Prompt + response tokens in this DP rank's micro-batches (the rest of each row is padding)."""
    return sum(len(responses[i].prompt_ids) + len(responses[i].response_ids) for rows in packed.rows for i in rows)


def padding_fraction(packed, responses) -> float:
    """Padded positions / all positions of this DP rank's micro-batches."""
    return 1.0 - real_tokens(packed, responses) / sum(mb.tokens_BS.numel() for mb in packed.micro_batches)


# ----------------------------------------------------------------------------------------- worker


_LIBC = ctypes.CDLL("libc.so.6")
M_MMAP_THRESHOLD = -3  # glibc malloc.h: mallopt's parameter number
MMAP_THRESHOLD_MEMORY = 256 << 10  # bytes; while measuring memory (see worker)
MMAP_THRESHOLD_TIMING = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def megatron_forward_step(pgs):
    """Megatron-LM pretraining's forward step on our MicroBatch: the model computes the per-token
    cross entropy (vocab_parallel_cross_entropy) from labels, loss_func takes its masked mean."""

    def loss_func(loss_mask_BS, losses_BS):
        mask = loss_mask_BS.reshape(-1).float()
        loss = torch.sum(losses_BS.float().reshape(-1) * mask) / mask.sum()
        reported = loss.detach().clone()  # average_losses_across_data_parallel_group
        dist.all_reduce(reported, group=pgs.dp)
        return loss, {"lm loss": reported / pgs.dp.size()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        positions_BS = torch.arange(batch.tokens_BS.shape[1]).expand_as(batch.tokens_BS)
        # This project's PolicyGPTModel hands back the [s, b, V] logits its labels path would give the LM
        # loss; GPTModel's own compute_language_model_loss then runs exactly what Megatron-LM runs.
        logits_SBV = model(batch.tokens_BS, positions_BS, None, labels=batch.labels_BS)
        module = model.module if hasattr(model, "module") else model
        losses_BS = GPTModel.compute_language_model_loss(module, batch.labels_BS, logits_SBV)
        return losses_BS, functools.partial(loss_func, batch.loss_mask_BS)

    return forward_step


def worker(args):
    layout = LAYOUTS[args.worker]
    pgs = init_megatron(layout.parallel(), seed=args.seed)
    shape = model_shape(layout, args.vocab)
    manual_seed(args.seed, pgs)
    model = build_model(shape, transformer_config(shape, layout.parallel()), pgs=pgs)
    optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-6), total_steps=1)
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # the same weights every rep (see the docstring)
    loss = LossSettings(algorithm="gspo", temperature=1.0, vocab_size=shape.vocab_size)
    responses = long_tailed_responses(args, shape.vocab_size)
    mini = pack(responses, pgs, args.max_tokens, pack_sequences=False)

    def megatron_step():
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = run_schedule(model, mini, megatron_forward_step(pgs), pgs=pgs, forward_only=False)
        optimizer.step()
        return {"loss": statistics.fmean(float(o["lm loss"]) for o in outputs)}

    @torch.no_grad()
    def megatron_forward():
        outputs = run_schedule(model, mini, megatron_forward_step(pgs), pgs=pgs, forward_only=True)
        return {"loss": statistics.fmean(float(o["lm loss"]) for o in outputs)}

    def recompute():
        return recompute_old_logprobs(model, mini, loss, pgs)

    passes = [lambda: _optimizer_step(model, optimizer, mini, loss, pgs, OldPolicy()), megatron_step, recompute,
              megatron_forward]
    times = [[] for _ in PASSES]  # wall s per rep
    cpu = [[] for _ in PASSES]  # this process's CPU s per rep (all threads)
    extra_kb = [0] * len(PASSES)
    peak_kb = [0] * len(PASSES)
    values = [{} for _ in PASSES]
    # (a) trains on the recomputed old log-probs: fill them before the first (a); then one warm-up
    # of every pass (first-call allocations: Adam's state, autograd's and gloo's buffers)
    recompute_old_logprobs(model, mini, loss, pgs)
    for run in passes:
        run()
    # Memory first, while every allocation above MMAP_THRESHOLD_MEMORY is its own mmap (set for
    # this process by main()), handed back to the system when freed: RSS then follows the live
    # tensors, and a pass's peak does not depend on what the passes before it left in malloc's
    # heap (with glibc's default the same pass's peak varied by +-30 MB from rep to rep).
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MMAP_THRESHOLD_MEMORY):
        raise RuntimeError(f"the worker needs MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD_MEMORY} in its environment "
                           f"(main() sets it); got {os.environ.get('MALLOC_MMAP_THRESHOLD_')!r}")
    for i in range(len(PASSES)):
        _LIBC.malloc_trim(0)
        dist.barrier()
        base = mem_kb("VmRSS")
        reset_peak_rss()
        passes[i]()
        peak_kb[i] = mem_kb("VmHWM")
        extra_kb[i] = peak_kb[i] - base
    # Then the timing, with malloc's heap serving everything below glibc's largest dynamic threshold
    # (32 MiB), as it does by default once warm: otherwise every large tensor would pay its page
    # faults afresh (+13% on both sides at the default size).
    if _LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_TIMING) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")
    for rep in range(args.reps + 1):  # rep 0: warm-up of the heap at its new threshold
        for i in ORDER[rep % 2]:
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            record = passes[i]()
            dist.barrier()
            elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if rep > 0:
                times[i].append(elapsed)
                cpu[i].append(elapsed_cpu)
            values[i] = {short: float(record[k]) for k, short in SHORT.items() if k in record}

    # response tokens, real tokens, padding fraction (summed over DP here), sum of the recomputed
    # log-probs (the old_logprobs_BS that (c) filled in; zero off the loss mask)
    tokens = torch.tensor([sum(float(mb.loss_mask_BS.sum()) for mb in mini.micro_batches),
                           real_tokens(mini, responses), padding_fraction(mini, responses),
                           sum(float(mb.old_logprobs_BS.double().sum()) for mb in mini.micro_batches)],
                          dtype=torch.float64)
    dist.all_reduce(tokens, group=pgs.dp)
    values[2]["loss"] = -tokens[3].item() / tokens[0].item()  # comparable with (d)'s cross entropy
    memory = torch.tensor(extra_kb + peak_kb, dtype=torch.float64)
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    cpu_max = torch.tensor(cpu, dtype=torch.float64)
    dist.all_reduce(cpu_max, op=dist.ReduceOp.MAX)  # per pass and rep: the busiest rank's
    max_rows_len = max(mb.tokens_BS.numel() for mb in mini.micro_batches)
    logits_kb = max_rows_len * padded_vocab_size(shape.vocab_size, layout.tp) // layout.tp * 4 / 1024
    if dist.get_rank() == 0 and is_pp_last_stage(pgs.pp):
        n = len(PASSES)
        print("RESULT " + json.dumps({
            "layout": args.worker, "nproc": layout.nproc, "preset": layout.preset, "vocab": shape.vocab_size,
            "microbatches": mini.num_microbatches, "response_tokens": tokens[0].item(),
            "tokens": tokens[1].item(), "padding_fraction": tokens[2].item() / pgs.dp.size(),
            "logits_mb": logits_kb / 1024, "times": times, "cpu": cpu_max.tolist(), "values": values,
            "extra_mb": [m / 1024 for m in memory[:n].tolist()], "peak_mb": [m / 1024 for m in memory[n:].tolist()]}),
              flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo occasionally aborts there (see benchmarks/logprobs.py)


# ----------------------------------------------------------------------------------------- driver

def describe(args) -> str:
    """The mini-batch and run settings, as the first line of a benchmark's output."""
    return (f"N={args.responses} responses (G={args.group_size}), prompts 20-60 tokens, response lengths "
            f"lognormal(median {args.median_len:g}, sigma {args.sigma:g}) capped at {args.max_len}, "
            f"max_tokens_per_microbatch={args.max_tokens}, reps={args.reps} (+1 warm-up), "
            f"1 thread per rank, gloo, CPU")


def run_layout(script, name: str, args) -> dict:
    """Run `script --worker NAME` under torchrun with the mini-batch arguments of `args`; its one RESULT."""
    forwarded = ["--reps", args.reps, "--responses", args.responses, "--group-size", args.group_size,
                 "--median-len", args.median_len, "--sigma", args.sigma, "--max-len", args.max_len,
                 "--max-tokens", args.max_tokens, "--seed", args.seed]
    if args.vocab is not None:
        forwarded += ["--vocab", args.vocab]
    out = torchrun(script, LAYOUTS[name].nproc, "--worker", name, *forwarded, timeout=3600)
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    if len(results) != 1:
        raise RuntimeError(f"layout {name}: expected one RESULT line from the worker, got "
                           f"{len(results)}:\n{out[-4000:]}")
    return results[0]


def main(args):
    print(describe(args), flush=True)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD_MEMORY)  # for the workers (see worker)
    rows = []
    for name in args.layouts:
        rows.append(run_layout(__file__, name, args))
        print(f"  done {name}", flush=True)
    print_table(rows)


def paired_ratios(times) -> list[float]:
    """Median over reps of t(a)/t(b) and of t(c)/t(d), each pair from the same rep."""
    return [statistics.median(x / y for x, y in zip(times[i], times[i + 1])) for i in (0, 2)]


def print_table(rows) -> None:
    print()
    print("wall: median s per pass over reps (between barriers: the slowest rank); cpu: median CPU s of the\n"
          "busiest rank (all its threads; less coloured by other jobs than wall time on a shared machine);\n"
          "us/resp, us/tok: cpu time per response token / per real token of the mini-batch (all DP ranks);\n"
          "x meg: median of per-rep gspo/megatron ratios (train a/b, forward c/d), wall and cpu;\n"
          "peak: VmHWM MB; extra: peak above the RSS before the pass, MB (one pass before the timing, see the\n"
          "module docstring; max over ranks); x logits: extra in units of the largest logits shard")
    head = (f"{'layout':6s} {'pass':17s} {'wall s':>7} {'cpu s':>7} {'us/resp':>8} {'us/tok':>7} "
            f"{'x meg wall':>10} {'x meg cpu':>9} {'peak MB':>8} {'extra MB':>9} {'x logits':>8}  value")
    print(head)
    print("-" * len(head))
    for r in rows:
        wall_ratios, cpu_ratios = paired_ratios(r["times"]), paired_ratios(r["cpu"])
        for i, name in enumerate(PASSES):
            wall, cpu = statistics.median(r["times"][i]), statistics.median(r["cpu"][i])
            ratios = (f"{wall_ratios[i // 2]:10.3f} {cpu_ratios[i // 2]:9.3f}" if i % 2 == 0
                      else f"{'':10s} {'':9s}")
            v = r["values"][i]
            value = "  ".join(f"{k} {v[k]:.4f}" for k in ("loss", "entropy") if k in v)
            print(f"{r['layout']:6s} {name:17s} {wall:7.3f} {cpu:7.3f} {1e6 * cpu / r['response_tokens']:8.1f} "
                  f"{1e6 * cpu / r['tokens']:7.1f} {ratios} {r['peak_mb'][i]:8.1f} {r['extra_mb'][i]:9.1f} "
                  f"{r['extra_mb'][i] / r['logits_mb']:8.2f}  {value}")
    print()
    for r in rows:
        print(f"{r['layout']}: {r['preset']} V={r['vocab']} x{r['nproc']} ranks, {r['microbatches']} micro-batches "
              f"per rank, {r['response_tokens']:.0f} response / {r['tokens']:.0f} real tokens, "
              f"padding_fraction {r['padding_fraction']:.3f}, largest logits shard {r['logits_mb']:.1f} MB")
        for a, b, what in ((0, 1, "train"), (2, 3, "forward")):
            delta = r["extra_mb"][a] - r["extra_mb"][b]
            print(f"    {what}: gspo extra peak - megatron's = {delta:+.1f} MB "
                  f"= {delta / r['logits_mb']:+.2f} x logits")
    print("value: gspo train: -J (s_i = 1: -mean advantage); megatron: masked mean cross entropy (over all\n"
          "padded vocab rows); gspo recompute: -mean log-prob (true vocab) and mean entropy per response token")


if __name__ == "__main__":
    _args = parse_args()
    if _args.worker:
        worker(_args)
    else:
        main(_args)
