"""Rank 0's view of the SGLang servers: start (or adopt) them, roll out over HTTP, push weights.

    servers = start_sglang(config)          # early: their start-up overlaps Megatron's
    backend = SGLangBackend(config, servers)
    groups, stats = await backend.generate(prompts, on_group=scorer.submit)
    backend.sync_weights(named_tensors, version="7")   # one weight_sync transport: disk, tensor or broadcast

With rollout.partial_rollout a push goes into the requests in flight, which then continue under the new
weights. gspo.routing_replay=rollout makes the servers return each training sample's routed experts (R3).
With rollout.tools or rollout.episode_fn every rollout (training's and evaluation's) is a multi-turn episode
per sample, one request per model turn (rollout/agent/).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Sequence

import torch

from megatron_gspo.config import SamplingConfig, TrainConfig
from megatron_gspo.rollout.agent.chat import ChatTemplate
from megatron_gspo.rollout.agent.episode import EpisodeRunner, load_episode_fn
from megatron_gspo.rollout.agent.tools import ToolBox, tool_episode
from megatron_gspo.rollout.protocol import NamedTensors, OnGroup, RolloutStats
from megatron_gspo.rollout.sglang.client import RolloutClient
from megatron_gspo.rollout.sglang.routed_experts import RoutingSpec
from megatron_gspo.rollout.sglang.server import ServerConfig, SGLangServer, start_servers, stop_all, wait_all_ready
from megatron_gspo.rollout.sglang.weight_sync import WeightSync, open_weight_sync
from megatron_gspo.samples import Prompt, Sample


class SGLangBackend:
    """Rank 0's view of the SGLang servers: start (or adopt) them, roll out, push weights."""

    collective = False

    def __init__(self, config: TrainConfig, started: list[SGLangServer] | None = None, tokenizer=None):
        """`started`: the servers start_sglang(config) started earlier (this waits for them and stops
        them at close); None: start them here. `tokenizer`: model.hf_path's (episodes need it)."""
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
            self._episodes = open_episodes(config, self._client, tokenizer, self._stack) if r.episodes else None
        except BaseException:
            self._stack.close()
            raise
        self._sampling, self._group_size = config.sampling, config.gspo.group_size

    async def generate(self, prompts: Sequence[Prompt], *, n: int | None = None, sampling: SamplingConfig | None = None,
                       on_group: OnGroup | None = None) -> tuple[list[list[Sample]], RolloutStats]:
        if self._episodes is not None:
            return await self._episodes.generate(prompts, n or self._group_size, sampling or self._sampling, on_group)
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



def open_episodes(config: TrainConfig, client: RolloutClient, tokenizer, stack: contextlib.ExitStack) -> EpisodeRunner:
    """The episode runner of rollout.tools / rollout.episode_fn; the tools' worker pool is closed by `stack`."""
    r = config.rollout
    if tokenizer is None:
        raise ValueError("rollout.tools / rollout.episode_fn need the model's tokenizer")
    tools = None
    if r.tools:
        tools = ToolBox(r.tools, workers=r.tool_workers, timeout_s=r.tool_timeout_s)
        stack.callback(tools.close)
    chat = ChatTemplate(tokenizer, tools.schemas if tools else None, config.data.chat_template_kwargs) \
        if getattr(tokenizer, "chat_template", None) else None
    episode, name = (load_episode_fn(r.episode_fn), r.episode_fn) if r.episode_fn else (tool_episode, "tool_episode")
    max_context = r.max_context_tokens or model_context_length(config.model.hf_path) - SGLANG_CONTEXT_RESERVE
    return EpisodeRunner(client, tokenizer, r, episode=episode, name=name, tools=tools, chat=chat,
                         max_context=max_context)


SGLANG_CONTEXT_RESERVE = 6
"""Tokens of a model's context length SGLang keeps from a request: it refuses an input of context_len - 6 tokens or
more (0.5.23 scheduler: max_req_input_len = context_len - 1 - 5, managers/tp_worker.py) and cuts max_new_tokens to
context_len - 2 - input (managers/scheduler.py). An episode's default context limit is context_len minus this."""


def model_context_length(hf_path: str) -> int:
    """The served model's context length: its config's max_position_embeddings (SGLang's default)."""
    with open(Path(hf_path) / "config.json") as f:
        return int(json.load(f)["max_position_embeddings"])


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
