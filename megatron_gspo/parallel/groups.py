"""Bring up torch.distributed and Megatron-Core's model-parallel groups, on GPUs or on CPU (gloo).

`init_megatron` is the one place that reads Megatron's global `parallel_state`: it returns the
process groups as Megatron-Core's own `ProcessGroupCollection` (`pgs`), which everything else takes
as an argument (our code, and GPTModel / DDP / the schedules through their `pg_collection=`).
Process groups only: G-sample groups (rollout) are another thing and never called `pgs`.
"""
from __future__ import annotations

import os

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo.config import ParallelConfig
from megatron_gspo.platform.cpu import apply_cpu_patches, cpu_patches_needed


def init_megatron(layout: ParallelConfig, *, seed: int = 1234) -> ProcessGroupCollection:
    """Initialise torch.distributed (from torchrun's env) and Megatron's parallel state for `layout`
    (config.parallel: its tp * pp * cp * dp must be the world size); return this rank's process groups
    (a megatron.core ProcessGroupCollection, every field set).

    On machines without CUDA this uses gloo and applies the CPU platform patches first.
    """
    on_cpu = cpu_patches_needed()
    if on_cpu:
        apply_cpu_patches()
    if not torch.distributed.is_initialized():
        if on_cpu:
            torch.distributed.init_process_group("gloo")
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            torch.distributed.init_process_group("nccl")
    world = torch.distributed.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"{world} processes, but parallel layout {layout} needs tp * pp * cp * dp = "
                         f"{layout.world_size} (set parallel.dp = {world} / (tp * pp * cp))")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    manual_seed(seed, pgs)
    return pgs


def manual_seed(seed: int, pgs: ProcessGroupCollection) -> None:
    """Seed torch and Megatron's tensor-parallel RNG tracker (per TP / EP / expert-TP rank)."""
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=pgs.tp.rank(), ep_rank=pgs.ep.rank(),
                                                    etp_rank=pgs.expt_tp.rank())
    torch.manual_seed(seed)


def sequence_pad_multiple(pgs: ProcessGroupCollection) -> int:
    """What every packed sequence length must be a multiple of: CP splits a sequence into 2*cp
    load-balanced chunks, and sequence parallelism (MoE with TP) splits each over the TP ranks."""
    return 2 * pgs.cp.size() * pgs.tp.size()
