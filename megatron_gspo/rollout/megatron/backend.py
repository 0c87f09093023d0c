"""Every rank generates with the model it trains (no servers, no weight transfer).

    backend = MegatronBackend(config, model=policy.model, vocab_size=V, tokenizer=tok, pgs=pgs)
    groups, stats = await backend.generate(prompts)    # collective: every rank, the same prompts

The model that trains is the model that samples, so a weight sync only moves the version.
"""
from __future__ import annotations

from typing import Sequence

from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo.config import SamplingConfig, TrainConfig
from megatron_gspo.model.routing import MoERouting
from megatron_gspo.rollout.megatron.generator import MegatronGenerator, stop_token_ids
from megatron_gspo.rollout.protocol import NamedTensors, OnGroup, RolloutStats
from megatron_gspo.samples import Prompt, Sample


class MegatronBackend:
    """Every rank generates with the model it trains (no servers, no weight transfer)."""

    collective = True

    def __init__(self, config: TrainConfig, *, model: list, vocab_size: int, tokenizer, pgs: ProcessGroupCollection,
                 routing: MoERouting | None = None):
        self.version = "0"
        """The weights that sample next: the rollout step after which they were synced."""
        self._generator = MegatronGenerator(
            model, config.sampling, vocab_size=vocab_size, seed=config.seed,
            stop_token_ids=stop_token_ids(config.model.hf_path, tokenizer),
            max_tokens_per_microbatch=config.parallel.max_tokens_per_microbatch,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), pgs=pgs, routing=routing)
        self._group_size = config.gspo.group_size
        self._record_routing = config.gspo.routing_replay == "rollout"
        """Training samples carry their routing (R3); eval samples never need it."""

    async def generate(self, prompts: Sequence[Prompt], *, n: int | None = None, sampling: SamplingConfig | None = None,
                       on_group: OnGroup | None = None) -> tuple[list[list[Sample]], RolloutStats]:
        # collective: every rank calls it with the same prompts; the groups all finish together
        groups, stats = self._generator.generate(prompts, n=n or self._group_size, weight_version=self.version,
                                                 sampling=sampling, noise_tag="" if sampling is None else "eval:",
                                                 record_routing=self._record_routing and sampling is None)
        for group in groups if on_group is not None else ():
            on_group(group)
        return groups, stats

    def sync_weights(self, named_tensors: NamedTensors, version: str) -> None:
        self.version = version  # the model that trains is the model that samples: nothing to move

    async def keep_connections(self) -> None:  # no connections
        pass

    async def close_connections(self) -> None:
        pass

    def close(self) -> None:
        pass

