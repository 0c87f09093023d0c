"""Prompts and sampled responses: what the rollout, the reward functions and the trainer pass around.

Plain Python (no torch), so reward worker processes import it in milliseconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Sample:
    """One sampled response to a prompt, as the rollout returns it (one JSONL line on disk).

    The G samples of one prompt share `group_id`; `sample_index` numbers them 0..G-1. R tokens in
    the response: `response_ids` and `rollout_logprobs` both have length R (a stop token that ended
    the response is included, it is trained like any other).
    """

    group_id: int
    """Which prompt this answers; the G samples of a group are normalised together (advantages)."""
    sample_index: int
    """Position 0..G-1 inside the group."""
    prompt_ids: list[int]
    """Prompt token ids as sent to the server."""
    response_ids: list[int]
    """Generated token ids (R)."""
    rollout_logprobs: list[float]
    """The sampler's log-prob of each response token (R): log_softmax(logits / temperature)."""
    finish_reason: str
    """"stop" (eos or a stop token/string) or "length" (max_new_tokens reached)."""
    weight_version: str | None = None
    """The server's weight version that generated the response."""
    reward: float | None = None
    """Scalar reward, set after scoring."""
    response_text: str | None = None
    """Detokenised response (what reward functions read)."""
    prompt: str | None = None
    """Prompt text, when the prompt was given as text."""
    answer: str | None = None
    """Reference answer for the reward, when the prompt file has one."""
    metadata: dict | None = None
    """The prompt's `data.metadata_keys` fields, for the reward function."""
    routed_experts: Any = None
    """MoE routing the rollout engine used (gspo.routing_replay=rollout), or None: an integer array
    [P + R - 1, L, k] (numpy, uint8 when the model has <= 256 experts, else int16): for every input
    position of prompt + response except the last response token (which is never fed back), for
    each of the model's L layers, the k experts its router picked. Position p is the token whose
    hidden state predicts token p + 1, as in training/packing.py's rows."""

    def __post_init__(self):
        if len(self.response_ids) != len(self.rollout_logprobs):
            raise ValueError(f"group {self.group_id} sample {self.sample_index}: {len(self.response_ids)} "
                             f"response ids but {len(self.rollout_logprobs)} log-probs")
        if not all(math.isfinite(x) for x in self.rollout_logprobs):
            raise ValueError(f"group {self.group_id} sample {self.sample_index}: non-finite rollout log-prob")


@dataclass(frozen=True)
class Prompt:
    """One prompt to roll out G times (one line of a prompts JSONL file)."""

    group_id: int
    """Identifies the group of G samples answering this prompt."""
    prompt_ids: list[int]
    """Token ids sent to the server."""
    prompt: str | None = None
    """The text the ids came from, when given as text."""
    answer: str | None = None
    """Reference answer for the reward function."""
    metadata: dict | None = None
    """Other fields of the prompt's row (`data.metadata_keys`), passed to the reward function."""
