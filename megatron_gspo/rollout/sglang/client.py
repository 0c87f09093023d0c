"""Async rollout client: G samples per prompt from one or more SGLang servers, with failover.

One `/generate` request per prompt with `n = G`, or per `groups_per_request` prompts (SGLang's batch
form; the request is the unit of work and of retry: its groups are either returned whole by one server
or sent again, so a group never mixes samples of two attempts and no sample is lost or duplicated).
Requests are spread round-robin over the live servers, at most
`rollout.concurrency` in flight on each. A request that fails in transit (connection refused or
reset, timeout, HTTP 5xx, an aborted sample) is retried on another server; a server that fails
`rollout.max_server_failures` times in a row is retired for the rest of the call. Errors that a retry cannot
fix (HTTP 4xx such as a wrong API key, a malformed response, a null log-prob) stop the rollout.

With `routed_experts` given (gspo.routing_replay=rollout) every request also asks for the
MoE routing SGLang used, and each Sample carries it (`Sample.routed_experts`, rollout/sglang/routed_experts.py).

The client speaks HTTP only (httpx); it runs in the trainer's environment, not SGLang's.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from typing import Callable, Sequence

import httpx

from megatron_gspo import profiling
from megatron_gspo.config import RolloutConfig, SamplingConfig
from megatron_gspo.net import auth_headers, tls_context
from megatron_gspo.rollout.protocol import RolloutStats
from megatron_gspo.rollout.sglang.routed_experts import META_KEY, RoutingSpec, decode_routed_experts
from megatron_gspo.samples import Prompt, Sample


def sglang_sampling_params(sampling: SamplingConfig, n: int) -> dict:
    """SGLang's `sampling_params` for G = n samples (names as SGLang spells them). EOS always ends a
    response; stop_token_ids and stop strings are further ends."""
    params = {"n": n, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
              "max_new_tokens": sampling.max_new_tokens}
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    return params


class RolloutError(RuntimeError):
    """The rollout cannot complete (every server failed, a group ran out of attempts, a fatal answer)."""


class ServerResponseError(RolloutError):
    """A server answered, but not with what the trainer needs (null log-prob, length mismatch, ...)."""


class _RetryableError(Exception):
    """A failure in transit: the same group may succeed on another server."""


class _Server:
    def __init__(self, url: str, concurrency: int):
        self.url = url.rstrip("/")
        self.slots = asyncio.Semaphore(concurrency)
        self.consecutive_failures = 0
        self.retired_because: str | None = None


class RolloutClient:
    """`await client.generate(prompts, n=G, sampling=...)` -> one list of G Samples per prompt, in order."""

    def __init__(self, urls: Sequence[str], settings: RolloutConfig, *, routed_experts: RoutingSpec | None = None):
        """`settings`: concurrency (per server), groups_per_request, parallel_sampling, timeouts, retries and
        the API key (config.py documents each); with rollout.partial_rollout every answer must carry SGLang's
        per-token weight versions (`stale_prefix`). `routed_experts`: the served MoE model's routing layout
        (`RoutingSpec.from_hf_config(hf_dir)`): every request asks for its routed experts and each Sample
        carries them, checked against this layout (the servers run with --enable-return-routed-experts)."""
        if not urls:
            raise ValueError("no server URLs given")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs: {list(urls)}")
        self.urls = [u.rstrip("/") for u in urls]
        self.settings, self.routed_experts = settings, routed_experts
        self._kept: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        """Per event loop, the HTTP client `keep_connections` opened (its connections outlive a call)."""

    async def keep_connections(self) -> None:
        """From now on, `generate` calls in this event loop share one HTTP client, whose connections stay
        open between calls (a loop that lives across rollout steps: no reconnecting each step). Undo with
        `close_connections` in the same loop."""
        loop = asyncio.get_running_loop()
        if loop not in self._kept:
            self._kept[loop] = self._new_http()

    async def close_connections(self) -> None:
        """Close the HTTP client `keep_connections` opened in this event loop (if any)."""
        http = self._kept.pop(asyncio.get_running_loop(), None)
        if http is not None:
            await http.aclose()

    def _new_http(self) -> httpx.AsyncClient:
        cfg = self.settings
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
        connections = cfg.concurrency * len(self.urls)
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(timeout=timeout, limits=limits, headers=auth_headers(cfg.api_key), verify=tls_context())

    def generate_sync(self, prompts: Sequence[Prompt], n: int,
                      sampling: SamplingConfig = SamplingConfig()) -> tuple[list[list[Sample]], RolloutStats]:
        return asyncio.run(self.generate(prompts, n, sampling))

    async def generate(self, prompts: Sequence[Prompt], n: int, sampling: SamplingConfig = SamplingConfig(),
                       on_group: Callable[[list[Sample]], None] | None = None
                       ) -> tuple[list[list[Sample]], RolloutStats]:
        """`on_group(samples)` is called with each group the moment its last response arrives (scoring
        starts while other groups still generate)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        ids = [p.group_id for p in prompts]
        if len(set(ids)) != len(ids):
            raise ValueError("group_id must be unique per prompt")
        cfg = self.settings
        servers = [_Server(u, cfg.concurrency) for u in self.urls]
        stats = RolloutStats(requests_ok={s.url: 0 for s in servers})
        round_robin = itertools.cycle(range(len(servers)))
        start = time.monotonic()
        kept = self._kept.get(asyncio.get_running_loop())
        async with contextlib.nullcontext(kept) if kept is not None else self._new_http() as http:
            async def run_request(chunk: Sequence[Prompt]) -> list[list[Sample]]:
                tried: set[str] = set()
                failed_attempts = 0
                while failed_attempts < cfg.max_attempts:
                    server = _pick(servers, round_robin, tried)
                    if server is None:
                        raise RolloutError(f"all {len(servers)} servers failed; last errors: "
                                           + "; ".join(f"{s.url}: {s.retired_because}" for s in servers))
                    async with server.slots:
                        if server.retired_because is not None:
                            continue  # retired while this group waited for a slot: pick again
                        try:
                            groups = await self._request(http, server.url, chunk, n, sampling,
                                                         stats.server_intervals)
                        except _RetryableError as e:
                            groups = None
                            failed_attempts += 1
                            stats.failures += [(server.url, p.group_id, str(e)) for p in chunk]
                            tried.add(server.url)
                            server.consecutive_failures += 1
                            if (server.consecutive_failures >= cfg.max_server_failures
                                    and server.retired_because is None):
                                server.retired_because = str(e)
                                stats.retired[server.url] = str(e)
                    if groups is None:
                        await asyncio.sleep(cfg.retry_backoff_s * 2 ** (failed_attempts - 1))
                        continue
                    server.consecutive_failures = 0
                    stats.requests_ok[server.url] += 1
                    for samples in groups if on_group is not None else ():
                        on_group(samples)
                    return groups
                first = chunk[0].group_id
                errors = [f"{url}: {err}" for url, gid, err in stats.failures if gid == first]
                which = f"group {first}" if len(chunk) == 1 else f"groups {', '.join(str(p.group_id) for p in chunk)}"
                raise RolloutError(f"{which} failed after {cfg.max_attempts} attempts: " + "; ".join(errors))

            k = cfg.groups_per_request
            tasks = [asyncio.create_task(run_request(prompts[i:i + k])) for i in range(0, len(prompts), k)]
            try:
                # raises the first fatal error ...
                groups = [g for chunk in await asyncio.gather(*tasks) for g in chunk]
            except BaseException:
                for task in tasks:  # ... after which the other groups are cancelled, not left running
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        stats.elapsed_s = time.monotonic() - start
        stats.response_tokens = sum(len(s.response_ids) for g in groups for s in g)
        if profiling.enabled():
            profiling.add(profiling.current() + "/in_server", _covered(stats.server_intervals))
        return groups, stats

    async def _request(self, http: httpx.AsyncClient, url: str, prompts: Sequence[Prompt], n: int,
                       sampling: SamplingConfig, intervals: list | None = None) -> list[list[Sample]]:
        """One /generate request for the groups of `prompts`: n samples each, in order."""
        if self.settings.parallel_sampling == "copies":
            input_ids = [list(p.prompt_ids) for p in prompts for _ in range(n)]
            params = sglang_sampling_params(sampling, 1)
        else:  # a single prompt as a flat list: SGLang then answers one item per sample, as for a batch of one
            input_ids = [list(p.prompt_ids) for p in prompts] if len(prompts) > 1 else list(prompts[0].prompt_ids)
            params = sglang_sampling_params(sampling, n)
        payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1}
        routing = self.routed_experts
        if routing is not None:
            payload["return_routed_experts"] = True  # one flag for all n samples (io_struct.py:1001)
        try:
            response = await http.post(f"{url}/generate", json=payload)
        except httpx.TransportError as e:  # refused, reset, timeout, protocol error
            raise _RetryableError(f"{type(e).__name__}: {e}".rstrip(": ")) from e
        if response.status_code >= 500 or response.status_code == 429:
            raise _RetryableError(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code in (401, 403):
            raise RolloutError(f"server {url} rejected the request with HTTP {response.status_code} "
                               f"(wrong or missing API key?): {response.text[:200]}")
        if response.status_code != 200:
            raise RolloutError(f"server {url} answered HTTP {response.status_code} for group(s) "
                               f"{', '.join(str(p.group_id) for p in prompts)}: {response.text[:500]}")
        with profiling.span(profiling.current() + "/parse"):  # no await inside: spans nest per thread
            try:
                body = response.json()
            except ValueError as e:
                raise ServerResponseError(f"server {url}: /generate answer is not JSON: {response.text[:200]}") from e
            items = [body] if isinstance(body, dict) else body
            if len(prompts) > 1 and (not isinstance(items, list) or len(items) != n * len(prompts)):
                got = len(items) if isinstance(items, list) else type(items).__name__
                raise ServerResponseError(f"server {url}: expected {n * len(prompts)} samples for {len(prompts)} "
                                          f"groups, got {got}")
            groups = [parse_generate_response(items[i * n:(i + 1) * n] if len(prompts) > 1 else body, p, n, url,
                                              routing=routing, weight_spans=self.settings.partial_rollout)
                      for i, p in enumerate(prompts)]
        if intervals is not None:
            intervals.extend(_server_interval(item) for item in (body if isinstance(body, list) else [body]))
        return groups


def _server_interval(item: dict) -> tuple[float, float]:
    meta = item.get("meta_info") or {}
    end, latency = meta.get("response_sent_to_client_ts"), meta.get("e2e_latency")
    if not isinstance(end, (int, float)) or not isinstance(latency, (int, float)):
        return (0.0, 0.0)
    return (end - latency, end)


def _covered(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _pick(servers: list[_Server], round_robin, tried: set[str]) -> _Server | None:
    """Next live server in round-robin order, preferring one this group has not failed on."""
    live = [s for s in servers if s.retired_because is None]
    if not live:
        return None
    fresh = [s for s in live if s.url not in tried]
    pool = {id(s) for s in (fresh or live)}
    while True:
        candidate = servers[next(round_robin)]
        if id(candidate) in pool:
            return candidate


def parse_generate_response(body, prompt: Prompt, n: int, url: str = "server", *,
                            routing: RoutingSpec | None = None, weight_spans: bool = False) -> list[Sample]:
    """SGLang's /generate answer for one prompt with n samples -> n Samples (validated). With `routing`,
    each sample's `meta_info.routed_experts` becomes its `Sample.routed_experts`. A sample's
    `meta_info.weight_versions` (see `stale_prefix`) sets its weight_version and stale_prefix; with
    `weight_spans` an answer without them is an error.

    Raises ServerResponseError for anything the trainer cannot use, and _RetryableError for an
    aborted sample (the server is shutting down or dropped the request: try the group elsewhere).
    """
    items = [body] if isinstance(body, dict) else body
    where = f"{url}, group {prompt.group_id}"
    if not isinstance(items, list) or len(items) != n:
        raise ServerResponseError(f"{where}: expected {n} samples, got "
                                  f"{len(items) if isinstance(items, list) else type(items).__name__}")
    samples = []
    for index, item in enumerate(items):
        try:
            output_ids = item["output_ids"]
            meta = item["meta_info"]
            finish = (meta.get("finish_reason") or {}).get("type")
            token_logprobs = meta["output_token_logprobs"]
        except (KeyError, TypeError, AttributeError) as e:
            raise ServerResponseError(f"{where}, sample {index}: missing field {e} in /generate answer "
                                      "(was return_logprob sent?)") from e
        if finish == "abort":
            raise _RetryableError(f"sample {index} aborted: {meta.get('finish_reason')}")
        if finish not in ("stop", "length"):
            raise ServerResponseError(f"{where}, sample {index}: unexpected finish_reason {finish!r}")
        if len(token_logprobs) != len(output_ids):
            raise ServerResponseError(f"{where}, sample {index}: {len(output_ids)} output ids but "
                                      f"{len(token_logprobs)} log-probs")
        logprobs = []
        for pos, (entry, token) in enumerate(zip(token_logprobs, output_ids)):
            logprob, entry_token = entry[0], entry[1]
            if entry_token != token:
                raise ServerResponseError(f"{where}, sample {index}, token {pos}: log-prob is for token "
                                          f"{entry_token} but the output id is {token}")
            if logprob is None or not math.isfinite(logprob):
                raise ServerResponseError(f"{where}, sample {index}, token {pos} (id {token}): log-prob is "
                                          f"{logprob!r} (NaN/inf logits on the server?)")
            logprobs.append(float(logprob))
        routed = None
        if routing is not None:
            if meta.get(META_KEY) is None:
                raise ServerResponseError(f"{where}, sample {index}: no meta_info.{META_KEY} in the answer "
                                          "(is the server started with --enable-return-routed-experts?)")
            try:
                routed = decode_routed_experts(meta[META_KEY], prompt_len=len(prompt.prompt_ids),
                                               response_len=len(output_ids), spec=routing,
                                               where=f"{where}, sample {index}")
            except ValueError as e:
                raise ServerResponseError(str(e)) from None
        version, stale = meta.get("weight_version"), 0
        if meta.get("weight_versions") is not None or weight_spans:
            version, stale = stale_prefix(meta.get("weight_versions"), len(output_ids), f"{where}, sample {index}")
        samples.append(Sample(group_id=prompt.group_id, sample_index=index, prompt_ids=list(prompt.prompt_ids),
                              response_ids=list(output_ids), rollout_logprobs=logprobs, finish_reason=finish,
                              weight_version=version, stale_prefix=stale, response_text=item.get("text"),
                              prompt=prompt.prompt, answer=prompt.answer, metadata=prompt.metadata,
                              routed_experts=routed))
    return samples


def stale_prefix(spans, num_tokens: int, where: str) -> tuple[str, int]:
    """(version, stale) from SGLang's `meta_info.weight_versions` of one answer: [{"version", "start",
    "end"}, ...], consecutive spans of its output tokens by the weights that generated them (a weight
    update while the request ran starts a new span: sglang/srt/utils/weight_versions.py). `version`: the
    last span's, the weights of the tokens that train; `stale`: its start, the tokens before it were
    generated by older weights. Raises ServerResponseError unless the spans cover the tokens exactly."""
    if not isinstance(spans, list) or not spans:
        raise ServerResponseError(f"{where}: no meta_info.weight_versions in the answer (rollout.partial_rollout "
                                  "needs SGLang's per-token weight versions, SGLang >= 0.5.23)")
    reach = 0
    for span in spans:
        try:
            version, start, end = str(span["version"]), int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            raise ServerResponseError(f"{where}: malformed meta_info.weight_versions {spans!r}") from None
        if start != reach or end < start or (end == start and num_tokens):
            raise ServerResponseError(f"{where}: meta_info.weight_versions {spans!r} do not cover the "
                                      f"{num_tokens} output tokens in order")
        reach = end
    if reach != num_tokens:
        raise ServerResponseError(f"{where}: meta_info.weight_versions {spans!r} cover {reach} tokens, the answer "
                                  f"has {num_tokens}")
    return version, start
