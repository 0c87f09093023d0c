"""Rollout backends: where the G samples per prompt come from, behind one small interface.

    backend = open_backend(config, model=policy.model, vocab_size=V, tokenizer=tok, pgs=policy.pgs)
    groups, stats = await backend.generate(prompts)    # one list of G Samples per prompt, in order
    groups, stats = await backend.generate(prompts, n=k, sampling=eval_sampling, on_group=scorer.submit)
    backend.sync_weights(named_tensors, version="7")   # the weights that sample next
    backend.close()

- `SGLangBackend`: SGLang servers (launched here or given by URL) reached over HTTP by rank 0 alone;
  new weights go to them through one `sync.sglang.WeightSync` transport (disk, tensor or broadcast),
  into the requests in flight with rollout.partial_rollout (which then continue under them).
- `MegatronBackend`: the trainer's own model generates (rollout/megatron_backend.py), collectively on
  every rank; the model that trains is the model that samples, so a sync only moves the version.

`collective` tells the caller which ranks hold a backend: every rank (True) or rank 0 only (False).
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_gspo.config import SamplingConfig, TrainConfig
from megatron_gspo.model.routing import MoERouting
from megatron_gspo.rollout.client import ClientConfig, RolloutClient, RolloutStats
from megatron_gspo.rollout.megatron_backend import MegatronGenerator, stop_token_ids
from megatron_gspo.rollout.routed_experts import RoutingSpec
from megatron_gspo.rollout.server import ServerConfig, SGLangServer, start_servers, stop_all, wait_all_ready
from megatron_gspo.sync.sglang import NamedTensors, WeightSync, open_weight_sync
from megatron_gspo.samples import Prompt, Sample


OnGroup = Callable[[list[Sample]], None]
"""Called with each group of samples as it finishes (the reward scorer starts on it)."""


class RolloutBackend(Protocol):
    collective: bool
    """True: every trainer rank holds the backend and calls it together; False: rank 0 only."""

    async def generate(self, prompts: Sequence[Prompt], *, n: int | None = None, sampling: SamplingConfig | None = None,
                       on_group: OnGroup | None = None) -> tuple[list[list[Sample]], RolloutStats]:
        """n samples for each prompt (default G = gspo.group_size) with `sampling` (default the run's
        sampling settings), each with its log-probs and weight version. `on_group(samples)` is called with
        each finished group (at once, or when all are done if the backend cannot tell earlier)."""

    def sync_weights(self, named_tensors: NamedTensors, version: str) -> None:
        """Make (HF name, full tensor) pairs the weights that sample next, as `version`. A backend that
        needs no tensors leaves the iterable unread."""

    def close(self) -> None:
        """Stop what the backend started (servers, weight-update groups)."""

    async def keep_connections(self) -> None:
        """This event loop will live across calls: keep connections to the sampler open between them."""

    async def close_connections(self) -> None:
        """Close what `keep_connections` kept open in this event loop."""


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
            client = ClientConfig(concurrency_per_server=r.concurrency, request_timeout_s=r.request_timeout_s,
                                  parallel_sampling=r.parallel_sampling, weight_spans=r.partial_rollout,
                                  groups_per_request=r.groups_per_request)
            self._eval_client = RolloutClient(self.urls, client)
            self._client = (RolloutClient(self.urls, dataclasses.replace(client, routed_experts=routing))
                            if routing is not None else self._eval_client)
            self._weights: WeightSync = open_weight_sync(r.weight_sync, self.urls,
                                                         folder=Path(config.logging.run_dir) / "weights",
                                                         config_dir=config.model.hf_path,
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


def start_sglang(config: TrainConfig) -> list[SGLangServer]:
    """Start the rollout.num_servers SGLang servers of rollout.backend=sglang without waiting for them:
    the driver calls this first, so that their start-up overlaps Megatron's (SGLangBackend waits)."""
    r = config.rollout
    print(f"starting {r.num_servers} SGLang server(s) on {config.model.hf_path} ...", flush=True)
    return start_servers(ServerConfig(
        model_path=config.model.hf_path, dtype=config.model.dtype, weight_version="0",
        device="cuda" if torch.cuda.is_available() else "cpu",
        max_running_requests=r.concurrency, return_routed_experts=config.gspo.routing_replay == "rollout",
        log_dir=str(Path(config.logging.run_dir) / "sglang_logs"), extra_args=r.server_args), r.num_servers)


def open_backend(config: TrainConfig, *, model: list, vocab_size: int, tokenizer,
                 pgs: ProcessGroupCollection, routing: MoERouting | None = None,
                 started: list[SGLangServer] | None = None) -> RolloutBackend:
    """The configured backend (rollout.backend). SGLang: call on rank 0 only (`started`: the servers
    start_sglang started); megatron: on every rank. `routing`: the MoE model's routers (the megatron
    backend records them for routing_replay=rollout)."""
    if config.rollout.backend == "megatron":
        return MegatronBackend(config, model=model, vocab_size=vocab_size, tokenizer=tokenizer, pgs=pgs,
                               routing=routing)
    return SGLangBackend(config, started)
