"""Batches as the trainer hands them to Megatron's schedules.

Shapes: B sequences (one per row, right-padded), S positions. Position s of a row holds input token
tokens[s] and the target labels[s] = tokens[s+1] that the logits at s predict; loss_mask[s] = 1 when
that target is a trained response token. Everything that varies along S is split the same way under
context parallelism, so the shift never crosses a CP boundary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from megatron_gspo.parallel.context_parallel import split_for_cp


@dataclass
class MicroBatch:
    tokens_BS: torch.Tensor
    """Input token ids (long)."""
    labels_BS: torch.Tensor
    """Target ids: tokens shifted left by one (long); anything where loss_mask is 0."""
    loss_mask_BS: torch.Tensor
    """1 where labels_BS is a trained response token (prompt, padding, tool output: 0)."""
    old_logprobs_BS: torch.Tensor
    """Behaviour-policy log-probs of labels_BS (float32); anything where loss_mask is 0."""
    advantages: torch.Tensor
    """[B] one advantage per sequence, or [B, S] per token (gspo_token / grpo)."""

    @property
    def num_sequences(self) -> int:
        return self.tokens_BS.shape[0]

    def for_cp_rank(self, cp_size: int, cp_rank: int) -> "MicroBatch":
        """This CP rank's part of every sequence (Megatron's load-balanced 2*cp-chunk layout)."""
        if cp_size == 1:
            return self
        parts = {}
        for f in fields(self):
            value = getattr(self, f.name)
            parts[f.name] = split_for_cp(value, cp_size, cp_rank, seq_dim=1) if value.dim() == 2 else value
        return MicroBatch(**parts)

    def rows(self, start: int, stop: int) -> "MicroBatch":
        return MicroBatch(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})


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
