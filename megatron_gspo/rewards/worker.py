"""A worker process of the pool (rewards/pool.py): `python -m megatron_gspo.rewards.worker HANDLER [ARGS ...]`.

Started by `WorkerPool` with pipes on stdin/stdout. HANDLER names a factory, `package.module:function`,
that the worker calls once with ARGS to get the function answering each request (`reward_handler` below for
the reward pool: ARGS is the reward function's spec; rollout/agent/tools.py `tool_handler` for the tools).
It answers a handshake, then one request at a time until stdin closes. Messages both ways are
length-prefixed pickles (`write_message` / `read_message`):

    worker -> parent, once:   ("ready", pid)  or  ("load_error", message)   (then it exits)
    parent -> worker:         a request (reward pool: a Sample)
    worker -> parent:         the handler's reply (status, payload), e.g. ("ok", value)

The reward handler: a function raising `megatron_gspo.rewards.Unparsed` (the response states no answer it
can read) is an ("unparsed", detail) reply, scored 0 and counted apart from errors. Any other Python
exception, a non-number or a non-finite number is an ("error", detail) reply and the worker goes on; hangs
and crashes are the parent's business (it kills and replaces the process).

Imports stay light (no torch, no Megatron: `megatron_gspo/__init__.py` is empty), so a worker
starts in a fraction of a second. The function's own prints go to stderr: fd 1 is the protocol
pipe and is moved away from the function before it is loaded.
"""
from __future__ import annotations

import importlib
import math
import numbers
import os
import pickle
import struct
import sys
from typing import BinaryIO, Callable

# Imported, not defined here: run as `python -m`, this file is `__main__`, and a class defined in it
# would not be the one reward functions raise.
from megatron_gspo.rewards import Unparsed

_LENGTH = struct.Struct("<Q")


def write_message(stream: BinaryIO, obj) -> None:
    """One pickled object, preceded by its length (8 bytes, little-endian)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def read_message(stream: BinaryIO):
    """The next object from `write_message`; EOFError when the stream ends (cleanly or mid-message)."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError("stream closed")
    (size,) = _LENGTH.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError(f"stream closed after {len(data)} of {size} bytes")
    return pickle.loads(data)


def score_one(fn, sample) -> tuple[str, float | str]:
    """("ok", value) for a finite real number, ("unparsed", message) when `fn` raises Unparsed, else
    ("error", what went wrong)."""
    try:
        value = fn(sample)
    except Unparsed as e:
        return "unparsed", str(e)
    except Exception as e:
        return "error", f"raised {type(e).__name__}: {e}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "error", f"returned {value!r} of type {type(value).__name__} (need a number)"
    if not math.isfinite(value):
        return "error", f"returned {value!r} (need a finite number)"
    return "ok", float(value)


def reward_handler(args: list[str]) -> Callable:
    """The reward pool's handler: args = [FN_SPEC]; each request is a Sample, each reply `score_one`'s."""
    from megatron_gspo.rewards.verifiers import load_reward_fn  # math-verify: imported by the worker only
    (fn_spec,) = args
    fn = load_reward_fn(fn_spec)
    return lambda sample: score_one(fn, sample)


def load_handler(spec: str, args: list[str]) -> Callable:
    """The request handler the factory `spec` ("package.module:function") makes of `args`."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)(args)


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print("usage: python -m megatron_gspo.rewards.worker HANDLER [ARGS ...]", file=sys.stderr)
        return 2
    # The protocol gets a private copy of the stdout pipe; fd 1 becomes stderr so that a reward
    # function's (or a tool's) print() cannot corrupt the message stream.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    try:
        handle = load_handler(argv[0], argv[1:])
    except Exception as e:
        write_message(out, ("load_error", f"{type(e).__name__}: {e}"))
        return 1
    write_message(out, ("ready", os.getpid()))
    while True:
        try:
            request = read_message(inp)
        except EOFError:  # the pool closed our stdin: done
            return 0
        write_message(out, handle(request))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
