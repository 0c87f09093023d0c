"""MoE Routing Replay through the trainer's own step (training/step.py train_on_batch), one layout per launch.

usage: torchrun --nproc-per-node N routing_replay.py WORKDIR NAME [tp=N] [pp=N] [cp=N] [ep=N] [max_tokens=N]
                                                                  [packed=0|1]
(1, 8192 tokens per micro-batch and 0 where absent; dp takes the other ranks: trainer_common.worker_args)

max_tokens: the token budget of a micro-batch (parallel.max_tokens_per_microbatch). packed=1: packed rows
(parallel.pack_sequences: several responses per row), compared with the reference's one response per row.

The tiny Qwen3-MoE, GRPO (the paper's replay baseline), K = 2 mini-batches of 8 responses, SGD (lr 0.1, no
momentum: a large step, so that routing moves and a mis-scaled gradient shows). Two runs from the same
initial weights: routing_replay="old", then "off". A hook at every router (wrapping its RouterReplay's
get_replay_topk) logs what each call returned, so the checks read the routing the router actually used,
not the trainer's own bookkeeping.

NAME "reference" (one process) saves WORKDIR/init and its results; any other NAME loads WORKDIR/init into
its layout, runs the same, and compares with the reference.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_gspo.config import CorrectionConfig, GSPOConfig
from megatron_gspo.loss.advantages import group_advantages
from megatron_gspo.model.gpt import TINY_MOE, build_model, transformer_config
from megatron_gspo.model.routing import MoERouting
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.training.forward_step import LossSettings
from megatron_gspo.training.packing import Response
from megatron_gspo.training.old_logprobs import StepSettings, old_logprobs_source, pack
from megatron_gspo.training.step import split_minibatches, train_on_batch

from checks import check, done, shutdown
from trainer_common import worker_args

N, K, G = 16, 2, 4


def responses() -> list[Response]:
    """16 responses (prompts of 3-8 tokens, responses of 1-20), GRPO-normalised rewards in groups of 4."""
    g = torch.Generator().manual_seed(11)
    rewards = torch.randint(0, 2, (N,), generator=g).float()
    rewards[:2] = torch.tensor([0.0, 1.0])  # the first group has signal
    advantages = group_advantages(rewards, G).advantages_R.tolist()
    out = []
    for i in range(N):
        prompt = torch.randint(1, TINY_MOE.vocab_size, (int(torch.randint(3, 9, (), generator=g)),), generator=g)
        response = torch.randint(1, TINY_MOE.vocab_size, (int(torch.randint(1, 21, (), generator=g)),), generator=g)
        out.append(Response(prompt.tolist(), response.tolist(), advantages[i]))
    return out


class RouterLog:
    """Every call of every router on this rank: (action, the top-k ids the router went on with)."""

    def __init__(self, routing: MoERouting):
        self.calls: dict[int, list[tuple[str, torch.Tensor]]] = defaultdict(list)
        for layer, replay in zip(routing.layer_numbers, [r for rs in routing.replays for r in rs]):
            replay.get_replay_topk = self._wrap(layer, replay, replay.get_replay_topk)

    def _wrap(self, layer, replay, inner):
        def get_replay_topk(*args, **kwargs):
            action = replay.router_replay_action
            probs, ids = inner(*args, **kwargs)
            self.calls[layer].append((action.value if action else "none", ids.detach().clone()))
            return probs, ids
        return get_replay_topk

    def clear(self):
        self.calls.clear()


def reference_weights(module, workdir: Path) -> None:
    """Load WORKDIR/init (the reference's initial weights) into this layout's module."""
    module.load_state_dict(dist_checkpointing.load(module.sharded_state_dict(), str(workdir / "init")))


def tiny_moe(workdir: Path, name: str, layout, pgs):
    """(model, module, SGD lr 0.1): the tiny MoE with the reference's initial weights (NAME "reference" saves
    them to WORKDIR/init first). No load-balancing loss: Megatron averages it per micro-batch, so unequal
    micro-batches (the trainer's split without PP) weight it differently: not the invariance under test."""
    model = build_model(TINY_MOE, transformer_config(TINY_MOE, layout, aux_loss_coeff=0.0), pgs=pgs)
    (module,) = [chunk.module for chunk in model]
    if name == "reference":
        (workdir / "init").mkdir()
        dist_checkpointing.save(module.sharded_state_dict(), str(workdir / "init"))
    dist.barrier()
    reference_weights(module, workdir)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0), model)
    return model, module, optimizer


def main() -> None:
    workdir, name = Path(sys.argv[1]), sys.argv[2]
    layout, options = worker_args(sys.argv[3:], max_tokens=8192, packed=False)
    pgs = init_megatron(layout, seed=1234)
    model, module, optimizer = tiny_moe(workdir, name, layout, pgs)
    routing = MoERouting.attach(model)
    log = RouterLog(routing)
    batch = responses()
    loss = LossSettings(algorithm="grpo", temperature=1.0, vocab_size=TINY_MOE.vocab_size)

    if options.packed:
        with check("responses are packed several to a row"):
            plans = [pack(mini, pgs, options.max_tokens, True) for mini in split_minibatches(batch, K)]
            assert any(mb.num_sequences > mb.tokens_BS.shape[0] for p in plans for mb in p.micro_batches)
    results = {}
    for i, mode in enumerate(("old", "off")):
        if i:  # the next mode starts from the same initial weights
            reference_weights(module, workdir)
        log.clear()
        settings = StepSettings(loss=loss, num_minibatches=K, max_tokens_per_microbatch=options.max_tokens,
                                pack_sequences=options.packed, correction=CorrectionConfig())
        records = train_on_batch(model, optimizer, batch, settings, old_logprobs_source(GSPOConfig(routing_replay=mode), routing),
                                 pgs=pgs)
        check_router_log(log, mode, int(sum(r["train/microbatches"] for r in records)), int(records[0]["train/microbatches"]))
        check_records(records, mode)
        results[mode] = {"records": records}
        after = workdir / f"after_{mode}"
        if name == "reference":
            after.mkdir()
            dist_checkpointing.save(module.sharded_state_dict(), str(after))
        else:
            compare_update(module, workdir, mode)
    with check("the routing change a step causes is measured the same with and without replay"):
        # Mini-batch 1 has no update before it and identical routing: both runs reach the same weights.
        old, off = results["old"]["records"][1], results["off"]["records"][1]
        assert old["moe/routing_changed_fraction"] == off["moe/routing_changed_fraction"], (old, off)
        assert old["loss/value"] != off["loss/value"], "replay changed nothing in mini-batch 2's loss"

    if name == "reference":
        if dist.get_rank() == 0:
            torch.save(results, workdir / "reference.pt")
    else:
        compare_with_reference(workdir, results)
    done()


