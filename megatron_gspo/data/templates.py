"""Turning a row's prompt (a string or a list of {role, content} messages) into the text sent to the
model, following `data.chat_template` (megatron_gspo/config.py, DataConfig):

- "auto": messages go through the tokenizer's chat template when it has one; a string prompt is used
  as it is (and `system_prompt` does not apply to it).
- "true": always templated; a string prompt becomes one user message. The tokenizer must have a template.
- "false": never templated; only string prompts are allowed.

Templated prompts get `add_generation_prompt=True` and `data.chat_template_kwargs`; `system_prompt`
becomes a leading system message (a row that already starts with one is an error, not silently replaced).
With rollout.tools the tools' JSON schemas go to the template too (`tools=`), and a prompt the template would
not render (a string prompt under "auto", anything under "false") is an error: the model would not see them.
"""
from __future__ import annotations

from typing import Any, Sequence

from megatron_gspo.config import DataConfig
from megatron_gspo.data.errors import DataError


def check_messages(value: Any, where: str) -> str | list[dict]:
    """`value` itself if it is a string or a non-empty list of {role: str, content: str} dicts.

    Message keys whose value is None are dropped: columnar files (parquet, pyarrow JSON) give every
    message every key seen in any row, null where a row lacked it.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: message {i} must be a dict with string 'role' and 'content', got "
                                f"{_short(m)}")
            messages.append({k: v for k, v in m.items() if v is not None})
        return messages
    raise DataError(f"{where}: prompt must be a string or a non-empty list of {{role, content}} messages, "
                    f"got {type(value).__name__} {_short(value)}")


def render_prompt(prompt: str | list[dict], data: DataConfig, tokenizer, where: str,
                  tools: Sequence[dict] | None = None) -> str:
    """The text of one checked prompt (see the module doc for the rules)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if tools and (data.chat_template == "false" or (data.chat_template == "auto" and isinstance(prompt, str))):
        raise DataError(f"{where}: rollout.tools are rendered by the chat template, which this prompt does not go "
                        "through (a string prompt needs data.chat_template=true, making it a user message)")
    if data.chat_template == "false":
        if not isinstance(prompt, str):
            raise DataError(f"{where}: prompt is a list of messages but data.chat_template=false (messages "
                            "need a template; set data.chat_template to auto or true)")
        return prompt
    if data.chat_template == "true" and not has_template:
        raise DataError(f"data.chat_template=true but the tokenizer has no chat template ({where})")
    if isinstance(prompt, str):
        if data.chat_template == "auto":
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    elif not has_template:  # auto, messages, no template
        raise DataError(f"{where}: prompt is a list of messages but the tokenizer has no chat template "
                        "(give string prompts, or a tokenizer with a template)")
    if data.system_prompt is not None:
        if prompt[0]["role"] == "system":
            raise DataError(f"{where}: the messages already start with a system message and data.system_prompt "
                            "is set (remove one of them)")
        prompt = [{"role": "system", "content": data.system_prompt}, *prompt]
    return tokenizer.apply_chat_template(prompt, tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=True, **data.chat_template_kwargs)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
