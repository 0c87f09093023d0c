"""The prompt dataset: files read, checked, templated and tokenised once, eagerly, at open time (every
error surfaces before training starts), then served as a resumable stream of `Prompt`s.

Stream positions count prompts handed out since the start of the run: position p is in epoch
p // len(dataset); each epoch is one pass in a fresh seeded order (or file order without shuffling),
so `prompts(p)` resumes exactly where a run that consumed p prompts stopped.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from megatron_gspo.config import DataConfig
from megatron_gspo.data.errors import DataError
from megatron_gspo.data.readers import get_key, read_rows
from megatron_gspo.data.templates import check_messages, render_prompt
from megatron_gspo.samples import Prompt


@dataclass(frozen=True)
class _Item:
    prompt_ids: tuple[int, ...]
    text: str
    answer: str
    metadata: dict | None


class PromptDataset:
    """Usable prompts of one or more files, in file order (see the module doc for the stream)."""

    def __init__(self, items: list[_Item], paths: tuple[str, ...], skipped: int, data: DataConfig, seed: int):
        self._items = items
        self.paths = paths
        """The files, in the order their rows were concatenated."""
        self.skipped = skipped
        """Prompts left out for being longer than data.max_prompt_tokens."""
        self._shuffle = data.shuffle
        self._epochs = data.epochs
        self._seed = seed

    def __len__(self) -> int:
        return len(self._items)

    def epoch_of(self, position: int) -> int:
        """The epoch (0-based) the prompt at stream `position` belongs to."""
        return position // len(self._items)

    def order(self, epoch: int) -> list[int]:
        """Indices of the usable prompts in the order epoch `epoch` serves them."""
        order = list(range(len(self._items)))
        if self._shuffle:
            # A string seed is hashed with SHA-512 by `random`: the same order on every machine and run.
            random.Random(f"megatron_gspo.data:{self._seed}:{epoch}").shuffle(order)
        return order

    def prompts(self, position: int = 0) -> Iterator[Prompt]:
        """The training stream from stream `position` on; each Prompt's group_id is its stream position.

        Ends after data.epochs passes when that is set, never otherwise.
        """
        if position < 0:
            raise ValueError(f"stream position must be >= 0, got {position}")
        n = len(self._items)
        epoch, offset = divmod(position, n)
        while self._epochs is None or epoch < self._epochs:
            order = self.order(epoch)
            for k in range(offset, n):
                yield self._prompt(order[k], group_id=epoch * n + k)
            epoch, offset = epoch + 1, 0

    def eval_prompts(self, limit: int | None = None) -> list[Prompt]:
        """The first `limit` (all when None) usable prompts in file order; group_id = index among them."""
        count = len(self._items) if limit is None else min(limit, len(self._items))
        return [self._prompt(i, group_id=i) for i in range(count)]

    def _prompt(self, index: int, group_id: int) -> Prompt:
        item = self._items[index]
        metadata = None if item.metadata is None else dict(item.metadata)
        return Prompt(group_id=group_id, prompt_ids=list(item.prompt_ids), prompt=item.text, answer=item.answer,
                      metadata=metadata)


def open_prompt_dataset(paths: Sequence[str], data: DataConfig, tokenizer, *, seed: int = 0,
                        field: str = "data.train", tools: Sequence[dict] | None = None) -> PromptDataset:
    """Read, check, template and tokenise every prompt of `paths` (concatenated in order).

    `field` names the setting the paths came from in error messages (e.g. "eval.datasets.held_out").
    `tools`: the JSON schemas of rollout.tools, which the chat template renders into every prompt (every
    prompt must then be templated).
    Raises DataError for a missing/unreadable/empty file, a missing key or bad prompt on some row
    (rows are 0-based within their file), or when every prompt is over data.max_prompt_tokens.
    """
    if isinstance(paths, str):
        paths = (paths,)
    paths = tuple(str(p) for p in paths)
    if not paths:
        raise DataError(f"{field}: no prompt files given")
    texts, rest = [], []
    for path in paths:
        try:
            rows = read_rows(path)
        except DataError as e:
            raise DataError(f"{field}: {e}") from e
        for i, row in enumerate(rows):
            where = f"{field}: {path} row {i}"
            prompt = check_messages(_required(row, data.prompt_key, where), f"{where} key {data.prompt_key!r}")
            texts.append(render_prompt(prompt, data, tokenizer, where, tools))
            answer = _answer_text(_required(row, data.answer_key, where))
            metadata = {k: _present(row, k, where) for k in data.metadata_keys} if data.metadata_keys else None
            rest.append((answer, metadata))
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    limit = data.max_prompt_tokens
    items = [_Item(tuple(t), text, answer, metadata) for t, text, (answer, metadata) in zip(ids, texts, rest)
             if limit is None or len(t) <= limit]
    if not items:
        raise DataError(f"{field}: all {len(texts)} prompts of {', '.join(paths)} are longer than "
                        f"data.max_prompt_tokens={limit} (longest {max(map(len, ids))}, shortest "
                        f"{min(map(len, ids))} tokens)")
    return PromptDataset(items, paths, len(texts) - len(items), data, seed)


def _present(row: dict, key: str, where: str) -> Any:
    try:
        return get_key(row, key)
    except KeyError:
        raise DataError(f"{where}: no key {key!r} (or null in a JSON file; keys: {sorted(row)})") from None


def _required(row: dict, key: str, where: str) -> Any:
    value = _present(row, key, where)
    if value is None:
        raise DataError(f"{where}: key {key!r} is null (parquet and save_to_disk files store a missing field as null)")
    return value


def _answer_text(value: Any) -> str:
    """The reference answer as text: strings as they are, numbers via str (7 -> "7", 0.5 -> "0.5"),
    anything else (lists, dicts, booleans) as JSON (["1", "2"] -> '["1", "2"]', True -> "true")."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return json.dumps(value, ensure_ascii=False)
