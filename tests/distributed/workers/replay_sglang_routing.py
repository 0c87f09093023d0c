"""The trainer's recompute pass replaying SGLang's routed experts (gspo.routing_replay=rollout), as SGLang sent
them and deliberately misaligned, on one process. Launched by tests/sglang/test_sglang_moe_cpu.py.

usage: torchrun --nproc-per-node 1 replay_sglang_routing.py WORKDIR HF_DIR TEMPERATURE

WORKDIR/samples.pt: SGLang's samples of the model in HF_DIR, sampled at TEMPERATURE, as dicts of prompt_ids,
response_ids, rollout_logprobs and routed_experts ([P + R - 1, L, k], rollout/sglang/routed_experts.py).

The model is built and loaded as `megatron-gspo train` does it (training/setup.py build_policy, then
training/loop.py initial_weights: the HF weights converted into WORKDIR/mcore_init), and pi_old's log-probs
come from the trainer's own strategy for routing_replay=rollout (old_logprobs_source: one recompute pass per
mini-batch that replays each sample's routing and records what the current weights would route instead).
Each variant of the routing arrays is replayed in turn:
- aligned: as SGLang sent them;
- shifted: every array moved one position later (position t replays SGLang's routing of t - 1, position 0 that
  of the last position): what an off-by-one between SGLang's rows and the trainer's positions would replay;
- layers_swapped: layers 0 and 1 exchanged: what a wrong layer numbering would replay.
Writes WORKDIR/results.json: per variant, the recompute's moe/routing_rollout_changed_fraction (response
tokens x layers whose replayed expert set differs from the set the trainer's router picks itself) and the
mean and max |recomputed - SGLang| log-prob over response tokens.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from megatron_gspo.config import GSPOConfig, LoggingConfig, ModelConfig, SamplingConfig, TrainConfig
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.training.loop import initial_weights
from megatron_gspo.training.old_logprobs import pack
from megatron_gspo.training.packing import Response
from megatron_gspo.training.setup import build_policy, old_logprobs, step_settings


def swap_layers_0_1(ids_TLk: np.ndarray) -> np.ndarray:
    order = list(range(ids_TLk.shape[1]))
    order[0], order[1] = 1, 0
    return ids_TLk[:, order]


VARIANTS = {
    "aligned": lambda ids_TLk: ids_TLk,
    "shifted": lambda ids_TLk: np.roll(ids_TLk, 1, axis=0),
    "layers_swapped": swap_layers_0_1,
}


def main() -> None:
    workdir, hf_dir, temperature = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    config = TrainConfig(model=ModelConfig(hf_path=hf_dir, dtype="float32"),
                         gspo=GSPOConfig(routing_replay="rollout", num_minibatches=1),
                         sampling=SamplingConfig(temperature=temperature), logging=LoggingConfig(run_dir=str(workdir)))
    pgs = init_megatron(config.parallel, seed=config.seed)
    policy = build_policy(config, pgs)
    initial_weights(config, policy)
    settings, source = step_settings(config, policy.shape), old_logprobs(config, policy)
    samples = torch.load(workdir / "samples.pt", weights_only=False)

    results = {}
    for name, misalign in VARIANTS.items():
        responses = [Response(s["prompt_ids"], s["response_ids"], 0.0, s["rollout_logprobs"],
                              misalign(s["routed_experts"])) for s in samples]
        packed = pack(responses, pgs, settings.max_tokens_per_microbatch, settings.pack_sequences)
        (old,) = source.prepare(policy.model, [packed], [responses], settings, pgs)
        deltas = torch.cat([(mb.old_logprobs_BS.double() - rollout.double())[mb.loss_mask_BS.bool()].abs()
                            for mb, rollout in zip(packed.micro_batches, packed.rollout_logprobs)])
        results[name] = {"changed_fraction": old.metrics["moe/routing_rollout_changed_fraction"],
                         "gap_mean": deltas.mean().item(), "gap_max": deltas.max().item(),
                         "logged_gap": old.metrics["train/rollout_abs_delta_token"], "tokens": deltas.numel()}
        print(f"{name}: {results[name]}", flush=True)
    (workdir / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
    torch.distributed.destroy_process_group()
