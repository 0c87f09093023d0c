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
from typing import Callable, NamedTuple, Sequence

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


KEEPALIVE_EXPIRY_S = 4.0
"""An idle connection is not reused after this long: SGLang's HTTP server (uvicorn) closes one idle for 5 s
(SGLANG_TIMEOUT_KEEP_ALIVE), httpx's default expiry is the same 5 s. Requests on connections the server closed
anyway are sent again (`RolloutClient._post`): with episodes (hundreds of short requests per rollout) two of them
at once retired the only server ("all 1 servers failed ... ReadError (BrokenPipeError)")."""


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
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
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
        async with self.session() as session:
            async def run_request(chunk: Sequence[Prompt]) -> list[list[Sample]]:
                groups = await session.attempt(
                    lambda http, url: self._request(http, url, chunk, n, sampling, session.stats.server_intervals),
                    [p.group_id for p in chunk])
                for samples in groups if on_group is not None else ():
                    on_group(samples)
                return groups

            k = self.settings.groups_per_request
            groups = [g for chunk in await session.gather(run_request(prompts[i:i + k])
                                                          for i in range(0, len(prompts), k)) for g in chunk]
        stats = session.stats
        stats.response_tokens = sum(len(s.response_ids) for g in groups for s in g)
        return groups, stats

    @contextlib.asynccontextmanager
    async def session(self):
        """One rollout call's view of the servers (a `Session`: live servers, failover, stats), over this event
        loop's kept HTTP client or a new one. Its stats get the call's elapsed time when the block ends."""
        kept = self._kept.get(asyncio.get_running_loop())
        async with contextlib.nullcontext(kept) if kept is not None else self._new_http() as http:
            session = Session(self, http)
            try:
                yield session
            finally:
                await session.close()
        session.stats.elapsed_s = time.monotonic() - session.started
        if profiling.enabled():
            profiling.add(profiling.current() + "/in_server", _covered(session.stats.server_intervals))

    async def _post(self, http: httpx.AsyncClient, url: str, payload: dict, what: str):
        """POST /generate; the answer's JSON body. _RetryableError for failures in transit, RolloutError for
        answers a retry cannot fix. A request whose connection failed under it (`_stale_connection`) is sent once
        more at once on a new connection: such failures come several at a time from a healthy server and must not
        count towards retiring it; a server that is really gone fails the new connection too."""
        try:
            response = await http.post(f"{url}/generate", json=payload)
        except httpx.TransportError as e:  # refused, reset, timeout, protocol error
            if not _stale_connection(e):
                raise _RetryableError(_transport_error(e)) from e
            async with self._new_http() as fresh:
                try:
                    response = await fresh.post(f"{url}/generate", json=payload)
                except httpx.TransportError as again:
                    raise _RetryableError(_transport_error(again)) from again
        if response.status_code >= 500 or response.status_code == 429:
            raise _RetryableError(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code in (401, 403):
            raise RolloutError(f"server {url} rejected the request with HTTP {response.status_code} "
                               f"(wrong or missing API key?): {response.text[:200]}")
        if response.status_code != 200:
            raise RolloutError(f"server {url} answered HTTP {response.status_code} for {what}: {response.text[:500]}")
        try:
            return response.json()
        except ValueError as e:
            raise ServerResponseError(f"server {url}: /generate answer is not JSON: {response.text[:200]}") from e

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
        body = await self._post(http, url, payload, f"group(s) {', '.join(str(p.group_id) for p in prompts)}")
        with profiling.span(profiling.current() + "/parse"):  # no await inside: spans nest per thread
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

    async def _turns(self, http: httpx.AsyncClient, url: str, turns: Sequence[tuple], intervals: list | None = None
                     ) -> list["Output"]:
        """One /generate request for model turns of episodes, each (input_ids, params, group_id, where): one
        continuation each (n = 1), in order. Several go as SGLang's batch form (lists of input_ids and of
        sampling_params)."""
        ids = [list(t[0]) for t in turns]
        params = [{**t[1], "n": 1} for t in turns]
        single = len(turns) == 1
        payload = {"input_ids": ids[0] if single else ids, "sampling_params": params[0] if single else params,
                   "return_logprob": True, "logprob_start_len": -1}
        what = turns[0][3] if single else f"{len(turns)} turns ({turns[0][3]}, ...)"
        body = await self._post(http, url, payload, what)
        items = [body[0] if isinstance(body, list) and len(body) == 1 else body] if single else body
        if not isinstance(items, list) or len(items) != len(turns) or not all(isinstance(i, dict) for i in items):
            raise ServerResponseError(f"server {url}, {what}: expected {len(turns)} samples, got "
                                      f"{len(items) if isinstance(items, list) else type(items).__name__}")
        if intervals is not None:
            intervals.extend(_server_interval(item) for item in items)
        return [parse_output(item, f"{url}, {t[3]}") for item, t in zip(items, turns)]


class Session:
    """One rollout call's servers: `attempt(send, group_ids)` runs `send(http, url)` on the next live server
    (round robin, at most rollout.concurrency in flight on each) and on another when it fails in transit,
    retiring a server after rollout.max_server_failures failures in a row (module docstring). `stats` counts
    what happened. Made by `RolloutClient.session()`."""

    def __init__(self, client: RolloutClient, http: httpx.AsyncClient):
        self.client, self.http = client, http
        self.servers = [_Server(u, client.settings.concurrency) for u in client.urls]
        self.stats = RolloutStats(requests_ok={s.url: 0 for s in self.servers})
        self.started = time.monotonic()
        self._round_robin = itertools.cycle(range(len(self.servers)))
        self._waiting: list[tuple] = []      # episodes' turns not yet sent: (ids, params, group, where, future)
        self._sending: set[asyncio.Task] = set()

    async def attempt(self, send: Callable, group_ids: Sequence[int]):
        """`await send(http, url)` on a live server, retried on others (rollout.max_attempts in all); its result."""
        cfg = self.client.settings
        tried: set[str] = set()
        failed_attempts = 0
        while failed_attempts < cfg.max_attempts:
            server = _pick(self.servers, self._round_robin, tried)
            if server is None:
                raise RolloutError(f"all {len(self.servers)} servers failed; last errors: "
                                   + "; ".join(f"{s.url}: {s.retired_because}" for s in self.servers))
            async with server.slots:
                if server.retired_because is not None:
                    continue  # retired while this request waited for a slot: pick again
                try:
                    result = await send(self.http, server.url)
                except _RetryableError as e:
                    failed_attempts += 1
                    self.stats.failures += [(server.url, gid, str(e)) for gid in group_ids]
                    tried.add(server.url)
                    server.consecutive_failures += 1
                    if server.consecutive_failures >= cfg.max_server_failures and server.retired_because is None:
                        server.retired_because = str(e)
                        self.stats.retired[server.url] = str(e)
                    result = _FAILED
            if result is _FAILED:
                await asyncio.sleep(cfg.retry_backoff_s * 2 ** (failed_attempts - 1))
                continue
            server.consecutive_failures = 0
            self.stats.requests_ok[server.url] += 1
            return result
        first = group_ids[0]
        errors = [f"{url}: {err}" for url, gid, err in self.stats.failures if gid == first]
        which = f"group {first}" if len(group_ids) == 1 else f"groups {', '.join(map(str, group_ids))}"
        raise RolloutError(f"{which} failed after {cfg.max_attempts} attempts: " + "; ".join(errors))

    async def turn(self, input_ids: Sequence[int], params: dict, group_id: int, where: str) -> "Output":
        """One model turn of an episode: a continuation of `input_ids` with SGLang sampling_params `params`
        (n = 1). The turns that episodes ask for at the same moment (in one pass of the event loop) go together,
        up to rollout.turns_per_request in one /generate request (SGLang's batch form), failing over as one."""
        if self.client.settings.turns_per_request == 1:
            return (await self._send_turns([(input_ids, params, group_id, where)]))[0]
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((input_ids, params, group_id, where, future))
        if len(self._waiting) == 1:  # after the other episodes ready in this pass have asked for theirs
            asyncio.get_running_loop().call_soon(self._dispatch)
        return await future

    def _dispatch(self) -> None:
        k = self.client.settings.turns_per_request
        while self._waiting:
            batch, self._waiting = self._waiting[:k], self._waiting[k:]
            task = asyncio.create_task(self._resolve(batch))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _resolve(self, batch: list) -> None:
        try:
            outputs = await self._send_turns([item[:4] for item in batch])
        except BaseException as e:
            for *_, future in batch:
                if not future.done():
                    future.set_exception(e)
            return
        for (*_, future), output in zip(batch, outputs):
            if not future.done():  # its episode may have been cancelled meanwhile
                future.set_result(output)

    async def _send_turns(self, turns: list[tuple]) -> list["Output"]:
        return await self.attempt(lambda http, url: self.client._turns(http, url, turns, self.stats.server_intervals),
                                  [t[2] for t in turns])

    async def close(self) -> None:
        """Cancel the turn requests still being sent (their episodes were cancelled)."""
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)

    async def gather(self, coroutines) -> list:
        """The results of the coroutines run as tasks, in order; on the first error the others are cancelled,
        not left running, and the error raised."""
        tasks = [asyncio.create_task(c) for c in coroutines]
        try:
            return await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


