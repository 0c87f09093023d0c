"""From a TrainConfig to what train_on_batch needs: the model chunks, Adam + schedule, step settings and
the way pi_old's log-probs are obtained.

Call with the process groups `pgs = parallel.groups.init_megatron(config.parallel)`. Initial weights are the
caller's choice (random from `config.seed`, `convert.load.load_weights(policy.model, ...)`, or
`checkpoint.load_checkpoint` when resuming).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo.config import TrainConfig
from megatron_gspo.convert.hf_config import shape_of
from megatron_gspo.loss.policy import clip_range
from megatron_gspo.model.gpt import Qwen3Shape, build_model, transformer_config
from megatron_gspo.model.routing import MoERouting
from megatron_gspo.parallel.groups import manual_seed
from megatron_gspo.training.forward_step import LossSettings
from megatron_gspo.training.optimizer import build_optimizer
from megatron_gspo.training.old_logprobs import OldLogprobs, StepSettings, old_logprobs_source


@dataclass
class Policy:
    shape: Qwen3Shape
    model: list
    """This rank's DDP-wrapped model chunks."""
    optimizer: object
    scheduler: object
    pgs: ProcessGroupCollection
    """The process groups the model was built on (init_megatron's); pass them to train_on_batch."""
    routing: MoERouting | None = None
    """The MoE model's routers (record/replay, model/routing.py); None for a dense model."""


def model_shape(config: TrainConfig) -> Qwen3Shape:
    return shape_of(config.model.preset, config.model.hf_path)


def build_policy(config: TrainConfig, pgs: ProcessGroupCollection) -> Policy:
    """The model (randomly initialised from config.seed) with its optimizer and lr schedule."""
    shape = model_shape(config)
    dtype = torch.bfloat16 if config.model.dtype == "bfloat16" else torch.float32
    manual_seed(config.seed, pgs)
    model = build_model(shape, transformer_config(shape, config.parallel, params_dtype=dtype,
                                                  aux_loss_coeff=config.model.moe_aux_loss_coeff), pgs=pgs,
                        ddp_overrides={"use_distributed_optimizer": config.parallel.distributed_optimizer})
    optimizer, scheduler = build_optimizer(model, config.optimizer, total_steps=config.optimizer_steps,
                                           params_dtype=dtype, distributed=config.parallel.distributed_optimizer)
    return Policy(shape, model, optimizer, scheduler, pgs, MoERouting.attach(model))


def step_settings(config: TrainConfig, shape: Qwen3Shape) -> StepSettings:
    gspo = config.gspo
    eps_low, eps_high = clip_range(gspo.algorithm, gspo.eps_low, gspo.eps_high)
    return StepSettings(
        loss=LossSettings(algorithm=gspo.algorithm, eps_low=eps_low, eps_high=eps_high,
                          temperature=config.sampling.temperature, vocab_size=shape.vocab_size),
        num_minibatches=gspo.num_minibatches, max_tokens_per_microbatch=config.parallel.max_tokens_per_microbatch,
        pack_sequences=config.parallel.pack_sequences, correction=config.correction)


def old_logprobs(config: TrainConfig, policy: Policy) -> OldLogprobs:
    """How pi_old's log-probs are obtained (gspo.old_logprobs, gspo.recompute, gspo.routing_replay)."""
    return old_logprobs_source(config.gspo, policy.routing)
