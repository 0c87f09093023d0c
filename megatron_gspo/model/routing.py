"""MoE routing: record the experts each router picks, replay recorded ones, measure how routing moves.

    routing = MoERouting.attach(model_chunks)           # once, after build_model (MoE models)
    with routing.pass_(reference=None) as run: ...      # see training/step.py and the forward steps

Why (arXiv 2507.18071, section 4.3): after a gradient step ~10% of the experts a 48-layer MoE activates
for the same response change, so GRPO's token ratios pi/pi_old compare two different networks.
Routing Replay makes numerator and denominator use the same experts: the routing of pi_old (mode
"old": recorded while recomputing the old log-probs) or of the rollout engine ("rollout": carried in
each sample) is replayed in the training forward. GSPO's sequence ratio is meant not to need it.

Megatron-Core 0.16.1's primitive does the work inside the router (transformer/moe/router_replay.py:
a RouterReplay per router, actions RECORD / REPLAY_FORWARD, consulted by
moe_utils.topk_routing_with_score_function). Its class keeps every instance ever created in one
global list and drives them all at once; here each model's routers are reached through the model itself,
chunk by chunk, and that list is emptied of them (platform/megatron_compat.py:detach_router_replays), so
two models in one process (tests, a reference model) never see each other's routing.
This module is the only one that uses the primitive.

Token order. A router sees this rank's tokens as [S_local * B] rows in (position, row) order: the CP
rank's part of each sequence (MicroBatch.for_cp_rank), transposed to [S, B] by the embedding and,
with sequence parallelism, cut along S into tp equal parts (rank r keeps part r). `router_order`
maps any [B, S_cp, ...] tensor to that order, so rollout routing and loss masks line up with what
the router records. Recording and replaying on the same micro-batches needs no mapping at all:
the recompute pass and the training forward run the very same micro-batches (training/step.py).

Memory: a recorded routing costs k bytes per token and MoE layer on the rank that holds both (uint8 ids
when the model has <= 256 experts, int16 otherwise): bytes per response token of the global batch =
L * k * itemsize, split over the data/context/sequence-parallel ranks (tokens) and pipeline stages
(layers). Qwen3-30B-A3B (48 layers, top-8, 128 experts): 384 B per token, 3.1 GB for 8M tokens of
rollout batch over all ranks. The K mini-batches' routing is held from the recompute pass to the end
of the step and then dropped.

Activation recomputation would call the routers again in the backward pass; Megatron's primitive then
needs REPLAY_BACKWARD, in the order of the backward passes. This project does not enable activation
recomputation, and `MoERouting.attach` refuses a model config that does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.utils import get_model_config

from megatron_gspo.platform.megatron_compat import detach_router_replays


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds expert ids (uint8 up to 256 experts)."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class _Replay(RouterReplay):
    """Megatron's RouterReplay that also records the routing the current weights choose while it
    replays another one (no extra forward: one top-k of the scores the router computed anyway)."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            _, natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.record_indices(natural)
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


def _unwrap(chunk):
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def router_order(x_BS: torch.Tensor, *, tp_size: int, tp_rank: int, sequence_parallel: bool) -> torch.Tensor:
    """[B, S, ...] (a CP rank's part) -> [T_local, ...] rows in the order this rank's routers see them."""
    x_SB = x_BS.transpose(0, 1)
    if sequence_parallel and tp_size > 1:
        x_SB = x_SB.chunk(tp_size, dim=0)[tp_rank]
    return x_SB.reshape(-1, *x_SB.shape[2:])


@dataclass
class ChangeCounts:
    """Per MoE layer (global layer index 0..L-1): response tokens whose top-k set changed, and all."""

    changed_L: torch.Tensor
    tokens_L: torch.Tensor

    @classmethod
    def zeros(cls, num_layers: int) -> "ChangeCounts":
        return cls(torch.zeros(num_layers, dtype=torch.float64), torch.zeros(num_layers, dtype=torch.float64))

    def add(self, layer: int, natural_Tk: torch.Tensor, reference_Tk: torch.Tensor, mask_T: torch.Tensor):
        self.changed_L[layer] += (topk_sets_differ(natural_Tk, reference_Tk) & mask_T).sum().double()
        self.tokens_L[layer] += mask_T.sum().double()


def topk_sets_differ(a_Tk: torch.Tensor, b_Tk: torch.Tensor) -> torch.Tensor:
    """[T] True where two top-k selections pick different expert sets (the order inside one is ignored)."""
    return (a_Tk.long().sort(dim=1).values != b_Tk.long().sort(dim=1).values).any(dim=1)


