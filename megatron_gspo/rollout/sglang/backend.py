"""Rank 0's view of the SGLang servers: start (or adopt) them, roll out over HTTP, push weights.

    servers = start_sglang(config)          # early: their start-up overlaps Megatron's
    backend = SGLangBackend(config, servers)
    groups, stats = await backend.generate(prompts, on_group=scorer.submit)
    backend.sync_weights(named_tensors, version="7")   # one weight_sync transport: disk, tensor or broadcast

With rollout.partial_rollout a push goes into the requests in flight, which then continue under the new
weights. gspo.routing_replay=rollout makes the servers return each training sample's routed experts (R3).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Sequence

import torch

from megatron_gspo.config import SamplingConfig, TrainConfig
from megatron_gspo.rollout.protocol import NamedTensors, OnGroup, RolloutStats
from megatron_gspo.rollout.sglang.client import RolloutClient
from megatron_gspo.rollout.sglang.routed_experts import RoutingSpec
from megatron_gspo.rollout.sglang.server import ServerConfig, SGLangServer, start_servers, stop_all, wait_all_ready
from megatron_gspo.rollout.sglang.weight_sync import WeightSync, open_weight_sync
from megatron_gspo.samples import Prompt, Sample


class SGLangBackend:
    """Rank 0's view of the SGLang servers: start (or adopt) them, roll out, push weights."""

    collective = False

    def __init__(self, config: TrainConfig, started: list[SGLangServer] | None = None):
        """`started`: the servers start_sglang(config) started earlier (this waits for them and stops
        them at close); None: start them here."""
        r = config.rollout
        # R3 (gspo.routing_replay=rollout): the servers return each training sample's routed experts.
        routing = RoutingSpec.from_hf_config(config.model.hf_path) if config.gspo.routing_replay == "rollout" else None
        self._stack = contextlib.ExitStack()
        try:
            if r.server_urls:
                self.urls = list(r.server_urls)
            else:
                servers = started if started is not None else start_sglang(config)
                self._stack.callback(stop_all, servers)
                wait_all_ready(servers)
                self.urls = [s.url for s in servers]
                print(f"SGLang ready at {self.urls} after {max(s.ready_after_s for s in servers):.0f} s", flush=True)
            self._eval_client = RolloutClient(self.urls, r)
            self._client = (RolloutClient(self.urls, r, routed_experts=routing) if routing is not None
                            else self._eval_client)
            self._weights: WeightSync = open_weight_sync(r.weight_sync, self.urls,
                                                         folder=Path(config.logging.run_dir) / "weights",
                                                         config_dir=config.model.hf_path, api_key=r.api_key,
                                                         pause_generation=r.partial_rollout)
            self._stack.callback(self._weights.close)
        except BaseException:
            self._stack.close()
            raise
        self._sampling, self._group_size = config.sampling, config.gspo.group_size

    async def generate(self, prompts: Sequence[Prompt], *, n: int | None = None, sampling: SamplingConfig | None = None,
                       on_group: OnGroup | None = None) -> tuple[list[list[Sample]], RolloutStats]:
        client = self._client if sampling is None else self._eval_client  # eval never needs the routing
        return await client.generate(prompts, n=n or self._group_size, sampling=sampling or self._sampling,
                                     on_group=on_group)

    def sync_weights(self, named_tensors: NamedTensors, version: str) -> None:
        self._weights.push(named_tensors, version)

    def close(self) -> None:
        self._stack.close()

    async def keep_connections(self) -> None:
        for client in {id(c): c for c in (self._client, self._eval_client)}.values():
            await client.keep_connections()

    async def close_connections(self) -> None:
        for client in {id(c): c for c in (self._client, self._eval_client)}.values():
            await client.close_connections()



def start_sglang(config: TrainConfig) -> list[SGLangServer]:
    """Start the rollout.num_servers SGLang servers of rollout.backend=sglang without waiting for them:
    the driver calls this first, so that their start-up overlaps Megatron's (SGLangBackend waits)."""
    r = config.rollout
    print(f"starting {r.num_servers} SGLang server(s) on {config.model.hf_path} ...", flush=True)
    return start_servers(server_config(config), r.num_servers)


def server_config(config: TrainConfig) -> ServerConfig:
    """How a run launches its servers: the rollout settings, this machine's device, rollout.server_dtype (else
    model.dtype), weight version 0, the routed experts R3 needs, logs under logging.run_dir."""
    r = config.rollout
    return ServerConfig(model_path=config.model.hf_path, settings=r, device="cuda" if torch.cuda.is_available() else "cpu",
                        dtype=r.server_dtype or config.model.dtype, weight_version="0",
                        return_routed_experts=config.gspo.routing_replay == "rollout",
                        log_dir=str(Path(config.logging.run_dir) / "sglang_logs"))
