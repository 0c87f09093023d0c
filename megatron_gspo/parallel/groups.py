"""Bring up torch.distributed and Megatron-Core's model-parallel groups, on GPUs or on CPU (gloo).

`init_megatron` is the one place that reads Megatron's global `parallel_state`: it returns the
process groups as Megatron-Core's own `ProcessGroupCollection` (`pgs`), which everything else takes
as an argument (our code, and GPTModel / DDP / the schedules through their `pg_collection=`).
Process groups only: G-sample groups (rollout) are another thing and never called `pgs`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class Layout:
    """A parallel layout. The data-parallel size is what is left of the world."""

    tp: int = 1
    """Tensor parallel size (vocabulary and hidden sharding)."""
    pp: int = 1
    """Pipeline parallel size."""
    cp: int = 1
    """Context parallel size (sequence sharding, load-balanced 2*cp chunks)."""
    ep: int = 1
    """Expert parallel size (MoE experts spread over ranks)."""
    etp: int | None = None
    """Expert tensor parallel size. None: tp when ep == 1 (experts sharded like the dense MLP;
    with ep == 1 Megatron treats expert weights as dense parameters, reduced over DP only, so
    experts replicated over TP ranks would miss the TP reduction), else 1 (gloo cannot do the
    uneven all-gathers that ep > 1 with etp > 1 needs: tensor_parallel/mappings.py:150)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved schedule), or None."""

    def dp(self, world_size: int) -> int:
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {model_parallel}")
        return world_size // model_parallel

    @property
    def expert_tp(self) -> int:
        if self.etp is not None:
            return self.etp
        return self.tp if self.ep == 1 else 1

    def __str__(self) -> str:
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        return "x".join(parts) or "single"


def init_megatron(layout: Layout, *, seed: int = 1234) -> ProcessGroupCollection:
    """Initialise torch.distributed (from torchrun's env) and Megatron's parallel state for `layout`;
    return this rank's process groups (a megatron.core ProcessGroupCollection, every field set).

    On machines without CUDA this uses gloo and applies the CPU platform patches first.
    """
    # Imported here, not at the top: config.py imports Layout from this module and stays light.
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_gspo.platform import apply_cpu_patches, cpu_patches_needed

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
    layout.dp(world)  # validates divisibility with a clear error
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
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=pgs.tp.rank(), ep_rank=pgs.ep.rank(),
                                                    etp_rank=pgs.expt_tp.rank())
    torch.manual_seed(seed)


def sequence_pad_multiple(pgs: ProcessGroupCollection) -> int:
    """What every packed sequence length must be a multiple of: CP splits a sequence into 2*cp
    load-balanced chunks, and sequence parallelism (MoE with TP) splits each over the TP ranks."""
    return 2 * pgs.cp.size() * pgs.tp.size()
