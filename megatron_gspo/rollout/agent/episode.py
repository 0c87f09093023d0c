"""Multi-turn episodes: the `ep` object an episode function drives, and the runner that makes Samples of them.

An episode function (rollout.episode_fn; the tool episode of rollout.tools is one, tools.py):

    async def episode(ep) -> None:
        turn = await ep.generate()                  # one model turn from the context so far (trained)
        ep.append_messages([{"role": "user", "content": reply(turn.text)}])   # environment tokens (not trained)
        ep.append(" obs: 3\\n")                      # ... or raw text / token ids
        turn = await ep.generate(max_new_tokens=64)  # sampling overrides for this turn
        ep.add_reward(1.0)                          # a reward for the latest model turn
        ep.storage["moves"] = 2                     # reaches the reward function as sample.storage

Token in, token out: each model turn is one SGLang /generate request whose `input_ids` are the exact context
ids so far (prompt, earlier turns as sampled, environment tokens as appended); its output ids and log-probs
are appended as returned. Only the environment's new text is tokenised (chat.py renders messages).

The episode becomes one Sample (samples.py): response_ids = every token after the prompt, rollout_logprobs
for each (0.0 for environment tokens, never read), loss_mask (1 = the model's), turns (spans, finish reasons,
rewards), tool_calls, storage. Its finish reason is its last turn's, or "length" when the context ran out.

Limits: at most rollout.max_turns model turns; prompt + episode at most rollout.max_context_tokens (default the
model's context length). A turn gets min(max_new_tokens, room left) new tokens; when no room is left, or
appended environment tokens would leave none, `ep.generate` / `ep.append` raise `EpisodeOver`, which ends the
episode (finish reason "length"; past max_turns: its last turn's). Let it propagate.
"""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Awaitable, Callable, Sequence

from megatron_gspo.config import RolloutConfig, SamplingConfig
from megatron_gspo.rollout.agent.chat import ChatTemplate, Segment
from megatron_gspo.rollout.agent.tools import ParsedCall, ToolBox, error_message, load_function
from megatron_gspo.rollout.protocol import OnGroup, RolloutStats
from megatron_gspo.rollout.sglang.client import RolloutClient, RolloutError, ServerResponseError, Session, \
    sglang_sampling_params
from megatron_gspo.samples import Prompt, Sample, ToolCall, Turn

EpisodeFn = Callable[["Episode"], Awaitable[None]]

_OVERRIDABLE = ("max_new_tokens", "top_p", "top_k", "stop", "stop_token_ids")
"""Sampling settings one turn may change (`ep.generate(**overrides)`). Not the temperature: the trainer divides
every trained token's logits by sampling.temperature, so a turn sampled at another one would not be the policy
the loss assumes."""


class EpisodeOver(Exception):
    """The episode can take no further model turn: the context is full ("length") or max_turns were taken.
    Raised by `ep.generate` / `ep.append`; the runner ends the episode there."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EpisodeError(RolloutError):
    """An episode function raised (the message names it, the prompt and the sample)."""


@dataclasses.dataclass(frozen=True)
class Generated:
    """One model turn, as `ep.generate()` returns it."""

    text: str
    """The turn's text (its token ids decoded, special tokens such as the end-of-turn token left out)."""
    token_ids: list[int]
    """The ids the sampler returned (its stop token included), appended to the context as they are."""
    logprobs: list[float]
    """The sampler's log-prob of each of them."""
    finish_reason: str
    """"stop" (an end-of-turn / stop token or string) or "length" (max_new_tokens, or the context is full)."""


def load_episode_fn(spec: str) -> EpisodeFn:
    """The `async def episode(ep)` that rollout.episode_fn names; ValueError if it is not one."""
    fn = load_function(spec, "rollout.episode_fn")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.episode_fn: {spec!r} must be an async function (`async def episode(ep) -> None`)")
    return fn


