"""Loading a converted (or Megatron-LM) torch_dist checkpoint's weights into this rank's model chunks."""
from __future__ import annotations

from pathlib import Path

from megatron_gspo.convert.mcore_to_hf import checkpoint_directory


def load_weights(model_chunks, mcore: str | Path) -> None:
    """Collective: load the model weights of checkpoint `mcore` (a checkpoint directory, or a root
    with latest_checkpointed_iteration.txt) into `model_chunks`, resharded to the current layout.

    Megatron-LM's convention: the model's sharded state dict sits under "model" ("model0",
    "model1", ... with virtual pipeline stages), next to common state such as "iteration", which
    this ignores. The sharded keys themselves do not depend on that nesting.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel

    modules = [chunk.module if isinstance(chunk, DistributedDataParallel) else chunk for chunk in model_chunks]
    names = ["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))]
    request = {name: module.sharded_state_dict() for name, module in zip(names, modules)}
    state = dist_checkpointing.load(request, str(checkpoint_directory(mcore)))
    for name, module in zip(names, modules):
        module.load_state_dict(state[name])