_FAILED = object()


def _stale_connection(e: httpx.TransportError) -> bool:
    """The request failed on an open connection before an answer came: a write or read error (broken pipe, reset,
    the stream closed under it) or a server that disconnected without answering; not a timeout or a refused
    connection. Seen on healthy SGLang servers under many short requests (episodes): kept-alive connections the
    server closed, and anyio streams closed under a read (ReadError from ClosedResourceError)."""
    return isinstance(e, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError))


def _transport_error(e: BaseException) -> str:
    """"ReadError" and the like, with the first cause that says more (httpx's own messages are often empty)."""
    text = f"{type(e).__name__}: {e}".rstrip(": ")
    cause = e.__cause__ or e.__context__
    while cause is not None and not str(cause):
        cause = cause.__cause__ or cause.__context__
    return f"{text} ({type(cause).__name__}: {cause})" if cause is not None and str(cause) not in text else text


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


class Output(NamedTuple):
    """One sample of a /generate answer, checked."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """"stop" or "length"."""
    meta: dict
    """Its meta_info (weight_version, weight_versions, routed_experts, ...)."""
    text: str | None


def parse_output(item, where: str) -> Output:
    """One sample of SGLang's /generate answer, checked: ServerResponseError for anything the trainer cannot
    use, _RetryableError for an aborted sample (the server is shutting down or dropped the request)."""
    try:
        output_ids = item["output_ids"]
        meta = item["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")
        token_logprobs = meta["output_token_logprobs"]
    except (KeyError, TypeError, AttributeError) as e:
        raise ServerResponseError(f"{where}: missing field {e} in /generate answer (was return_logprob sent?)") from e
    if finish == "abort":
        raise _RetryableError(f"{where} aborted: {meta.get('finish_reason')}")
    if finish not in ("stop", "length"):
        raise ServerResponseError(f"{where}: unexpected finish_reason {finish!r}")
    if len(token_logprobs) != len(output_ids):
        raise ServerResponseError(f"{where}: {len(output_ids)} output ids but {len(token_logprobs)} log-probs")
    logprobs = []
    for pos, (entry, token) in enumerate(zip(token_logprobs, output_ids)):
        logprob, entry_token = entry[0], entry[1]
        if entry_token != token:
            raise ServerResponseError(f"{where}, token {pos}: log-prob is for token {entry_token} but the output "
                                      f"id is {token}")
        if logprob is None or not math.isfinite(logprob):
            raise ServerResponseError(f"{where}, token {pos} (id {token}): log-prob is {logprob!r} (NaN/inf "
                                      "logits on the server?)")
        logprobs.append(float(logprob))
    return Output(list(output_ids), logprobs, finish, meta, item.get("text"))


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
        out = parse_output(item, f"{where}, sample {index}")
        meta = out.meta
        routed = None
        if routing is not None:
            if meta.get(META_KEY) is None:
                raise ServerResponseError(f"{where}, sample {index}: no meta_info.{META_KEY} in the answer "
                                          "(is the server started with --enable-return-routed-experts?)")
            try:
                routed = decode_routed_experts(meta[META_KEY], prompt_len=len(prompt.prompt_ids),
                                               response_len=len(out.ids), spec=routing,
                                               where=f"{where}, sample {index}")
            except ValueError as e:
                raise ServerResponseError(str(e)) from None
        version, stale = meta.get("weight_version"), 0
        if meta.get("weight_versions") is not None or weight_spans:
            version, stale = stale_prefix(meta.get("weight_versions"), len(out.ids), f"{where}, sample {index}")
        samples.append(Sample(group_id=prompt.group_id, sample_index=index, prompt_ids=list(prompt.prompt_ids),
                              response_ids=out.ids, rollout_logprobs=out.logprobs, finish_reason=out.finish_reason,
                              weight_version=version, stale_prefix=stale, response_text=out.text,
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