class Episode:
    """The `ep` of one episode (module doc): its prompt, its context, and what it may do next."""

    def __init__(self, prompt: Prompt, index: int, *, session: Session, sampling: SamplingConfig, tokenizer,
                 chat: ChatTemplate | None, tools: ToolBox | None, max_turns: int, max_context: int):
        self.prompt = prompt
        """The Prompt (prompt_ids, prompt text, answer, metadata)."""
        self.index = index
        """This episode's sample index in its group (0..G-1)."""
        self.storage: dict = {}
        """Anything the reward function should see: it arrives as `sample.storage`."""
        self.sampling = sampling
        """The sampling settings of this rollout (training's, or the evaluation's)."""
        self.tokenizer = tokenizer
        self.tools = tools
        """The run's tools (rollout.tools), or None."""
        self._session, self._chat = session, chat
        self.max_turns, self.max_context = max_turns, max_context
        self._context = list(prompt.prompt_ids)
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.turns: list[Turn] = []
        self.tool_calls: list[ToolCall] = []
        self.context_full = False
        self.weight_versions: set = set()
        self._segment: Segment | None = None  # the environment's messages since the last model turn
        self._raw_since_turn = False
        self._turn_end = ""

    @property
    def context_ids(self) -> tuple[int, ...]:
        """The ids the next model turn continues: prompt + everything appended so far."""
        return tuple(self._context)

    @property
    def turns_left(self) -> int:
        """Model turns this episode may still take (rollout.max_turns)."""
        return self.max_turns - len(self.turns)

    async def generate(self, **overrides) -> Generated:
        """Sample one model turn from the context (module doc). `overrides`: max_new_tokens, top_p, top_k, stop,
        stop_token_ids for this turn."""
        unknown = sorted(set(overrides) - set(_OVERRIDABLE))
        if unknown:
            raise ValueError(f"ep.generate: cannot override {', '.join(unknown)} (allowed: {', '.join(_OVERRIDABLE)}; "
                             "the temperature is the run's: the trainer divides the logits by it)")
        if not self.turns_left:
            raise EpisodeOver("max_turns")
        if self._segment is not None:  # the template's generation prompt after the environment's messages
            self._append_env(self._chat.encode(self._segment.generation_prompt()))
            self._segment = None
        room = self.max_context - len(self._context)
        if room < 1:
            self.context_full = True
            raise EpisodeOver("length")
        sampling = dataclasses.replace(self.sampling, **overrides)
        params = sglang_sampling_params(sampling, 1)
        params["max_new_tokens"] = min(sampling.max_new_tokens, room)
        out = await self._session.turn(self._context, params, self.prompt.group_id,
                                       f"group {self.prompt.group_id}, sample {self.index}, turn {len(self.turns)}")
        self.weight_versions.add(out.meta.get("weight_version"))
        start = len(self.response_ids)
        self._context += out.ids
        self.response_ids += out.ids
        self.logprobs += out.logprobs
        self.loss_mask += [1] * len(out.ids)
        self.turns.append(Turn(start, len(self.response_ids), out.finish_reason))
        if out.finish_reason == "length" and (params["max_new_tokens"] == room
                                              or len(out.ids) < params["max_new_tokens"]):
            self.context_full = True   # our limit, or the server's own (it cut max_new_tokens to its context)
        stop_ids = set(self._eos_ids()) | set(sampling.stop_token_ids)
        ended_by_token = out.finish_reason == "stop" and out.ids and out.ids[-1] in stop_ids
        self._turn_end = self.tokenizer.decode(out.ids[-1:], skip_special_tokens=False) if ended_by_token else ""
        self._raw_since_turn = False
        return Generated(self.tokenizer.decode(out.ids, skip_special_tokens=True), list(out.ids), list(out.logprobs),
                         out.finish_reason)

    def append(self, text_or_ids: str | Sequence[int]) -> list[int]:
        """Append environment tokens, as they are: text is tokenised (no special tokens added), ids are taken
        as given. They condition what follows and are not trained. Returns the ids appended. Not in the same
        gap between model turns as `append_messages` (the template's rendering would not be the context)."""
        if self._segment is not None:
            raise ValueError("ep.append after ep.append_messages before the next model turn: the chat template's "
                             "rendering of the messages would no longer be the context; use one of them per gap")
        ids = self._encode(text_or_ids)
        self._append_env(ids)
        self._raw_since_turn = True
        return ids

    def append_messages(self, messages: Sequence[dict]) -> list[int]:
        """Append chat messages ({"role": "tool" | "user" | ..., "content": ...}) as the tokenizer's chat template
        renders them after the last model turn (chat.py); the next `generate` adds the template's generation
        prompt. Returns the ids appended."""
        if not self.turns:
            raise ValueError("ep.append_messages before the first model turn: the prompt already ends with the "
                             "generation prompt (put first messages into the prompt, or ep.append text)")
        if self._raw_since_turn:
            raise ValueError("ep.append_messages after ep.append before the next model turn: use one of them per gap")
        if self._chat is None:
            raise ValueError("ep.append_messages: the tokenizer has no chat template (use ep.append)")
        if self._segment is None:
            self._segment = Segment(self._chat, self._turn_end)
        ids = self._chat.encode(self._segment.add(list(messages)))
        self._append_env(ids)
        return ids

    def add_reward(self, value: float) -> None:
        """Attach `value` to the latest model turn (summed with what it has: GSPO/GRPO train on the episode's
        sum, gspo_token on each turn's return: loss/advantages.py)."""
        if not self.turns:
            raise ValueError("ep.add_reward before the first model turn: a reward belongs to a model turn")
        self.turns[-1].reward += float(value)

    async def call_tools(self, calls: Sequence[ParsedCall]) -> list[dict]:
        """Run the latest turn's parsed tool calls (concurrently, in the tool workers) and record them; the
        `tool` messages of their results (or errors, tools.py), in order, for `append_messages`."""
        if self.tools is None:
            raise ValueError("ep.call_tools: no rollout.tools configured")
        turn = len(self.turns) - 1

        async def one(call: ParsedCall) -> tuple[str | None, str | None]:
            if call.error is not None:
                return None, call.error
            return await self.tools.call(call.name, call.arguments)
        answers = await asyncio.gather(*(one(c) for c in calls))
        messages = []
        for call, (result, error) in zip(calls, answers):
            self.tool_calls.append(ToolCall(turn, call.name, call.arguments, result, error))
            message = {"role": "tool", "content": result if error is None else error_message(error)}
            if call.name is not None:
                message["name"] = call.name
            messages.append(message)
        return messages

    def _encode(self, text_or_ids) -> list[int]:
        if isinstance(text_or_ids, str):
            return list(self.tokenizer(text_or_ids, add_special_tokens=False)["input_ids"])
        return [int(t) for t in text_or_ids]

    def _append_env(self, ids: list[int]) -> None:
        if not ids:
            return
        if len(self._context) + len(ids) >= self.max_context:  # no room would be left for a model token
            self.context_full = True
            raise EpisodeOver("length")
        self._context += ids
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)   # a placeholder: environment tokens are never trained
        self.loss_mask += [0] * len(ids)

    def _eos_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def sample(self) -> Sample:
        """This episode as a Sample (module doc)."""
        versions = self.weight_versions - {None}
        if len(versions) > 1:
            raise ServerResponseError(f"group {self.prompt.group_id}, sample {self.index}: turns sampled by weight "
                                      f"versions {sorted(versions)} (weights changed within an episode)")
        finish = "length" if self.context_full else self.turns[-1].finish_reason if self.turns else "stop"
        p = self.prompt
        return Sample(group_id=p.group_id, sample_index=self.index, prompt_ids=list(p.prompt_ids),
                      response_ids=list(self.response_ids), rollout_logprobs=list(self.logprobs), finish_reason=finish,
                      weight_version=next(iter(versions), None),
                      response_text=self.tokenizer.decode(self.response_ids, skip_special_tokens=True),
                      prompt=p.prompt, answer=p.answer, metadata=p.metadata, loss_mask=list(self.loss_mask),
                      turns=list(self.turns), tool_calls=list(self.tool_calls), storage=dict(self.storage))


