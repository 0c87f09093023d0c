"""A reward worker process: `python -m megatron_gspo.rewards.worker FN_SPEC`.

Started by `RewardPool` with pipes on stdin/stdout. It loads the reward function once, answers a
handshake, then scores one sample per request until stdin closes. Messages both ways are
length-prefixed pickles (`write_message` / `read_message`):

    worker -> parent, once:   ("ready", pid)  or  ("load_error", message)   (then it exits)
    parent -> worker:         Sample
    worker -> parent:         ("ok", value)  or  ("unparsed", detail)  or  ("error", detail)

A function raising `megatron_gspo.rewards.Unparsed` (the response states no answer it can read) is an
"unparsed" reply, scored 0 and counted apart from errors. Any other Python exception, a non-number or a
non-finite number is an "error" reply and the worker goes on; hangs and crashes are the parent's business
(it kills and replaces the process).

Imports stay light (no torch, no Megatron: `megatron_gspo/__init__.py` is empty), so a worker
starts in a fraction of a second. The function's own prints go to stderr: fd 1 is the protocol
pipe and is moved away from the function before it is loaded.
"""
from __future__ import annotations

import math
import numbers
import os
import pickle
import struct
import sys
from typing import BinaryIO

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


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m megatron_gspo.rewards.worker FN_SPEC", file=sys.stderr)
        return 2
    # The protocol gets a private copy of the stdout pipe; fd 1 becomes stderr so that a reward
    # function's print() cannot corrupt the message stream.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    try:
        from megatron_gspo.rewards.verifiers import load_reward_fn
        fn = load_reward_fn(argv[0])
    except Exception as e:
        write_message(out, ("load_error", f"{type(e).__name__}: {e}"))
        return 1
    write_message(out, ("ready", os.getpid()))
    while True:
        try:
            sample = read_message(inp)
        except EOFError:  # the pool closed our stdin: done
            return 0
        write_message(out, score_one(fn, sample))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
