"""What both rollout backends share: the backend protocol, the stats of one call, the callback types.

    groups, stats = await backend.generate(prompts)    # one list of G Samples per prompt, in order
    groups, stats = await backend.generate(prompts, n=k, sampling=eval_sampling, on_group=scorer.submit)
    backend.sync_weights(named_tensors, version="7")   # the weights that sample next
    backend.close()

The backends: SGLang servers reached over HTTP by rank 0 alone (rollout/sglang/), and the trainer's own
model generating collectively on every rank (rollout/megatron/); `rollout.backend.open_backend` picks one.
"""
from __future__ import annotations

import re
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import torch

from megatron_gspo.config import SamplingConfig
from megatron_gspo.samples import Prompt, Sample


class RolloutFailed(RuntimeError):
    """Rank 0's rollout, scoring or weight push failed (a server died, the reward function is broken), and
    every rank raises this together, with rank 0's message: they learn of it from the broadcast that brings
    rank 0's results (rollout/manager.py, rollout/scoring.py), so they can still act together before the
    run ends with it (the driver publishes the background checkpoint every rank has written)."""


@dataclass(frozen=True)
class Failed:
    """Rank 0's failure on its way to every rank, in the broadcast of rank 0's results; raised there as
    RolloutFailed(message)."""

    message: str


def failed_on_rank0(what: str, error: BaseException) -> Failed:
    """`error` as every rank will raise it ("rollout failed on rank 0: RolloutError: ..."); its traceback is
    printed here, where it happened."""
    traceback.print_exception(error)
    return Failed(f"{what} failed on rank 0: {type(error).__name__}: {error}")


def relayed_error(recorded: str) -> tuple[int, str] | None:
    """The inverse of `failed_on_rank0` on a rank's recorded exception line ("RolloutFailed: scoring failed on
    rank 0: RewardError: ..."): (0, "RewardError: ..."), the rank the error happened on and the error itself;
    None for any other exception."""
    relayed = re.match(r"RolloutFailed: [\w ]+ failed on rank (\d+): (.*)", recorded, re.DOTALL)
    return (int(relayed.group(1)), relayed.group(2)) if relayed else None


NamedTensors = Iterable[tuple[str, torch.Tensor]]
"""(Hugging Face name, full tensor) pairs in order, e.g. convert.export.iter_hf_tensors(...)."""

OnGroup = Callable[[list[Sample]], None]
"""Called with each group of samples as it finishes (the reward scorer starts on it)."""


@dataclass
class RolloutStats:
    """What happened during one `generate` call."""

    requests_ok: dict[str, int] = field(default_factory=dict)
    """Successful requests per server URL."""
    failures: list[tuple[str, int, str]] = field(default_factory=list)
    """(server, group_id, error) for every failed attempt that was retried."""
    retired: dict[str, str] = field(default_factory=dict)
    """Servers retired during the call, with the last error."""
    elapsed_s: float = 0.0
    response_tokens: int = 0
    """Tokens the model generated."""
    server_intervals: list[tuple[float, float]] = field(default_factory=list)
    """(start, end) wall-clock times of each request inside its server (SGLang's meta_info e2e_latency
    ending at response_sent_to_client_ts): how much of the call the servers were working on it."""
    episodes: int = 0
    """Multi-turn episodes run (rollout/agent/); 0 for single-turn rollouts. Then also:"""
    turns: int = 0
    """Model turns over all episodes."""
    tool_calls: int = 0
    """Tool calls the model made (malformed ones included)."""
    tool_errors: int = 0
    """Tool calls that failed (each became an error message to the model: rollout/agent/tools.py)."""
    env_tokens: int = 0
    """Environment tokens appended (not trained); `response_tokens` counts the model's."""

    @property
    def tokens_per_s(self) -> float:
        return self.response_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


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
