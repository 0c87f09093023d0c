"""Checks of a multi-turn Sample against the conversation the chat template renders, shared by the unit tests
(fake server) and the SGLang tests (real server).

Compared byte by byte: a sampled turn may split a UTF-8 character over two tokens, or write bytes that are no
UTF-8 at all (a random model does), which decoding token by token would turn into replacement characters. So
each token is taken as the bytes it stands for (byte-level BPE), a turn's text as its bytes decoded with
surrogateescape (which keeps any byte through the template), and the rendering encoded back the same way."""


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode), inverted: symbol -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            symbols.append(256 + extra)
            extra += 1
    return {chr(s): b for b, s in zip(printable, symbols)}


_BYTES = _byte_decoder()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (an added token: its text)."""
    if token_id in tokenizer.added_tokens_decoder:
        return tokenizer.added_tokens_decoder[token_id].content.encode()
    return bytes(_BYTES[c] for c in tokenizer.convert_ids_to_tokens(token_id))


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def turn_texts(tokenizer, sample) -> list[str]:
    """What each model turn wrote, its end-of-turn (EOS) token left out."""
    eos = tokenizer.eos_token_id
    return [_text(b"".join(token_bytes(tokenizer, i) for i in sample.response_ids[t.start:t.end] if i != eos))
            for t in sample.turns]


def conversation(sample, prompt_messages: list[dict], texts: list[str]) -> list[dict]:
    """The chat messages of `sample`: the prompt's, then per model turn an assistant message with the turn's
    text followed by the tool messages its calls got back."""
    messages = list(prompt_messages)
    for k, text in enumerate(texts):
        messages.append({"role": "assistant", "content": text})
        for call in (c for c in sample.tool_calls if c.turn == k):
            content = call.result if call.error is None else f"Error: {call.error}"
            messages.append({"role": "tool", "content": content, **({"name": call.name} if call.name else {})})
    return messages


def check_against_rendering(tokenizer, sample, prompt_messages: list[dict], tools=None) -> str:
    """Assert token by token that the trajectory is the rendered conversation: the prompt's and response's tokens
    spell the chat template's rendering of the sample's conversation exactly (up to what the template writes
    after the last model turn, which no episode appends), and each response token's loss_mask is 1 exactly when
    the token lies inside what a model turn wrote (its text, and its EOS token when it wrote one), 0 when it lies
    in what the template or a tool wrote. Returns the rendered text."""
    from megatron_gspo.rollout.agent.chat import ChatTemplate

    texts = turn_texts(tokenizer, sample)
    rendered = tokenizer.apply_chat_template(conversation(sample, prompt_messages, texts), tools=tools,
                                             tokenize=False).encode("utf-8", "surrogateescape")
    pieces = [token_bytes(tokenizer, i) for i in sample.prompt_ids + sample.response_ids]
    eos_id, eos = tokenizer.eos_token_id, tokenizer.decode([tokenizer.eos_token_id]).encode()
    wrote_eos = [sample.response_ids[t.end - 1] == eos_id for t in sample.turns]
    after_last = ChatTemplate(tokenizer, tools).after_reply([], generation_prompt=False).encode()
    tail = after_last[len(eos):] if wrote_eos and wrote_eos[-1] else after_last
    assert b"".join(pieces) + tail == rendered, (b"".join(pieces), rendered)
    prompt_bytes = len(b"".join(pieces[:len(sample.prompt_ids)]))
    spans, cursor = [], prompt_bytes     # the bytes each model turn wrote, found in order
    for text, with_eos in zip(texts, wrote_eos):
        wrote = text.encode("utf-8", "surrogateescape") + (eos if with_eos else b"")
        at = rendered.index(wrote, cursor)
        spans.append((at, at + len(wrote)))
        cursor = spans[-1][1]
    expected, position = [], prompt_bytes
    for piece in pieces[len(sample.prompt_ids):]:
        expected.append(int(any(a <= position and position + len(piece) <= b for a, b in spans)))
        position += len(piece)
    assert sample.loss_mask == expected, (sample.loss_mask, expected)
    return _text(rendered)
