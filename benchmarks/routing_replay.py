"""Benchmark: what MoE Routing Replay costs in the trainer's step, side by side in one run.

    python benchmarks/routing_replay.py               # EP2 on 2 processes, 8-layer tiny MoE, 5 reps
    python benchmarks/routing_replay.py --nproc 1 --reps 3
    python benchmarks/routing_replay.py --quick       # smoke size

The same model and the same rollout batch go through training/step.py `train_on_batch` (old-log-prob
recompute + K=4 optimizer steps, GRPO) with gspo.routing_replay="off" and "old", interleaved
(off, old, old, off, ...) so that the noise of a shared machine hits both; the weights are reloaded
before every call so both modes train on identical weights. Reported per mode, max over ranks:
median seconds per call, the peak resident memory the call adds (VmHWM reset through
/proc/self/clear_refs just before it), and the recorded routing: bytes held per router input position
(formula: L_local * k * itemsize, uint8 ids for <= 256 experts) and per response token of the batch
(measured: the recorded tensors' bytes over the response tokens, prompts and padding included).
"off" still records pi_old's routing (the routing-changed metric needs it), so off vs old isolates the
replay itself; the cost of recording is measured too, against a run with no MoERouting attached ("none").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.rss import mem_kb, reset_peak_rss  # noqa: E402  (needs the path above)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_gspo.config import CorrectionConfig, GSPOConfig, ParallelConfig
    from megatron_gspo.loss.advantages import group_advantages
    from megatron_gspo.model.gpt import TINY_MOE, build_model, transformer_config
    from megatron_gspo.model.routing import MoERouting
    from megatron_gspo.parallel.groups import init_megatron
    from megatron_gspo.training.forward_step import LossSettings
    from megatron_gspo.training.packing import Response
    from megatron_gspo.training.old_logprobs import StepSettings, old_logprobs_source
    from megatron_gspo.training.step import train_on_batch

    world = int(os.environ["WORLD_SIZE"])
    shape = dataclasses.replace(TINY_MOE, num_layers=args.layers, num_experts=args.experts)
    layout = ParallelConfig(dp=world, ep=world)
    pgs = init_megatron(layout, seed=1)
    model = build_model(shape, transformer_config(shape, layout), pgs=pgs)
    initial = [p.detach().clone() for chunk in model for p in chunk.parameters()]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0), model)
    routing = MoERouting.attach(model)

    g = torch.Generator().manual_seed(3)
    n = args.responses
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    advantages = group_advantages(rewards, 8).advantages_R.tolist()
    batch = [Response(torch.randint(1, shape.vocab_size, (int(torch.randint(10, 30, (), generator=g)),),
                                    generator=g).tolist(),
                      torch.randint(1, shape.vocab_size, (int(torch.randint(args.min_len, args.max_len, (), generator=g)),),
                                    generator=g).tolist(), advantages[i]) for i in range(n)]
    response_tokens = sum(len(r.response_ids) for r in batch)
    loss = LossSettings(algorithm="grpo", temperature=1.0, vocab_size=shape.vocab_size)

    # Measure the recorded routing's bytes: wrap RoutingPass creation to keep the recompute passes.
    passes = []
    original_pass = routing.pass_

    def keeping_pass(**kw):
        p = original_pass(**kw)
        passes.append(p)
        return p

    routing.pass_ = keeping_pass

    order = ["none", "off", "old"]
    times = {m: [] for m in order}
    extra_kb = {m: [] for m in order}
    recorded_bytes = 0
    for rep in range(args.reps + 1):
        for mode in (order if rep % 2 == 0 else order[::-1]):
            with torch.no_grad():
                for param, value in zip((p for chunk in model for p in chunk.parameters()), initial):
                    param.copy_(value)
            settings = StepSettings(loss=loss, num_minibatches=4, max_tokens_per_microbatch=args.max_tokens,
                                    pack_sequences=False, correction=CorrectionConfig())
            source = old_logprobs_source(GSPOConfig(routing_replay="off" if mode == "none" else mode),
                                         None if mode == "none" else routing)
            passes.clear()
            dist.barrier()
            reset_peak_rss()
            base = mem_kb("VmRSS")
            start = time.perf_counter()
            train_on_batch(model, optimizer, batch, settings, source, pgs=pgs)
            elapsed = time.perf_counter() - start
            peak = mem_kb("VmHWM") - base
            if mode == "old":
                # the recompute passes' recordings: what is held from the recompute to the step's end
                recorded_bytes = sum(t.nbytes for p in passes[:4] for mb in p.recorded for chunk in mb
                                     for t in chunk)
            if rep > 0:
                times[mode].append(elapsed)
                extra_kb[mode].append(peak)
    local_layers = len(routing.layer_numbers)
    itemsize = torch.tensor([], dtype=routing.dtype).element_size()
    result = {m: {"s": statistics.median(times[m]), "extra_mb": max(extra_kb[m]) / 1024} for m in order}
    result["bytes"] = recorded_bytes
    result["per_position_formula"] = local_layers * routing.topk * itemsize
    result["response_tokens"] = response_tokens
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps({"ranks": gathered, "layers": args.layers, "experts": args.experts,
                                                 "topk": shape.moe_router_topk, "responses": n}))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--responses", type=int, default=64)
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 layers, 16 responses, 1 rep")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.layers, args.responses, args.reps, args.max_len = 2, 16, 1, 30
    if args.worker:
        worker(args)
        return 0
    from devtools.torchrun import torchrun

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("reps", "layers", "experts", "responses", "min_len", "max_len", "max_tokens")]
        torchrun(Path(__file__), args.nproc, "--worker", f"--result={result}", *flags, timeout=3600)
        data = json.loads(result.read_text())
    ranks = data["ranks"]
    worst = {m: {"s": max(r[m]["s"] for r in ranks), "extra_mb": max(r[m]["extra_mb"] for r in ranks)}
             for m in ("none", "off", "old")}
    tokens = ranks[0]["response_tokens"]
    total_bytes = sum(r["bytes"] for r in ranks)
    print(f"tiny Qwen3-MoE: {data['layers']} layers, {data['experts']} experts, top-{data['topk']}; "
          f"{args.nproc} process(es), EP{args.nproc}; {data['responses']} responses ({tokens} response tokens), "
          f"K=4, GRPO; median of {args.reps} reps (interleaved), max over ranks")
    print(f"{'mode':<6} {'s / train_on_batch':>18} {'ratio vs off':>13} {'extra peak MB':>14}")
    for m in ("none", "off", "old"):
        print(f"{m:<6} {worst[m]['s']:>18.3f} {worst[m]['s'] / worst['off']['s']:>13.3f} {worst[m]['extra_mb']:>14.1f}")
    print(f"routing replay (old vs off): {worst['old']['s'] / worst['off']['s']:.3f}x time; "
          f"recording pi_old's routing (off vs none): {worst['off']['s'] / worst['none']['s']:.3f}x")
    print(f"recorded routing: {ranks[0]['per_position_formula']} B per router input position and rank "
          f"(L_local * k * itemsize); {total_bytes} B over all ranks = {total_bytes / tokens:.1f} B per response "
          f"token (prompts and padding included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
