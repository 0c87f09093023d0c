"""Loading a converted (or Megatron-LM) torch_dist checkpoint's weights into this rank's model chunks."""
from __future__ import annotations

from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.distributed import DistributedDataParallel

from megatron_gspo.convert.mcore_to_hf import checkpoint_directory


def named_model_chunks(model_chunks) -> list[tuple[str, object]]:
    """[(state-dict key, unwrapped module)]: Megatron-LM's "model", or "model0", "model1", ... with
    virtual pipeline stages; DDP wrappers are taken off."""
    modules = [chunk.module if isinstance(chunk, DistributedDataParallel) else chunk for chunk in model_chunks]
    if len(modules) == 1:
        return [("model", modules[0])]
    return [(f"model{i}", module) for i, module in enumerate(modules)]


def load_weights(model_chunks, mcore: str | Path) -> None:
    """Collective: load the model weights of checkpoint `mcore` (a checkpoint directory, or a root
    with latest_checkpointed_iteration.txt) into `model_chunks`, resharded to the current layout.

    Megatron-LM's convention (`named_model_chunks`): the model's sharded state dict sits under
    "model" ("model0", "model1", ... with virtual pipeline stages), next to common state such as
    "iteration", which this ignores. The sharded keys themselves do not depend on that nesting.
    """
    named = named_model_chunks(model_chunks)
    request = {name: module.sharded_state_dict() for name, module in named}
    state = dist_checkpointing.load(request, str(checkpoint_directory(mcore)))
    for name, module in named:
        module.load_state_dict(state[name])