@dataclass
class RoutingPass:
    """One schedule run's routing, micro-batch by micro-batch on each model chunk.

    `replay`: per micro-batch, per chunk, per router of that chunk, the [T_local, k] ids to replay (None:
    route freely and record). After the run, `recorded` holds what was routed (or, while replaying, what the
    current weights would have routed) in the same nesting, and `counts` compares it, on response tokens, with
    `compare` (same nesting) when given.
    """

    routing: "MoERouting"
    replay: list | None = None
    compare: list | None = None
    recorded: list = field(default_factory=list)
    counts: ChangeCounts = field(init=False)
    _next: dict = field(default_factory=dict)

    def __post_init__(self):
        self.counts = ChangeCounts.zeros(self.routing.num_layers)

    @contextlib.contextmanager
    def forward(self, chunk, mask_BS: torch.Tensor):
        """Around one chunk's forward of its next micro-batch; `mask_BS` is that micro-batch's (CP part)
        loss mask: the tokens whose routing is counted."""
        c = self.routing.chunk_index(chunk)
        m = self._next.get(c, 0)
        self._next[c] = m + 1
        routers = self.routing.routers[c]
        targets = self.replay[m][c] if self.replay is not None else None
        for i, replay in enumerate(self.routing.replays[c]):
            replay.clear_indices()
            if targets is None:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                # set_target_indices would also queue the ids for a backward replay, never used here
                replay.target_topk_idx = targets[i].long()
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            for replay in self.routing.replays[c]:
                replay.clear_router_replay_action()
        natural = []
        for replay in self.routing.replays[c]:
            ids = replay.get_recorded_indices()
            if ids is None:
                raise RuntimeError("a router did not run in its chunk's forward: nothing was recorded")
            natural.append(ids.to(self.routing.dtype))
        for replay in self.routing.replays[c]:
            replay.clear_indices()
        while len(self.recorded) <= m:
            self.recorded.append([None] * len(self.routing.routers))
        self.recorded[m][c] = natural
        if self.compare is not None:
            mask_T = self.routing.router_order(mask_BS).bool()
            for router, now, before in zip(routers, natural, self.compare[m][c]):
                self.counts.add(router.layer_number - 1, now, before, mask_T)


class MoERouting:
    """The routers of one model (this rank's chunks), driven through Megatron's RouterReplay."""

    def __init__(self, model_chunks: list):
        config = get_model_config(model_chunks[0])
        if getattr(config, "recompute_granularity", None) is not None:
            raise ValueError("routing replay with activation recomputation (recompute_granularity="
                             f"{config.recompute_granularity!r}) is not supported: the backward's recompute "
                             "would route again")
        self.chunks = list(model_chunks)
        self.num_layers = config.num_layers
        """L: MoE layers are indexed by their global layer number - 1 (every Qwen3-MoE layer is MoE)."""
        self.topk = config.moe_router_topk
        self.dtype = routing_dtype(config.num_moe_experts)
        self.tp_size = config.tensor_model_parallel_size
        self.sequence_parallel = config.sequence_parallel
        self.routers: list[list[TopKRouter]] = []
        self.replays: list[list[_Replay]] = []
        for chunk in self.chunks:
            routers = [m for m in _unwrap(chunk).modules() if isinstance(m, TopKRouter)]
            replays = []
            for router in routers:
                router.router_replay = _Replay()
                replays.append(router.router_replay)
            self.routers.append(routers)
            self.replays.append(replays)
        # Reached through the routers above; Megatron's process-wide list must not keep them.
        detach_router_replays([r for rs in self.replays for r in rs])
        self._tp_rank = 0
        if self.tp_size > 1:
            pgs = _unwrap(self.chunks[0]).pg_collection
            self._tp_rank = pgs.tp.rank()

    @classmethod
    def attach(cls, model_chunks: list) -> "MoERouting | None":
        """The model's routing, or None for a dense model."""
        config = get_model_config(model_chunks[0])
        return cls(model_chunks) if config.num_moe_experts else None

    @property
    def layer_numbers(self) -> list[int]:
        """Global layer numbers (1-based) of this rank's routers, chunk by chunk."""
        return [r.layer_number for rs in self.routers for r in rs]

    def chunk_index(self, chunk) -> int:
        for i, c in enumerate(self.chunks):
            if c is chunk:
                return i
        raise ValueError("a forward step got a model chunk this MoERouting was not attached to")

    def router_order(self, x_BS: torch.Tensor) -> torch.Tensor:
        return router_order(x_BS, tp_size=self.tp_size, tp_rank=self._tp_rank,
                            sequence_parallel=self.sequence_parallel)

    def targets_from_full(self, routing_BSLk: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per chunk, per router: [T_local, k] ids taken from a [B, S_cp, L, k] routing of all layers."""
        local_TLk = self.router_order(routing_BSLk)
        return [[local_TLk[:, r.layer_number - 1].contiguous() for r in routers] for routers in self.routers]

    def pass_(self, *, replay: list | None = None, compare: list | None = None) -> RoutingPass:
        return RoutingPass(self, replay=replay, compare=compare)
