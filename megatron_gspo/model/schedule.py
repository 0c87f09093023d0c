"""Running Megatron-Core's forward(/backward) schedule over this rank's model chunks.

The one place both the trainer (training/step.py) and the in-process sampler (rollout/megatron/generator.py)
enter `get_forward_backward_func`: with the process groups passed explicitly (`pg_collection=`, and a
P2PCommunicator on the pipeline group), never looked up from Megatron's globals.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config


class MicroBatches(Protocol):
    """Equal-shaped micro-batches, as training.packing.PackedMiniBatch holds them."""

    micro_batches: Sequence
    num_microbatches: int
    seq_length: int
    micro_batch_size: int


def run_schedule(model: list, batches: MicroBatches, forward_step, *, pgs: ProcessGroupCollection,
                 forward_only: bool):
    """Megatron's pipeline schedule for `model` over `batches`, on the groups of `pgs` (the schedule
    hands them on to config.finalize_model_grads_func as well); returns the last stage's loss logs."""
    config = get_model_config(model[0])
    schedule = get_forward_backward_func(pp_size=pgs.pp.size(), vp_size=config.virtual_pipeline_model_parallel_size)
    data = [iter(batches.micro_batches) for _ in model] if len(model) > 1 else iter(batches.micro_batches)
    return schedule(
        forward_step_func=forward_step, data_iterator=data, model=model,
        num_microbatches=batches.num_microbatches, seq_length=batches.seq_length,
        micro_batch_size=batches.micro_batch_size, forward_only=forward_only,
        p2p_communicator=P2PCommunicator(pp_group=pgs.pp, config=config), pg_collection=pgs)
