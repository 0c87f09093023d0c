"""Reward functions `Sample -> float`: the built-ins and user functions named by import path.

Built-ins (by name):
- "math": Hugging Face math-verify. The reference answer and the response are parsed into SymPy
  (LaTeX, \\boxed{}, plain numbers, intervals, sets) and compared symbolically, so "\\boxed{0.5}"
  scores 1.0 against "\\frac{1}{2}" and "The answer is 7." against "7".
- "exact_match": the stripped response equals the stripped answer.
- "final_answer": the integer on the response's last "answer: N" line equals the (integer) answer; the
  steps before it are not read (the long_addition task, megatron_gspo/data/long_addition.py). A
  response without such a line raises `Unparsed`: 0, counted in reward/unparsed_fraction.
- "none": 0 for every sample: custom episodes that give every reward themselves (`ep.add_reward`).

A user function is named "package.module:function" and must take a `Sample` and return a number; it may
raise `megatron_gspo.rewards.Unparsed` when the response states no answer it can read (scored 0 and
counted as unparsed, not as an error).

Time limits: math-verify's own timeouts use SIGALRM, which works only in a process's main thread
and would fight the pool's deadline. They are turned off here (`parsing_timeout=None`,
`timeout_seconds=None`): `RewardPool` runs every call in a worker process and kills it past the
deadline. Calling `math_reward` directly therefore has no time limit: the bounded input
(`MAX_RESPONSE_CHARS`) keeps long responses cheap, but a short one such as "\\boxed{9^{9^{9^{9}}}}"
makes SymPy evaluate a power tower and never return. Score untrusted text through the pool, in
worker processes: `RewardPool(..., workers=0)` (no processes, no time limit) takes only the functions
of `BOUNDED`.
"""
from __future__ import annotations

import importlib
import logging
import re
from typing import Callable

from megatron_gspo.rewards import Unparsed
from megatron_gspo.samples import Sample

RewardFn = Callable[[Sample], float]

MAX_RESPONSE_CHARS = 10_000
"""math_reward parses only the last this-many characters of a response (the final answer is at the
end; a hostile 10^6-character response costs the same as a 10^4 one)."""

_ANSWER_LINE = re.compile(r"^[ \t]*answer:[ \t]*([+-]?[0-9]+)[ \t\r]*$", re.IGNORECASE | re.MULTILINE)
"""A whole line "answer: N" (N an integer; case and spaces around it free). No nested repetition: linear
time on any text, so final_answer reads whole responses (a 10^6-character one in milliseconds)."""


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeout is off; here that is intended (the pool
    enforces the deadline), so the warning would only be noise in every worker's stderr."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


def exact_match(sample: Sample) -> float:
    """1.0 when the stripped response equals the stripped reference answer, else 0.0."""
    if sample.answer is None:
        raise ValueError("exact_match needs the sample's answer")
    return float((sample.response_text or "").strip() == sample.answer.strip())


def parse_gold(answer: str) -> list:
    """The reference answer parsed by math-verify.

    A reference answer is usually bare LaTeX ("3\\sqrt{2}", "(1,2]", "\\{1,2\\}"). Parsed bare,
    math-verify's plain-expression extractor reads "3\\sqrt{2}" as 3 and finds nothing in "(1,2]",
    so an answer without its own "$" or "\\boxed" is parsed as "$answer$" first, then bare, then
    as "\\boxed{answer}"; the first that yields something wins.
    """
    import math_verify  # (see load_reward_fn)

    if "$" in answer or "\\boxed" in answer:
        candidates = (answer,)
    else:
        candidates = (f"${answer}$", answer, f"\\boxed{{{answer}}}")
    for text in candidates:
        gold = math_verify.parse(text, parsing_timeout=None)
        if gold:
            return gold
    raise ValueError(f"math reward: reference answer {answer!r} cannot be parsed by math-verify")


def math_reward(sample: Sample) -> float:
    """1.0 when math-verify finds the response's final answer equal to the reference answer, else 0.0."""
    import math_verify  # (see load_reward_fn)

    if sample.answer is None:
        raise ValueError("math reward needs the sample's answer")
    gold = parse_gold(sample.answer)
    prediction = math_verify.parse((sample.response_text or "")[-MAX_RESPONSE_CHARS:], parsing_timeout=None)
    if not prediction:
        return 0.0
    return float(math_verify.verify(gold, prediction, timeout_seconds=None))


def _integer(text: str) -> str:
    """The canonical spelling of an integer literal ("+007" -> "7", "-0" -> "0"), without int(): Python
    refuses int() of more than 4300 digits, and a response may hold any number of them."""
    digits = text.lstrip("+-").lstrip("0") or "0"
    return "-" + digits if text.startswith("-") and digits != "0" else digits


def final_answer(sample: Sample) -> float:
    """1.0 when the integer on the response's last "answer: N" line equals the sample's answer, else 0.0.

    Only that line is read ("ones: 7+5+0=12, ...\\nanswer: 82" and "answer: 082" both state 82). Raises
    Unparsed when no line of the response is "answer: N", and ValueError when the sample's answer is not
    an integer (the data, not the response, is wrong).
    """
    if sample.answer is None or not re.fullmatch(r"[+-]?[0-9]+", sample.answer.strip()):
        raise ValueError(f"final_answer needs an integer answer, got {sample.answer!r}")
    stated = _ANSWER_LINE.findall(sample.response_text or "")
    if not stated:
        raise Unparsed("no line 'answer: N' in the response")
    return float(_integer(stated[-1]) == _integer(sample.answer.strip()))


def no_reward(sample: Sample) -> float:
    """0.0: no outcome reward, for custom episodes whose rewards all come from `ep.add_reward` (reward.fn=none)."""
    return 0.0


BUILTIN: dict[str, RewardFn] = {"math": math_reward, "exact_match": exact_match, "final_answer": final_answer,
                                "none": no_reward}

BOUNDED = frozenset({"exact_match", "final_answer", "none"})
"""The built-ins whose time is linear in the response (a string compare; one regular expression without
nested repetition; a constant): the only functions a RewardPool scores in the caller's thread (workers=0), where no
time limit can be enforced. Not "math": SymPy can run forever on a short response (see the module doc)."""


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name (BUILTIN) or a user function "package.module:function"."""
    if spec == "math":
        # Imported here, not with this module: SymPy takes ~1 s (2 s on a loaded machine) to import, which
        # a worker of another function would pay at every start, e.g. when it replaces one killed past its
        # time limit; a math worker pays it at start-up, outside its first sample's time limit.
        import math_verify  # noqa: F401
    if spec in BUILTIN:
        return BUILTIN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected a built-in ({', '.join(sorted(BUILTIN))}) "
                         f"or 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module's own code failing on import
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: "
                         f"{type(e).__name__}: {e}") from e
    if not hasattr(module, attr):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name}.{attr} is a {type(fn).__name__}, not callable")
    return fn
