"""Megatron's Adam and learning-rate schedule from an OptimizerConfig."""
from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_gspo.config import OptimizerConfig


def build_optimizer(model: list, config: OptimizerConfig, *, total_steps: int,
                    params_dtype: torch.dtype = torch.float32, distributed: bool = False):
    """(optimizer, scheduler): Megatron's Adam(W) over the model chunks and its lr/wd scheduler.

    `total_steps` counts optimizer steps (rollout steps x mini-batches); the schedule decays over them.
    Call `scheduler.step(1)` after each `optimizer.step()`.

    The optimizer is the one start-up component that still takes Megatron's global process groups:
    megatron-core 0.16.1's get_megatron_optimizer refuses `pg_collection=` together with the gloo groups
    it needs on CPU ("Gloo process groups are not supported when pg_collection is provided",
    megatron/core/optimizer/__init__.py). It reads them once, here; no optimizer step reads them.
    """
    optimizer = get_megatron_optimizer(MegatronOptimizerConfig(
        optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        clip_grad=config.clip_grad, bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
        use_distributed_optimizer=distributed), model)
    fuse_cpu_adam(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if config.warmup_steps else config.lr, max_lr=config.lr,
        min_lr=config.min_lr, lr_warmup_steps=config.warmup_steps,
        lr_decay_steps=max(total_steps, config.warmup_steps + 1), lr_decay_style=config.schedule,
        start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant")
    return optimizer, scheduler


def fuse_cpu_adam(optimizer) -> None:
    """On a CPU-only machine, switch the torch Adam(W) inside a Megatron optimizer to torch's fused CPU
    kernel (a no-op where CUDA is present).

    Without Transformer Engine or apex, Megatron-Core builds `torch.optim.AdamW` with torch's default
    implementation, which on CPU is the single-tensor loop: a dozen Python-dispatched ops per parameter
    tensor. The fused kernel (`torch._fused_adamw_`, one call per group) does the same update; on the
    demo's 2 ranks it takes the optimizer step from ~4.6 ms to ~1 ms per mini-batch. Only CPU runs
    take this path: on GPU Megatron uses TE's or apex's fused Adam already.
    """
    if torch.cuda.is_available():
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            for group in opt.optimizer.param_groups:
                group.update(fused=True, foreach=False)
