"""Responses -> this data-parallel rank's micro-batches (MicroBatch rows), balanced by tokens.

Shapes: B rows (one response each), S positions (a row's padded length).

One row is prompt + response, right-padded. The logits at position s predict token s+1, so with a
3-token prompt [p0 p1 p2], a 2-token response [r0 r1] and rollout log-probs [l0 l1], padded to S=8:

    position        0    1    2    3    4    5    6    7
    tokens_BS       p0   p1   p2   r0   r1   0    0    0
    labels_BS       p1   p2   r0   r1   0    0    0    0      tokens shifted left by one
    loss_mask_BS    0    0    1    1    0    0    0    0      1 where the label is a response token
    old_logprobs    0    0    l0   l1   0    0    0    0      aligned with the labels
A per-token advantage list is aligned the same way as the log-probs. A response's stale prefix (its
first `stale_prefix` tokens, by older weights: rollout.partial_rollout) keeps loss_mask 0: with
stale_prefix = 1 above, the mask would be 0 0 0 1 0 0 0 0. So does a multi-turn episode's environment
token (its per-response-token `loss_mask` 0: a tool result, chat markup): with a response mask 1 0 above,
the row's mask would be 0 0 1 0 0 0 0 0. Everything downstream reads loss_mask_BS (the loss and |y_i|,
entropy, the train-vs-rollout gap, the correction and its metrics, the routing metrics) and context
parallelism splits it with the rows, so the environment's tokens count nowhere.

S is a multiple of `pad_multiple` = 2*cp*tp: context parallelism cuts rows into 2*cp chunks and
sequence parallelism splits each CP part over the TP ranks.

The split rule (all ranks compute it identically, no communication):
1. Data parallel: the mini-batch's R responses must divide evenly over the D ranks (R/D each).
   Responses are taken longest first and each goes to the rank with the fewest padded tokens among
   those still short of R/D: equal sequence counts, near-equal token counts.
2. Micro-batches, within a rank: responses sorted longest first are cut into consecutive chunks, each
   holding as many rows as fit `max_tokens` at its first (longest) row's padded length, so similar
   lengths share a micro-batch and padding stays small. A response longer than the budget gets a
   micro-batch of its own.
3. Every DP rank must run the same number of micro-batches (Megatron's schedule runs one collective
   per micro-batch): M = the largest count any rank needs; a rank with fewer splits its fullest
   micro-batch in two until it has M. M <= R/D always, so no micro-batch is empty.
4. `rows="uniform"` (pipeline parallelism: stages exchange activations of one fixed shape) makes every
   micro-batch the same [R/D/M, S_max]: M is the smallest divisor of R/D whose rows fit the budget.
The gradient does not depend on the split (forward_step.py's loss contract); only speed does.

Packed rows (`rows="packed"`, config `parallel.pack_sequences`): a row holds several responses
one after the other, each attending causally to itself only (microbatch.MicroBatch.segments_BS; the core
attention runs sequence by sequence, parallel/cp_attention.py) and each at its own positions 0, 1, ...
(positions_BS: its rotary angles are those of a row of its own; model/packed_rows.py). Rule 2 then fills rows first-fit-decreasing up to the mini-batch's longest padded
response (so no row is longer, nor its attention wider, than without packing) and cuts the rows into
micro-batches by the budget; rule 3 splits rows as well as micro-batches when a rank needs more of them.
A micro-batch whose rows ended up with one response each stays an unpacked one. Only a row's end is
padded:

    position        0    1    2    3    4    5    6    7
    tokens_BS       a0   a1   a2   b0   b1   b2   0    0        response a: prompt a0, answer a1 a2
    segments_BS     0    0    0    1    1    1   -1   -1        response b: prompt b0 b1, answer b2
    positions_BS    0    1    2    0    1    2    3    4
    loss_mask_BS    1    1    0    0    1    0    0    0
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, Sequence

import torch

from megatron_gspo.microbatch import MicroBatch


class Trainable(Protocol):
    """What the trainer needs of one sampled response (the rollout's Sample adapts to this)."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    rollout_logprobs: Sequence[float] | None
    """The sampler's log-prob of each response token, or None (then old log-probs are recomputed)."""
    advantage: float | Sequence[float]
    """One advantage for the response, or one per response token."""
    # Optional, read with getattr: `routed_experts` (samples.Sample's), the rollout engine's MoE routing;
    # `stale_prefix` (samples.Sample's), leading response tokens that are not trained; `loss_mask`
    # (samples.Sample's), 0 on a multi-turn episode's environment tokens.


@dataclass(frozen=True)
class Response:
    """A plain Trainable."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    advantage: float | Sequence[float]
    rollout_logprobs: Sequence[float] | None = None
    routed_experts: object = None
    """[P + R - 1, L, k] expert ids per input position (samples.Sample.routed_experts), or None."""
    stale_prefix: int = 0
    """Leading response tokens that condition the rest but are not trained (samples.Sample.stale_prefix)."""
    loss_mask: Sequence[int] | None = None
    """Per response token, 0 where it is not trained (a multi-turn episode's environment tokens:
    samples.Sample.loss_mask); None: all trained."""


@dataclass
class PackedMiniBatch:
    """One DP rank's share of a mini-batch, as the schedule consumes it."""

    micro_batches: list[MicroBatch]
    rows: list[list[int]]
    """For each micro-batch, the mini-batch index of each of its responses, in its sequence order (one per
    row, in row order, unless rows are packed)."""
    places: list[list[tuple[int, int]]] = field(default_factory=list)
    """For each micro-batch, where each response of `rows` lies: (row, first position)."""
    rollout_logprobs: list[torch.Tensor] = field(default_factory=list)
    """Per micro-batch [B, S] rollout log-probs aligned like old_logprobs_BS (empty if not given)."""
    num_global_sequences: int = 0
    """N: responses in the mini-batch over all DP ranks (the GSPO normaliser)."""
    padding_fraction: float = 0.0
    """Padded positions / all positions of the micro-batches of every DP rank (each rank computes the
    same plan for all of them, so this needs no communication)."""

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batches)

    @property
    def seq_length(self) -> int:
        """Longest padded row (the schedule's seq_length; exact for every micro-batch when uniform)."""
        return max(mb.tokens_BS.shape[1] for mb in self.micro_batches)

    @property
    def micro_batch_size(self) -> int:
        return max(mb.tokens_BS.shape[0] for mb in self.micro_batches)


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def _check(responses: Sequence[Trainable]) -> None:
    for i, r in enumerate(responses):
        if len(r.prompt_ids) < 1:
            raise ValueError(f"response {i}: the prompt is empty (the first response token needs context)")
        if r.rollout_logprobs is not None and len(r.rollout_logprobs) != len(r.response_ids):
            raise ValueError(f"response {i}: {len(r.rollout_logprobs)} rollout log-probs for "
                             f"{len(r.response_ids)} response tokens")
        stale = getattr(r, "stale_prefix", 0)
        if stale and not 0 < stale < len(r.response_ids):
            raise ValueError(f"response {i}: stale_prefix {stale} must leave at least one of the "
                             f"{len(r.response_ids)} response tokens to train")
        mask = getattr(r, "loss_mask", None)
        if mask is not None and len(mask) != len(r.response_ids):
            raise ValueError(f"response {i}: loss_mask of {len(mask)} entries for {len(r.response_ids)} response tokens")
        if not isinstance(r.advantage, (int, float)) and len(r.advantage) != len(r.response_ids):
            raise ValueError(f"response {i}: {len(r.advantage)} per-token advantages for "
                             f"{len(r.response_ids)} response tokens")


