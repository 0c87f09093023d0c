"""A tiny fake of SGLang's /generate for client tests (asyncio streams, no dependencies).

It answers like SGLang 0.5.23 (flat list of n items, output_token_logprobs [[logprob, id, null], ...];
with `routing=(L, k, E)`, like a server started with --enable-return-routed-experts, meta_info.routed_experts
when the request asks) and can misbehave on purpose: die after k requests, stall, return null log-probs,
abort, demand a key, send routing for the wrong number of positions. The weight-update endpoints
(/begin_weight_update, /update_weights_from_disk, /update_weights_from_tensor, /end_weight_update,
GET /get_model_info) set and report the weight version, as a weight sync expects, and load nothing.
With `respond`, a function (input_ids, sampling_params) -> (output_ids, finish type), each sample's output is
what it says (multi-turn episodes: scripted model turns); the log-prob of output token t is -(t + 1) / 10.
"""
from __future__ import annotations

import asyncio
import base64
import json

import numpy as np


def fake_routing(positions: int, num_layers: int, topk: int, num_experts: int, salt: int) -> np.ndarray:
    """The routing the fake reports: int32 [positions, L, k], entry (t, l, j) = (t + 3 l + j + salt) % E
    (k distinct ids per row while k <= E; `salt` makes the samples of a group differ)."""
    t, l, j = np.meshgrid(np.arange(positions), np.arange(num_layers), np.arange(topk), indexing="ij")
    return ((t + 3 * l + j + salt) % num_experts).astype(np.int32)


class FakeSGLang:
    def __init__(self, *, name: str = "fake", die_after: int | None = None, stall: bool = False,
                 delay_s: float = 0.01, null_logprob: bool = False, short_logprobs: bool = False,
                 abort: bool = False, api_key: str | None = None, response_len: int = 3,
                 routing: tuple[int, int, int] | None = None, routing_extra_positions: int = 0, respond=None,
                 drop_reused: bool = False):
        self.name = name
        self.die_after = die_after
        self.stall = stall
        self.delay_s = delay_s
        self.null_logprob = null_logprob
        self.short_logprobs = short_logprobs
        self.abort = abort
        self.api_key = api_key
        self.response_len = response_len
        self.routing = routing  # (num_layers, topk, num_experts) of the "model", or None: flag off
        self.routing_extra_positions = routing_extra_positions  # added to the P + R - 1 positions sent
        self.respond = respond  # (input_ids, sampling_params) -> (output_ids, finish type), or None
        self.drop_reused = drop_reused  # close a kept-alive connection when a second request comes on it
        self.dropped = 0
        self.received: list[dict] = []  # every /generate payload that arrived
        self.answered = 0  # answers delivered
        self.connections = 0  # TCP connections accepted
        self.dead = False
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def __aenter__(self) -> "FakeSGLang":
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        """Stop listening and drop every open connection without an answer (a crashed server)."""
        self.dead = True
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.connections += 1
        served = 0
        try:
            while not self.dead:
                head = await reader.readuntil(b"\r\n\r\n")
                if self.drop_reused and served:  # as a server that closed the idle connection meanwhile
                    self.dropped += 1
                    return
                served += 1
                lines = head.decode().split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                status, answer = await self._answer(lines[0], headers, body)
                if self.dead:
                    return
                data = json.dumps(answer).encode()
                writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
                if status == 200:
                    self.answered += 1  # delivered, not just computed
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _answer(self, request_line: str, headers: dict, body: bytes):
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            return 401, {"error": "Unauthorized"}
        if request_line.startswith("GET /get_model_info"):
            return 200, {"weight_version": self.name}
        if request_line.startswith(("POST /begin_weight_update", "POST /end_weight_update")):
            return 200, {"success": True}
        if request_line.startswith(("POST /update_weights_from_disk", "POST /update_weights_from_tensor")):
            self.name = json.loads(body)["weight_version"]
            return 200, {"success": True}
        if not request_line.startswith("POST /generate"):
            return 404, {"error": "not found"}
        payload = json.loads(body)
        self.received.append(payload)
        if self.die_after is not None and len(self.received) > self.die_after:
            self.kill()
            return 500, {}
        if self.stall:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay_s)
        # One prompt with n samples, or (a batch, as SGLang takes one) prompts one after another with n each.
        batch = payload["input_ids"] if isinstance(payload["input_ids"][0], list) else [payload["input_ids"]]
        # sampling_params: one for all, or (a batch, as episodes' turns come) one per prompt
        per_prompt = payload["sampling_params"] if isinstance(payload["sampling_params"], list) \
            else [payload["sampling_params"]] * len(batch)
        n = per_prompt[0]["n"]
        samples = [prompt for prompt in batch for _ in range(n)]
        params_of = [params for params in per_prompt for _ in range(n)]
        items = []
        for k, prompt in enumerate(samples):
            i = k % n if n > 1 else batch[:k].count(prompt)  # the sample's index among its prompt's samples
            first = prompt[0]
            if self.respond is not None:
                ids, finish_type = self.respond(list(prompt), params_of[k])
                logprobs = [[-(t + 1) / 10, tok, None] for t, tok in enumerate(ids)]
                finish = {"type": finish_type}
                if self.abort:
                    finish = {"type": "abort", "message": "shutting down"}
                meta = {"id": f"{first}-{i}", "finish_reason": finish, "weight_version": self.name,
                        "output_token_logprobs": logprobs}
                items.append({"text": None, "output_ids": ids, "meta_info": meta})
                continue
            ids = [first * 100 + i * 10 + t for t in range(self.response_len)]
            logprobs = [[None if self.null_logprob and t == 1 else -0.5, tok, None] for t, tok in enumerate(ids)]
            if self.short_logprobs:
                logprobs = logprobs[:-1]
            finish = {"type": "abort", "message": "shutting down"} if self.abort else {"type": "length", "length": 3}
            meta = {"id": f"{first}-{i}", "finish_reason": finish, "weight_version": self.name,
                    "output_token_logprobs": logprobs}
            if payload.get("return_routed_experts") and self.routing is not None:
                positions = len(prompt) + len(ids) - 1 + self.routing_extra_positions
                ids_TLk = fake_routing(positions, *self.routing, salt=i)
                # As SGLang's detokenizer encodes the int32 [T, L, k] tensor (detokenizer_manager.py:443).
                meta["routed_experts"] = base64.b64encode(ids_TLk.tobytes()).decode("utf-8")
            items.append({"text": f"{self.name}:{i}", "output_ids": ids, "meta_info": meta})
        return 200, items
