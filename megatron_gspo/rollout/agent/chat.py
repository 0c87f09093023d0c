"""Chat messages appended to an episode: the tokenizer's template renders them, only their text is tokenised.

Token in / token out: a model turn's ids are what the sampler returned and are never re-tokenised. What the
environment adds after a turn (tool results, a user's reply) is text the chat template decides, and only that
text is tokenised. The usual trap is to render the whole conversation again and tokenise it: the model's
tokens would then be re-tokenised from their text (a sampled "1","2" becomes the merged "12", and the
trained ids are not the ones the sampler's log-probs are of).

How the text after a model turn is found, whatever the template: render a probe conversation, a user message
and an assistant message whose content is a sentinel, then the new messages:

    [user "·", assistant SENTINEL, *messages]   ->   "...SENTINEL<|im_end|>\\n<|im_start|>user\\n<tool_response>..."

Everything after SENTINEL is what the template puts after an assistant message's content: its end-of-turn
markup, then the new messages (and, asked for, the generation prompt of the next assistant turn). The model
wrote its own end-of-turn token (`<|im_end|>` above): that part is already in the context, the rest is
appended. Only the text after the sentinel is used, so a template that renders earlier assistant turns
differently once they are no longer the last one (Qwen3's empty <think></think> block) changes nothing here.
Messages appended in several calls between two model turns must render as one text growing at its end;
a template that regroups them (Qwen3 puts consecutive tool results in one user block) is refused with the
advice to append them in one call.

Each delta is tokenised on its own. Where the template puts a special token at the boundary (every chat
template here: an end-of-turn token, `<tool_response>`) that equals tokenising the whole conversation; a
boundary inside plain text could tokenise differently, and the model sees (and trains after) the ids given.
"""
from __future__ import annotations

from typing import Sequence

SENTINEL = "\u2063MEGATRON_GSPO_REPLY\u2063"
"""The probe assistant message's content (invisible separators around a name: no template writes it)."""
_PROBE_USER = {"role": "user", "content": "\u2063"}


class TemplateError(ValueError):
    """The chat template cannot render messages as an episode needs (the message says why)."""


class ChatTemplate:
    """The tokenizer's chat template as an episode uses it: the text after a model turn, the tools rendered."""

    def __init__(self, tokenizer, tools: Sequence[dict] | None = None, template_kwargs: dict | None = None):
        """`tools`: the JSON schemas the prompts were rendered with (rendered again here so that the probe
        conversation is the prompts' kind); `template_kwargs`: data.chat_template_kwargs."""
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template: messages cannot be appended (append text or ids)")
        self.tokenizer, self.tools, self.kwargs = tokenizer, list(tools) if tools else None, dict(template_kwargs or {})

    def after_reply(self, messages: Sequence[dict], generation_prompt: bool) -> str:
        """What the template writes after an assistant message's content when `messages` follow it (the
        module doc), with the next assistant turn's generation prompt when asked."""
        probe = [_PROBE_USER, {"role": "assistant", "content": SENTINEL}, *messages]
        text = self.tokenizer.apply_chat_template(probe, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)
        at = text.rfind(SENTINEL)
        if at < 0:
            raise TemplateError("the chat template does not write an assistant message's content as it is: the text "
                                "after a model turn cannot be found")
        return text[at + len(SENTINEL):]

    def encode(self, text: str) -> list[int]:
        """`text` as token ids, no special tokens added (a special token's text becomes that token)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class Segment:
    """The environment's messages between two model turns, as they are appended (Episode uses one per gap).

    `turn_end` is the text of the token that ended the model turn before it (its stop token, e.g.
    "<|im_end|>"), or "" when the turn ended otherwise (max_new_tokens): the template's end-of-turn markup
    is then the environment's to append.
    """

    def __init__(self, chat: ChatTemplate, turn_end: str):
        self.chat, self.turn_end = chat, turn_end
        self.messages: list[dict] = []
        self.rendered = ""
        """The template's text after the model turn's content that the context holds so far."""

    def add(self, messages: Sequence[dict]) -> str:
        """The text to append for `messages` (after those added before)."""
        after = self.chat.after_reply([*self.messages, *messages], generation_prompt=False)
        if not self.messages:  # the model's own end-of-turn token is in the context already when it matches
            self.rendered = self.turn_end if self.turn_end and after.startswith(self.turn_end) else ""
        return self._grow(after, lambda: self.messages.extend(messages))

    def generation_prompt(self) -> str:
        """The text to append before the next model turn: the template's generation prompt after the messages
        (empty when the template has none, or no message was added)."""
        if not self.messages:
            return ""
        return self._grow(self.chat.after_reply(self.messages, generation_prompt=True), lambda: None)

    def _grow(self, after: str, commit) -> str:
        if not after.startswith(self.rendered):
            raise TemplateError("the chat template renders these messages differently once more follow them (e.g. it "
                                f"regroups them): append all of a turn's messages in one call. Had {self.rendered!r}, "
                                f"now {after!r}")
        commit()
        delta, self.rendered = after[len(self.rendered):], after
        return delta
