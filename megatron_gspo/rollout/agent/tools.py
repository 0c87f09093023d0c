"""Tools (rollout.tools): Python functions the model calls, run in sandboxed worker processes.

    tools = ToolBox(["my_pkg.tools:calculator"], workers=2, timeout_s=10)   # schemas + worker pool
    tools.schemas                     # JSON schemas for apply_chat_template(..., tools=...)
    calls = parse_tool_calls(text)    # Qwen3's <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    result, error = await tools.call(name, arguments)

- Schema: transformers' `get_json_schema(fn)`, from the signature's type hints and the Google-style docstring
  (a description line and an `Args:` entry per parameter; it raises otherwise, caught at start-up).
- Parser (rollout.tool_parser=qwen3): each `<tool_call>...</tool_call>` block of a model turn is one call
  whose body is JSON `{"name": str, "arguments": {...}}` (arguments given as a JSON string are parsed too, as
  Qwen's own parser does). The format of Qwen3, Qwen2.5 and Hermes-style models.
- Execution: one request per call to a pool of worker processes (rewards/pool.py's WorkerPool, the reward
  pool's kind) running `tool_handler`: a call past rollout.tool_timeout_s has its worker killed and replaced.

Every way a call can fail becomes an error message to the model (`"Error: " + detail`, as the tool's
message) and is counted (rollout/tool_errors), never a stuck or crashed run:

    malformed JSON or no "name"/"arguments"   "malformed tool call: ..."
    an unknown tool name                      "unknown tool 'x' (tools: calculator)"
    the tool raises                           "calculator raised ValueError: ..."  (also wrong arguments: TypeError)
    it returns a non-string                   "calculator returned int, not a string"
    it hangs past the time limit              "calculator timed out after 10 s"
    its process dies (os._exit, segfault)     "calculator crashed (worker died (exit code -11, SIGSEGV))"

Nothing here imports torch or transformers at module level: the worker processes import this module (for
`tool_handler`) and start in a fraction of a second.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megatron_gspo.rewards.pool import WorkerPool

TOOL_HANDLER = "megatron_gspo.rollout.agent.tools:tool_handler"

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


class ToolError(RuntimeError):
    """The tools cannot be loaded (the message names the spec and why)."""


def load_function(spec: str, what: str) -> Callable:
    """The function `package.module:function` names; ValueError naming `what` (e.g. "rollout.tools") if not."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what}: {spec!r} must be 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own code failing on import
        raise ValueError(f"{what}: {spec!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{what}: {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def tool_schemas(specs: Sequence[str]) -> list[dict]:
    """The JSON schema of each tool (transformers' get_json_schema), in order; ValueError naming the tool whose
    docstring or type hints do not give one, or when two tools share a name."""
    from transformers.utils import get_json_schema  # the trainer's side only: workers never import transformers

    schemas, names = [], set()
    for spec in specs:
        fn = load_function(spec, "rollout.tools")
        try:
            schema = get_json_schema(fn)
        except Exception as e:
            raise ValueError(f"rollout.tools: {spec!r}: no JSON schema from its signature and docstring "
                             f"({type(e).__name__}: {e}); it needs type hints and a Google-style docstring with an "
                             "Args: entry per parameter") from None
        name = schema["function"]["name"]
        if name in names:
            raise ValueError(f"rollout.tools: two tools are named {name!r}")
        names.add(name)
        schemas.append(schema)
    return schemas


# ---- parsing ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParsedCall:
    """One `<tool_call>` block of a model turn: a name and arguments, or why it could not be read."""

    name: str | None
    arguments: Any
    """The arguments (a dict) when the call parsed, else the block's raw text."""
    error: str | None = None


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """The tool calls of a model turn's text, in order (rollout.tool_parser=qwen3, module doc). A `<tool_call>`
    left open at the end of the text is one malformed call."""
    calls = [_parse_body(m.group(1)) for m in _CALL.finditer(text)]
    tail = text[text.rfind("</tool_call>") + len("</tool_call>"):] if "</tool_call>" in text else text
    if _OPEN in tail:
        calls.append(ParsedCall(None, tail[tail.index(_OPEN) + len(_OPEN):],
                                "malformed tool call: <tool_call> without </tool_call>"))
    return calls


def _parse_body(body: str) -> ParsedCall:
    expected = 'expected {"name": "...", "arguments": {...}}'
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ParsedCall(None, body.strip(), f"malformed tool call: not JSON ({e.msg} at column {e.colno}); {expected}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ParsedCall(None, body.strip(), f"malformed tool call: no tool name; {expected}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ParsedCall(call["name"], body.strip(), f"malformed tool call: arguments must be an object; {expected}")
    return ParsedCall(call["name"], arguments)


# ---- running ------------------------------------------------------------------------------------------

def tool_handler(specs: list[str]) -> Callable:
    """The worker processes' handler (rewards/worker.py): loads the tools once; each request (name, arguments)
    is answered ("ok", result string) or ("error", what went wrong)."""
    tools = {}
    for spec in specs:
        fn = load_function(spec, "rollout.tools")
        tools[fn.__name__] = fn

    def handle(request) -> tuple[str, str]:
        name, arguments = request
        if name not in tools:
            return "error", f"unknown tool {name!r}"
        try:
            result = tools[name](**arguments)
        except Exception as e:
            return "error", f"{name} raised {type(e).__name__}: {e}"
        if not isinstance(result, str):
            return "error", f"{name} returned {type(result).__name__}, not a string"
        return "ok", result
    return handle


class ToolBox:
    """The run's tools: their schemas and the worker pool that runs them (rank 0 of an SGLang run)."""

    def __init__(self, specs: Sequence[str], *, workers: int = 2, timeout_s: float = 10.0):
        self.specs = list(specs)
        self.schemas = tool_schemas(self.specs)
        self.names = [s["function"]["name"] for s in self.schemas]
        self.timeout_s = timeout_s
        self._pool = WorkerPool(TOOL_HANDLER, self.specs, what=f"rollout.tools {self.specs}", workers=workers,
                                timeout_s=timeout_s, error=ToolError)

    async def call(self, name: str, arguments: dict) -> tuple[str | None, str | None]:
        """(result, None) or (None, error detail) of one call (module doc)."""
        if name not in self.names:
            return None, f"unknown tool {name!r} (tools: {', '.join(self.names)})"
        (future,) = self._pool.submit([(name, arguments)])
        status, payload = await asyncio.wrap_future(future)
        if status == "ok":
            return payload, None
        if status == "timeout":
            return None, f"{name} timed out after {self.timeout_s:g} s"
        if status == "died":
            return None, f"{name} crashed ({payload})"
        return None, payload

    @property
    def replacements(self) -> int:
        """Workers killed (timeouts) or dead (crashes) and replaced so far."""
        return self._pool.replacements

    def worker_pids(self) -> list[int]:
        return self._pool.worker_pids()

    def close(self) -> None:
        self._pool.close()


def error_message(detail: str) -> str:
    """The tool message the model gets for a failed call."""
    return f"Error: {detail}"


async def tool_episode(ep) -> None:
    """The built-in episode of rollout.tools: the model writes a turn; each tool call in it runs and its result
    goes back as a `tool` message; the model writes the next turn; ... until a turn makes no call, ends other
    than by its stop token (max_new_tokens), or rollout.max_turns turns were written (the last turn's calls
    are then not run: no turn would read their results)."""
    while True:
        turn = await ep.generate()
        calls = parse_tool_calls(turn.text)
        if not calls or turn.finish_reason != "stop" or ep.turns_left == 0:
            return
        ep.append_messages(await ep.call_tools(calls))
