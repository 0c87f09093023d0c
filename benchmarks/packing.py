"""Benchmark: packed rows (parallel.pack_sequences) vs one response per row, same model, same mini-batch.

The mini-batch is benchmarks/train_overhead.py's: N responses in groups of G, prompts of 20-60 tokens,
lognormal response lengths (median --median-len, log-std --sigma, capped at --max-len). It is packed
twice by training/packing.py, exactly as the trainer packs it (training/step.py:_pack): one response per
row, and several per row (first-fit-decreasing up to the longest response, a block-diagonal causal
mask, each response at its own rotary positions). Two passes of each, in the same processes on the same
weights (lr 0, so every rep sees the same weights and both sides the same loss):
  train      training/step.py:_optimizer_step: GSPO forward/backward + Megatron's optimizer step
  recompute  training/old_logprobs.py:recompute_old_logprobs: forward-only log-probs + entropy
Reps alternate the order (unpacked first on even reps, packed first on odd ones); rep 0 is a warm-up.
Time: wall between two barriers (the slowest rank) and CPU time of the busiest rank; medians over reps,
ratios are medians of per-rep packed/unpacked ratios. The values (loss -J, the recompute's mean
log-prob) must agree: packing changes where a response sits, not what it computes.

    python benchmarks/packing.py                         # tp1, tp2; 64 responses, 4 reps (~3 min)
    python benchmarks/packing.py --layouts tp1 --sigma 1.2 --reps 3
    python benchmarks/packing.py --quick                 # smoke run

Layouts as in benchmarks/train_overhead.py (tp1: 1 process; tp2: 2 processes at TP2; ep2: tiny MoE,
experts over 2 ranks). 1 thread per rank, gloo, CPU.

Measured 2026-12-06 on this 2-core machine (defaults, --layouts tp1,tp2,ep2; CPU-time ratios, wall in
brackets; the recomputed mean log-prob agrees to 6 decimals on every layout):

    layout  padding         rows      train          recompute
    tp1     0.146 -> 0.035  64 -> 21  0.964 (0.963)  0.832 (0.830)
    tp2     0.149 -> 0.036  64 -> 21  0.984 (0.967)  0.895 (0.895)
    ep2     0.246 -> 0.080  64 -> 22  0.837 (0.855)  0.682 (0.778)

A rerun after the packed attention's contexts went back in one scatter (--layouts tp1,ep2): tp1 0.912 (0.913)
and 0.878 (0.878), ep2 0.766 (0.833) and 0.739 (0.821). After the dense and packed paths came to share one
attention routine: tp1 0.954 (0.952) and 0.890 (0.891), ep2 0.746 (0.803) and 0.715 (0.775).

With the attention fed a dense [S, S] block-diagonal mask per row instead (the first version), packed
was 1.52x (tp1), 1.24x (tp2) and 1.32x (ep2) the CPU time of unpacked in training: rows filled to the
longest response make the S x S work grow faster than the padding shrinks.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# noqa: E402 below: these need the path above
from benchmarks.train_overhead import (LAYOUTS, describe, long_tailed_responses, model_shape,  # noqa: E402
                                       padding_fraction, parse_args, run_layout)
from megatron_gspo.config import OptimizerConfig  # noqa: E402
from megatron_gspo.model.gpt import build_model, transformer_config  # noqa: E402
from megatron_gspo.parallel.groups import init_megatron, manual_seed  # noqa: E402
from megatron_gspo.training.forward_step import LossSettings  # noqa: E402
from megatron_gspo.training.optimizer import build_optimizer  # noqa: E402
from megatron_gspo.training.old_logprobs import OldPolicy, pack, recompute_old_logprobs  # noqa: E402
from megatron_gspo.training.step import _optimizer_step  # noqa: E402

SHORT = {"loss/value": "loss", "train/entropy": "entropy"}
"""The record keys shown, by their short names."""

SIDES = ("unpacked", "packed")
PASSES = ("train", "recompute")


def worker(args):
    layout = LAYOUTS[args.worker]
    pgs = init_megatron(layout.parallel(), seed=args.seed)
    shape = model_shape(layout, args.vocab)
    manual_seed(args.seed, pgs)
    model = build_model(shape, transformer_config(shape, layout.parallel()), pgs=pgs)
    optimizer, _ = build_optimizer(model, OptimizerConfig(lr=1e-6), total_steps=1)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    loss = LossSettings(algorithm="gspo", temperature=1.0, vocab_size=shape.vocab_size)
    responses = long_tailed_responses(args, shape.vocab_size)
    minis = {side: pack(responses, pgs, args.max_tokens, pack_sequences=side == "packed") for side in SIDES}
    runs = {(side, "train"): (lambda m=minis[side]: _optimizer_step(model, optimizer, m, loss, pgs, OldPolicy()))
            for side in SIDES}
    runs.update({(side, "recompute"): (lambda m=minis[side]: recompute_old_logprobs(model, m, loss, pgs))
                 for side in SIDES})
    for side in SIDES:  # old log-probs for the train pass, and a warm-up of everything
        recompute_old_logprobs(model, minis[side], loss, pgs)
    for run in runs.values():
        run()
    times = {key: [] for key in runs}
    cpu = {key: [] for key in runs}
    values = {}
    for rep in range(args.reps + 1):
        order = SIDES if rep % 2 == 0 else SIDES[::-1]
        for what in PASSES:
            for side in order:
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                record = runs[(side, what)]()
                dist.barrier()
                if rep > 0:
                    times[(side, what)].append(time.perf_counter() - start)
                    cpu[(side, what)].append(time.process_time() - start_cpu)
                values[f"{side} {what}"] = {short: float(record[k]) for k, short in SHORT.items() if k in record}
    logprob_sums = torch.tensor([[sum(float(mb.old_logprobs_BS.double().sum()) for mb in minis[s].micro_batches),
                                  sum(float(mb.loss_mask_BS.sum()) for mb in minis[s].micro_batches),
                                  padding_fraction(minis[s], responses), minis[s].num_microbatches,
                                  sum(mb.tokens_BS.shape[0] for mb in minis[s].micro_batches)]
                                 for s in SIDES], dtype=torch.float64)
    dist.all_reduce(logprob_sums, group=pgs.dp)
    cpu_max = torch.tensor([cpu[k] for k in runs], dtype=torch.float64)
    dist.all_reduce(cpu_max, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({
            "layout": args.worker, "keys": [" ".join(k) for k in runs], "times": [times[k] for k in runs],
            "cpu": cpu_max.tolist(), "values": values,
            "sides": {s: {"mean_logprob": row[0] / row[1], "padding_fraction": row[2] / pgs.dp.size(),
                          "microbatches": row[3] / pgs.dp.size(), "rows": row[4]}
                      for s, row in zip(SIDES, logprob_sums.tolist())}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: gloo occasionally aborts there (see benchmarks/logprobs.py)


def main(args):
    print(describe(args), flush=True)
    print()
    head = (f"{'layout':6s} {'pass':10s} {'padding':>15s} {'micro-batches':>14s} {'rows':>10s} "
            f"{'wall s':>15s} {'cpu s':>15s} {'x wall':>7s} {'x cpu':>6s}  value (unpacked / packed)")
    print(head)
    print("-" * len(head))
    for name in args.layouts:
        r = run_layout(__file__, name, args)
        series = dict(zip(r["keys"], zip(r["times"], r["cpu"])))
        u, p = r["sides"]["unpacked"], r["sides"]["packed"]
        for what in PASSES:
            (tu, cu), (tp, cp) = series[f"unpacked {what}"], series[f"packed {what}"]
            x_wall = statistics.median(b / a for a, b in zip(tu, tp))
            x_cpu = statistics.median(b / a for a, b in zip(cu, cp))
            vu, vp = r["values"][f"unpacked {what}"], r["values"][f"packed {what}"]
            if what == "recompute":
                value = f"mean log-prob {u['mean_logprob']:.6f} / {p['mean_logprob']:.6f}"
            else:
                value = f"-J {vu.get('loss', float('nan')):.6f} / {vp.get('loss', float('nan')):.6f}"
            print(f"{name:6s} {what:10s} {u['padding_fraction']:6.3f} -> {p['padding_fraction']:5.3f} "
                  f"{u['microbatches']:5.1f} -> {p['microbatches']:4.1f} {u['rows']:4.0f} -> {p['rows']:3.0f} "
                  f"{statistics.median(tu):6.3f} {statistics.median(tp):7.3f} "
                  f"{statistics.median(cu):6.3f} {statistics.median(cp):7.3f} {x_wall:7.3f} {x_cpu:6.3f}  {value}",
                  flush=True)
    print("\npadding / micro-batches: per DP rank (mean); rows: all ranks; wall, cpu: unpacked then packed; "
          "x: packed / unpacked")


if __name__ == "__main__":
    _args = parse_args()
    if _args.worker:
        worker(_args)
    else:
        main(_args)
