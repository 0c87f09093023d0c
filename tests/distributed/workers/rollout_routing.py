"""Rollout Routing Replay (gspo.routing_replay=rollout) with the in-process Megatron sampler, one layout per launch.

usage: torchrun --nproc-per-node N rollout_routing.py WORKDIR NAME [tp=N] [pp=N] [cp=N] [ep=N] [packed=0|1]
(1 and 0 where absent; dp takes the other ranks: trainer_common.worker_args)

packed=1: the trainer packs several responses per row (parallel.pack_sequences); each response's routing
goes to its place in its row.

The tiny Qwen3-MoE samples 4 prompts x 4 with routing recorded (Sample.routed_experts), then trains on
them with GRPO, K = 2 mini-batches, SGD lr 0.1 (routing_replay.py's tiny_moe), routing_replay="rollout". Checks:
- each sample's routing has one [L, k] entry per input position (prompt + response - 1), and
  (reference) equals the routing of a plain forward of the whole sequence, position by position;
- other layouts sample the same tokens and record the same routing as the reference;
- with the sampling weights, the trainer's recomputed routing equals the sampler's
  (moe_routing_rollout_changed_fraction == 0) and its log-probs match the rollout's;
- every router call of the recompute pass and of the training forwards replayed exactly the
  sample's routing (a hook at the router), and after the first update the weights would route
  differently (moe_routing_changed_fraction > 0) while the forward still used the rollout's routing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_gspo.config import CorrectionConfig, GSPOConfig, SamplingConfig
from megatron_gspo.loss.advantages import group_advantages
from megatron_gspo.model.gpt import TINY_MOE
from megatron_gspo.model.routing import MoERouting
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.rollout.megatron.generator import MegatronGenerator
from megatron_gspo.samples import Prompt
from megatron_gspo.training.forward_step import LossSettings
from megatron_gspo.training.packing import responses_from_samples
from megatron_gspo.training.old_logprobs import StepSettings, old_logprobs_source, pack
from megatron_gspo.training.step import split_minibatches, train_on_batch

from checks import check, done, shutdown
from routing_replay import RouterLog, tiny_moe
from trainer_common import worker_args

G, K = 4, 2


def prompts() -> list[Prompt]:
    g = torch.Generator().manual_seed(5)
    # one long prompt: the rows of packed training (as long as the longest response) then hold several short ones
    return [Prompt(group_id=i, prompt_ids=torch.randint(1, TINY_MOE.vocab_size, (n,), generator=g).tolist())
            for i, n in enumerate((3, 4, 5, 24))]


def main() -> None:
    workdir, name = Path(sys.argv[1]), sys.argv[2]
    layout, options = worker_args(sys.argv[3:], packed=False)
    pgs = init_megatron(layout, seed=1234)
    model, _, optimizer = tiny_moe(workdir, name, layout, pgs)
    routing = MoERouting.attach(model)
    generator = MegatronGenerator(model, SamplingConfig(temperature=1.0, max_new_tokens=8),
                                  vocab_size=TINY_MOE.vocab_size, seed=5, pgs=pgs, routing=routing,
                                  max_tokens_per_microbatch=64)
    groups, _ = generator.generate(prompts(), n=G, weight_version="0", record_routing=True)
    samples = [s for group in groups for s in group]

    with check("every sample carries [P + R - 1, L, k] routing ids"):
        for s in samples:
            shape = (len(s.prompt_ids) + len(s.response_ids) - 1, TINY_MOE.num_layers, TINY_MOE.moe_router_topk)
            assert s.routed_experts.shape == shape and s.routed_experts.dtype.name == "uint8", \
                (s.routed_experts.shape, shape, s.routed_experts.dtype)
            assert int(s.routed_experts.max()) < TINY_MOE.num_experts
    plain = [(s.prompt_ids, s.response_ids, s.routed_experts.tolist()) for s in samples]
    if name == "reference":
        with check("the recorded routing is a plain forward's, position by position"):
            check_against_plain_forward(model, routing, samples)
        torch.save(plain, workdir / "samples.pt")
    else:
        with check("the same samples and routing as the reference"):
            reference = torch.load(workdir / "samples.pt", weights_only=False)
            assert [p[:2] for p in plain] == [r[:2] for r in reference], "sampled tokens differ"
            assert [p[2] for p in plain] == [r[2] for r in reference], "recorded routing differs"

    rewards = torch.tensor([float(len(s.response_ids) % 2) for s in samples])
    rewards[0], rewards[1] = 0.0, 1.0
    responses = responses_from_samples(samples, group_advantages(rewards, G).advantages_R)
    log = RouterLog(routing)
    settings = StepSettings(loss=LossSettings(algorithm="grpo", temperature=1.0, vocab_size=TINY_MOE.vocab_size),
                            num_minibatches=K, max_tokens_per_microbatch=64,
                            pack_sequences=options.packed, correction=CorrectionConfig())
    if options.packed:
        with check("responses are packed several to a row"):
            plans = [pack(mini, pgs, 64, True) for mini in split_minibatches(responses, K)]
            assert any(mb.num_sequences > mb.tokens_BS.shape[0] for p in plans for mb in p.micro_batches)
    records = train_on_batch(model, optimizer, responses, settings,
                             old_logprobs_source(GSPOConfig(routing_replay="rollout"), routing), pgs=pgs)
    with check("unchanged weights: the trainer routes like the sampler and its log-probs match"):
        for r in records:
            assert r["moe/routing_rollout_changed_fraction"] == 0.0, r
            assert r["train/rollout_abs_delta_token"] < 1e-5, r
        assert records[0]["loss/ratio_min"] == records[0]["loss/ratio_max"] == 1.0, records[0]
    with check("after the update the weights would route differently"):
        assert records[0]["moe/routing_changed_fraction"] == 0.0, records[0]
        assert records[1]["moe/routing_changed_fraction"] > 0.0, records[1]
    with check("every recompute and training forward replayed the sample's routing"):
        microbatches = int(sum(r["train/microbatches"] for r in records))
        for layer, calls in log.calls.items():
            assert len(calls) == 2 * microbatches, (layer, len(calls))
            assert all(action == RouterReplayAction.REPLAY_FORWARD.value for action, _ in calls), layer
            for (_, recompute), (_, trained) in zip(calls[:microbatches], calls[microbatches:]):
                assert torch.equal(recompute, trained), f"layer {layer}"
    done()


@torch.no_grad()
def check_against_plain_forward(model, routing: MoERouting, samples) -> None:
    """One sequence at a time through the model with its routers recording (one process, TP1)."""
    chunk = model[0]
    for s in samples:
        tokens = torch.tensor([s.prompt_ids + s.response_ids])
        routing_pass = routing.pass_()
        with routing_pass.forward(chunk, torch.zeros_like(tokens, dtype=torch.float)):
            chunk(tokens, torch.arange(tokens.shape[1])[None], None)
        per_layer = routing_pass.recorded[0][0]  # [T, k] per router, T = the sequence's positions
        for router, ids in zip(routing.routers[0], per_layer):
            expected = ids[:-1].sort(1).values  # the last response token is never fed while sampling
            got = torch.as_tensor(s.routed_experts[:, router.layer_number - 1]).long().sort(1).values
            assert torch.equal(got, expected.long()), (router.layer_number, got, expected)


if __name__ == "__main__":
    main()
    shutdown()