def assign_to_dp(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Rule 1: response indices per DP rank, longest first, equal counts, balanced tokens."""
    if len(lengths) % dp_size:
        raise ValueError(f"{len(lengths)} responses do not divide over {dp_size} data-parallel ranks")
    per_rank = len(lengths) // dp_size
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    tokens = [0] * dp_size
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min((r for r in range(dp_size) if len(ranks[r]) < per_rank), key=lambda r: (tokens[r], r))
        ranks[rank].append(i)
        tokens[rank] += lengths[i]
    return ranks


def _chunks_by_budget(order: list[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rule 2: `order` is longest first; each chunk fills the budget at its first row's length."""
    chunks, start = [], 0
    while start < len(order):
        rows = max(1, max_tokens // lengths[order[start]])
        chunks.append(order[start:start + rows])
        start += rows
    return chunks


def _split_to(chunks: list[list[int]], count: int) -> list[list[int]]:
    """Rule 3: split the fullest chunk in two until there are `count`."""
    chunks = list(chunks)
    while len(chunks) < count:
        i = max(range(len(chunks)), key=lambda k: (len(chunks[k]), -k))
        half = (len(chunks[i]) + 1) // 2
        chunks[i:i + 1] = [chunks[i][:half], chunks[i][half:]]
    return chunks


def _uniform_count(per_rank: int, rows_that_fit: int) -> int:
    """Rule 4: the smallest divisor M of per_rank with per_rank / M rows within the budget."""
    return next(m for m in range(1, per_rank + 1) if per_rank % m == 0 and per_rank // m <= rows_that_fit)


def _fill_rows(order: list[int], lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Packed rule 2: first-fit-decreasing of `order` (longest first) into rows of `capacity` tokens."""
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        r = next((r for r in range(len(rows)) if fill[r] + lengths[i] <= capacity), None)
        if r is None:
            rows.append([])
            fill.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        fill[r] += lengths[i]
    return rows


def _split_packed_to(chunks: list[list[list[int]]], count: int) -> list[list[list[int]]]:
    """Packed rule 3: split the micro-batch with the most rows in two (or, holding one row, that row's
    responses) until there are `count`."""
    chunks = [list(c) for c in chunks]
    while len(chunks) < count:
        i = max(range(len(chunks)), key=lambda k: (len(chunks[k]), sum(map(len, chunks[k])), -k))
        chunk = chunks[i]
        if len(chunk) > 1:
            half = (len(chunk) + 1) // 2
            chunks[i:i + 1] = [chunk[:half], chunk[half:]]
        else:
            (row,) = chunk
            half = (len(row) + 1) // 2
            chunks[i:i + 1] = [[row[:half]], [row[half:]]]
    return chunks


def plan_packed_rows(lengths: Sequence[int], *, dp_size: int, max_tokens: int,
                     pad_multiple: int = 1) -> list[list[list[list[int]]]]:
    """Rules 1-3 with packed rows: for each DP rank, its micro-batches, each a list of rows, each row the
    response indices it holds in order. `lengths` are the real (unpadded) prompt + response lengths."""
    padded = [padded_length(n, pad_multiple) for n in lengths]
    capacity = max(padded)
    ranks = assign_to_dp(padded, dp_size)
    chunked = []
    for rank in ranks:
        rows = _fill_rows(rank, lengths, capacity)
        row_len = [padded_length(sum(lengths[i] for i in row), pad_multiple) for row in rows]
        order = sorted(range(len(rows)), key=lambda r: (-row_len[r], r))
        cuts = _chunks_by_budget(order, row_len, max_tokens)
        chunked.append([[rows[r] for r in cut] for cut in cuts])
    count = max(len(c) for c in chunked)
    return [_split_packed_to(c, count) for c in chunked]


def plan_microbatches(lengths: Sequence[int], *, dp_size: int, max_tokens: int,
                      uniform: bool = False) -> list[list[list[int]]]:
    """Rules 1-4: for each DP rank, its micro-batches as lists of response indices.

    `lengths` are padded row lengths (prompt + response rounded up to the pad multiple).
    """
    ranks = assign_to_dp(lengths, dp_size)
    if uniform:
        per_rank = len(ranks[0])
        count = _uniform_count(per_rank, max(1, max_tokens // max(lengths)))
        rows = per_rank // count
        return [[rank[k * rows:(k + 1) * rows] for k in range(count)] for rank in ranks]
    chunked = [_chunks_by_budget(rank, lengths, max_tokens) for rank in ranks]
    count = max(len(c) for c in chunked)
    return [_split_to(c, count) for c in chunked]


def routing_rows(responses: Sequence[Trainable], length: int,
                 places: Sequence[tuple[int, int]] | None = None, num_rows: int | None = None) -> torch.Tensor:
    """[B, length, L, k] rollout routing of `responses` (each `routed_experts` [P + R - 1, L, k]) on the
    rows' input positions; positions without one (padding, the last response token) route to 0..k-1.
    `places`: (row, first position) of each response (packed rows); default one response per row."""
    places = list(places) if places is not None else [(b, 0) for b in range(len(responses))]
    arrays = [torch.as_tensor(getattr(r, "routed_experts")) for r in responses]
    shape = arrays[0].shape[1:]
    if len(shape) != 2:
        raise ValueError(f"routed_experts must be [positions, layers, k], got shape {tuple(arrays[0].shape)}")
    B = num_rows if num_rows is not None else len(responses)
    out = torch.arange(shape[1], dtype=arrays[0].dtype).expand(B, length, *shape).clone()
    for b, (r, ids, (row, start)) in enumerate(zip(responses, arrays, places)):
        expected = len(r.prompt_ids) + len(r.response_ids) - 1
        if ids.shape != (expected, *shape):
            raise ValueError(f"response {b}: routed_experts of shape {tuple(ids.shape)}, expected "
                             f"({expected}, {shape[0]}, {shape[1]}) for {len(r.prompt_ids)} prompt and "
                             f"{len(r.response_ids)} response tokens")
        out[row, start:start + expected] = ids
    return out


def _rows(rows: Sequence[Sequence[Trainable]], length: int, packed: bool):
    """[B, length] tensors of the responses of each row (one per row unless `packed`), aligned as in the
    module docstring, and each response's (row, first position), in row-major order. The responses
    passed `_check` (pack_minibatch): their log-probs, advantages and stale prefixes fit them.

    Python only gathers each response's numbers and places (list extends, no per-token loop); the
    tensors are written with one indexed assignment each. A few torch calls per response instead cost
    the demo's 256 short responses 5.4 ms against 1 ms this way (benchmarked on this 2-core machine)."""
    B = len(rows)
    responses = [r for row in rows for r in row]
    per_token = [not isinstance(r.advantage, (int, float)) for r in responses]
    if any(per_token) and not all(per_token):
        raise ValueError("a mini-batch mixes per-sequence and per-token advantages")
    per_token = bool(per_token) and per_token[0]
    starts, prompt_lens, response_lens, stale = [], [], [], []   # per response; starts are flat positions
    ids, rollout, token_advantages, trained = [], [], [], []     # per token, responses one after the other
    pad_starts, pad_lens, pad_first = [], [], []                 # per packed row with padding at its end
    places = []
    for b, row in enumerate(rows):
        start = 0
        for r in row:
            places.append((b, start))
            P, R = len(r.prompt_ids), len(r.response_ids)
            if start + P + R > length:
                raise ValueError(f"row {b}: responses of {start + P + R} tokens do not fit its {length} positions")
            starts.append(b * length + start)
            prompt_lens.append(P)
            response_lens.append(R)
            stale.append(getattr(r, "stale_prefix", 0))
            ids.extend(r.prompt_ids)
            ids.extend(r.response_ids)
            rollout.extend(r.rollout_logprobs if r.rollout_logprobs is not None else [0.0] * R)
            token_advantages.extend(r.advantage if per_token else (float(r.advantage),))
            mask = getattr(r, "loss_mask", None)
            trained.extend(mask if mask is not None else (1,) * R)
            start += P + R
        if packed and start < length:  # padding: its own segment (-1); positions go on from the last response's
            pad_starts.append(b * length + start)
            pad_lens.append(length - start)
            pad_first.append(start - places[-1][1])
    starts_t, P_t, R_t = (torch.tensor(x, dtype=torch.long) for x in (starts, prompt_lens, response_lens))
    L_t = P_t + R_t
    ids_t = torch.tensor(ids, dtype=torch.long)
    offsets = torch.cumsum(L_t, 0) - L_t                          # each response's first token in ids_t

    def scatter(at: torch.Tensor, values: torch.Tensor, fill=0) -> torch.Tensor:
        out = torch.full((B * length,), fill, dtype=values.dtype)
        out[at] = values
        return out.view(B, length)

    spans = _spans(starts_t, L_t)                                 # every prompt and response token
    tokens = scatter(spans, ids_t)
    labels = scatter(_spans(starts_t, L_t - 1), ids_t[_spans(offsets + 1, L_t - 1)])
    targets = _spans(starts_t + P_t - 1, R_t)                     # positions whose label is a response token
    in_response = _spans(torch.zeros_like(R_t), R_t)              # 0 .. R-1 within each response
    fresh = in_response >= torch.repeat_interleave(torch.tensor(stale, dtype=torch.long), R_t)  # not a stale prefix
    mask = scatter(targets, (fresh & torch.tensor(trained, dtype=torch.bool)).to(torch.float32))
    rollout_BS = scatter(targets, torch.tensor(rollout, dtype=torch.float32))
    advantages = (scatter(targets, torch.tensor(token_advantages, dtype=torch.float32)) if per_token
                  else torch.tensor(token_advantages, dtype=torch.float32))
    segments = positions = None
    if packed:
        segments = scatter(spans, torch.repeat_interleave(torch.arange(len(responses)), L_t), fill=-1)
        positions = scatter(spans, _spans(torch.zeros_like(L_t), L_t)).view(-1)
        if pad_starts:
            pad_starts_t, pad_lens_t = torch.tensor(pad_starts), torch.tensor(pad_lens)
            positions[_spans(pad_starts_t, pad_lens_t)] = _spans(torch.tensor(pad_first), pad_lens_t)
        positions = positions.view(B, length)
    return tokens, labels, mask, rollout_BS, advantages, segments, positions, places


def _spans(firsts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """firsts[0], firsts[0] + 1, .., firsts[0] + lengths[0] - 1, firsts[1], ...: the concatenated ranges."""
    total = int(lengths.sum())
    ends = torch.cumsum(lengths, 0)
    return torch.arange(total) + torch.repeat_interleave(firsts - (ends - lengths), lengths)


Rows = Literal["padded", "uniform", "packed"]
"""How responses fill micro-batch rows: padded (one per row, rules 1-3), uniform (one per row, every
micro-batch the same shape: rule 4, pipeline parallelism) or packed (several per row: packed rows)."""


def pack_minibatch(responses: Sequence[Trainable], *, dp_size: int, dp_rank: int, max_tokens: int,
                   pad_multiple: int = 2, rows: Rows = "padded", min_microbatches: int = 1) -> PackedMiniBatch:
    """This DP rank's micro-batches of `responses` (the whole mini-batch, the same list on every rank).

    old_logprobs_BS holds the rollout log-probs (zeros where none were given: recompute them).
    `rows`: see Rows. `min_microbatches`: split (rule 3) until there are at least that many (at most one
    per response); not with uniform rows.
    """
    if not responses:
        raise ValueError("an empty mini-batch")
    if rows not in ("padded", "uniform", "packed"):
        raise ValueError(f"rows must be padded, uniform or packed, got {rows!r}")
    uniform, pack_sequences = rows == "uniform", rows == "packed"
    _check(responses)
    real_lengths = [len(r.prompt_ids) + len(r.response_ids) for r in responses]
    lengths = [padded_length(n, pad_multiple) for n in real_lengths]
    if pack_sequences:
        plans = plan_packed_rows(real_lengths, dp_size=dp_size, max_tokens=max_tokens, pad_multiple=pad_multiple)
        row_length = lambda row: padded_length(sum(real_lengths[i] for i in row), pad_multiple)  # noqa: E731
    else:
        plans = [[[[i] for i in mb] for mb in p]
                 for p in plan_microbatches(lengths, dp_size=dp_size, max_tokens=max_tokens, uniform=uniform)]
        row_length = lambda row: lengths[row[0]]  # noqa: E731
    if min_microbatches > 1:
        if uniform:
            raise ValueError("min_microbatches is not supported with uniform micro-batches")
        responses_per_rank = min(sum(len(row) for mb in p for row in mb) for p in plans)
        count = min(max(min_microbatches, max(len(p) for p in plans)), responses_per_rank)
        plans = [_split_packed_to(p, count) for p in plans]
    full = max(lengths)
    mb_length = lambda mb: full if uniform else max(row_length(row) for row in mb)  # noqa: E731
    positions = sum(len(mb) * mb_length(mb) for p in plans for mb in p)
    packed = PackedMiniBatch(micro_batches=[], rows=[[i for row in mb for i in row] for mb in plans[dp_rank]],
                             num_global_sequences=len(responses), padding_fraction=1.0 - sum(real_lengths) / positions)
    have_rollout = all(r.rollout_logprobs is not None for r in responses)
    have_routing = all(getattr(r, "routed_experts", None) is not None for r in responses)
    for mb in plans[dp_rank]:
        length = mb_length(mb)
        mb_rows = [[responses[i] for i in row] for row in mb]
        # a micro-batch whose rows hold one response each is an unpacked one (plain causal attention)
        shared = pack_sequences and any(len(row) > 1 for row in mb_rows)
        tokens, labels, mask, rollout, advantages, segments, positions_BS, places = _rows(mb_rows, length, shared)
        flat = [r for row in mb_rows for r in row]
        routing = routing_rows(flat, length, places, len(mb_rows)) if have_routing else None
        packed.micro_batches.append(MicroBatch(tokens, labels, mask, rollout.clone(), advantages, routing,
                                               segments_BS=segments, positions_BS=positions_BS))
        packed.places.append(places)
        if have_rollout:
            packed.rollout_logprobs.append(rollout)
    return packed


def responses_from_samples(samples: Sequence, advantages: Sequence[float | Sequence[float]] | torch.Tensor
                           ) -> list[Response]:
    """The rollout's Samples (samples.Sample: prompt_ids, response_ids, rollout_logprobs, loss_mask, ...)
    paired in order with their advantages: one per sample (e.g. loss.group_advantages(...).advantages_R), or
    a list per sample, one per response token (loss.advantages.turn_advantages, gspo_token)."""
    advantages = advantages.tolist() if isinstance(advantages, torch.Tensor) else list(advantages)
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    return [Response(s.prompt_ids, s.response_ids, a, s.rollout_logprobs, getattr(s, "routed_experts", None),
                     getattr(s, "stale_prefix", 0), getattr(s, "loss_mask", None)) for s, a in zip(samples, advantages)]