class EpisodeRunner:
    """G episodes per prompt against the SGLang servers; the rollout backend's `generate` with episodes on."""

    def __init__(self, client: RolloutClient, tokenizer, settings: RolloutConfig, *, episode: EpisodeFn,
                 name: str, tools: ToolBox | None, chat: ChatTemplate | None, max_context: int):
        """`episode`: the episode function (`name`: its spec, for error messages); `max_context`: the context
        limit (rollout.max_context_tokens, or the model's)."""
        self.client, self.tokenizer, self.episode, self.name = client, tokenizer, episode, name
        self.tools, self.chat, self.max_turns, self.max_context = tools, chat, settings.max_turns, max_context

    async def generate(self, prompts: Sequence[Prompt], n: int, sampling: SamplingConfig,
                       on_group: OnGroup | None = None) -> tuple[list[list[Sample]], RolloutStats]:
        """n episodes of each prompt (their turns interleave freely, at most rollout.concurrency requests in
        flight per server); each group goes to `on_group` the moment its last episode ends."""
        ids = [p.group_id for p in prompts]
        if len(set(ids)) != len(ids):
            raise ValueError("group_id must be unique per prompt")
        async with self.client.session() as session:
            async def group(prompt: Prompt) -> list[Sample]:
                samples = list(await asyncio.gather(*(self._run(session, prompt, i, sampling) for i in range(n))))
                if on_group is not None:
                    on_group(samples)
                return samples
            groups = await session.gather(group(p) for p in prompts)
        stats = session.stats
        samples = [s for g in groups for s in g]
        stats.response_tokens = sum(s.model_tokens for s in samples)
        stats.episodes = len(samples)
        stats.turns = sum(len(s.turns) for s in samples)
        stats.tool_calls = sum(len(s.tool_calls) for s in samples)
        stats.tool_errors = sum(c.error is not None for s in samples for c in s.tool_calls)
        stats.env_tokens = sum(len(s.response_ids) - s.model_tokens for s in samples)
        return groups, stats

    async def _run(self, session: Session, prompt: Prompt, index: int, sampling: SamplingConfig) -> Sample:
        ep = Episode(prompt, index, session=session, sampling=sampling, tokenizer=self.tokenizer, chat=self.chat,
                     tools=self.tools, max_turns=self.max_turns, max_context=self.max_context)
        try:
            await self.episode(ep)
        except EpisodeOver:
            pass
        except (RolloutError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise EpisodeError(f"episode {self.name} raised on group {prompt.group_id} sample {index} after "
                               f"{len(ep.turns)} turn(s): {type(e).__name__}: {e}") from e
        return ep.sample()
