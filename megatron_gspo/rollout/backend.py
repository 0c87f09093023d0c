"""The configured rollout backend (rollout.backend), opened once per run.

    backend = open_backend(config, model=policy.model, vocab_size=V, tokenizer=tok, pgs=policy.pgs)

- `SGLangBackend` (rollout/sglang/): SGLang servers (launched here or given by URL) reached over HTTP
  by rank 0 alone; new weights go to them through one weight-sync transport (disk, tensor or broadcast).
- `MegatronBackend` (rollout/megatron/): the trainer's own model generates, collectively on every rank.

Both follow `rollout.protocol.RolloutBackend`; `collective` tells the caller which ranks hold one.
"""
from __future__ import annotations

from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo.config import TrainConfig
from megatron_gspo.model.routing import MoERouting
from megatron_gspo.rollout.megatron.backend import MegatronBackend
from megatron_gspo.rollout.protocol import RolloutBackend
from megatron_gspo.rollout.sglang.backend import SGLangBackend
from megatron_gspo.rollout.sglang.server import SGLangServer


def open_backend(config: TrainConfig, *, model: list, vocab_size: int, tokenizer,
                 pgs: ProcessGroupCollection, routing: MoERouting | None = None,
                 started: list[SGLangServer] | None = None) -> RolloutBackend:
    """The configured backend (rollout.backend). SGLang: call on rank 0 only (`started`: the servers
    start_sglang started); megatron: on every rank. `routing`: the MoE model's routers (the megatron
    backend records them for routing_replay=rollout)."""
    if config.rollout.backend == "megatron":
        return MegatronBackend(config, model=model, vocab_size=vocab_size, tokenizer=tokenizer, pgs=pgs,
                               routing=routing)
    return SGLangBackend(config, started, tokenizer)