def check_router_log(log: RouterLog, mode: str, microbatches: int, first: int) -> None:
    """Per router: one recording call per micro-batch of the K mini-batches (the recompute pass: `microbatches`
    in all, `first` of them mini-batch 1's), then one training call per micro-batch, in the same order."""
    with check(f"{mode}: the routers ran once per micro-batch and pass"):
        for layer, calls in log.calls.items():
            assert len(calls) == 2 * microbatches, (layer, len(calls), microbatches)
            assert all(a == RouterReplayAction.RECORD.value for a, _ in calls[:microbatches]), layer
    with check(f"{mode}: every training forward used the recorded routing" if mode == "old" else
               f"{mode}: training forwards routed freely"):
        changed = 0
        for layer, calls in log.calls.items():
            recorded, trained = calls[:microbatches], calls[microbatches:]
            for (_, ids_rec), (action, ids_used) in zip(recorded, trained):
                if mode == "old":
                    assert action == RouterReplayAction.REPLAY_FORWARD.value, (layer, action)
                    assert torch.equal(ids_used, ids_rec), f"layer {layer}: replayed routing differs"
                else:
                    assert action == RouterReplayAction.RECORD.value, (layer, action)
                    changed += int(not torch.equal(ids_used.sort(1).values, ids_rec.sort(1).values))
        if mode == "off":
            # The first mini-batch routes like the recompute pass (same weights); later ones may not.
            for layer, calls in log.calls.items():
                for (_, a), (_, b) in zip(calls[:first], calls[microbatches:][:first]):
                    assert torch.equal(a, b), f"layer {layer}: mini-batch 1 routed unlike pi_old"


def check_records(records: list[dict], mode: str) -> None:
    first, second = records
    with check(f"{mode}: mini-batch 1's ratios are exactly 1, nothing clipped"):
        assert first["loss/ratio_min"] == first["loss/ratio_max"] == 1.0, first
        assert first["loss/clipped_fraction_token"] == 0.0 and first["loss/log_ratio_token_std"] == 0.0, first
    with check(f"{mode}: routing changed fraction 0 on mini-batch 1, > 0 after the update, per layer"):
        assert first["moe/routing_changed_fraction"] == 0.0, first
        assert second["moe/routing_changed_fraction"] > 0.0, second
        layers = [second[f"moe/routing_changed_fraction/layer_{i:02d}"] for i in range(TINY_MOE.num_layers)]
        assert abs(sum(layers) / len(layers) - second["moe/routing_changed_fraction"]) < 1e-12, layers
        assert second["loss/log_ratio_token_std"] > 0 and second["loss/log_ratio_seq_std"] > 0, second


def compare_update(module, workdir: Path, mode: str) -> None:
    """This layout's update (weights after both steps - initial weights) vs the reference's, each loaded
    resharded into this layout: within 1e-4 of the update's largest entry (measured: <= 1e-5)."""
    def load(path):
        module.load_state_dict(dist_checkpointing.load(module.sharded_state_dict(), str(path)))
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    mine = {n: p.detach().clone() for n, p in module.named_parameters()}
    ref, init = load(workdir / f"after_{mode}"), load(workdir / "init")
    with check(f"{mode}: the update equals the TP1 reference's"):
        scale = max((ref[n] - init[n]).abs().max().item() for n in ref)
        worst = max((mine[n] - ref[n]).abs().max().item() for n in ref)
        assert worst <= 1e-4 * scale, (mode, worst, scale)


def compare_with_reference(workdir: Path, results: dict) -> None:
    """Per mini-batch: grad norm within rtol 1e-5 (the master layout test's), the loss (a near-cancelling
    sum of O(1) +-advantage terms) within 1e-7 absolute, the routing changed fraction within 2 (token,
    layer) pairs (near-ties may route differently under other reduction orders; measured: equal)."""
    reference = torch.load(workdir / "reference.pt", weights_only=False)
    for mode in ("old", "off"):
        with check(f"{mode}: loss, grad norm and routing change equal the TP1 reference"):
            for k, (mine, ref) in enumerate(zip(results[mode]["records"], reference[mode]["records"])):
                rtol = 1e-5
                assert abs(mine["train/grad_norm"] - ref["train/grad_norm"]) <= rtol * ref["train/grad_norm"], (mode, k, mine, ref)
                assert abs(mine["loss/value"] - ref["loss/value"]) <= 1e-7, (mode, k, mine, ref)
                pairs = ref["train/response_tokens"] * TINY_MOE.num_layers
                changed = abs(mine["moe/routing_changed_fraction"] - ref["moe/routing_changed_fraction"])
                assert changed * pairs <= 2 + 1e-9, (mode, k, changed * pairs)


if __name__ == "__main__":
    main()
    shutdown()
