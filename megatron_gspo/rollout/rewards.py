"""Reward functions: `Sample -> float`, built-ins and user functions by import path.

Built-ins (by name): "exact_match" and "math" (a numeric verifier). A user function is named
"package.module:function". `score_samples` calls the function on every sample with a time limit; a
function that raises, hangs or returns something other than a finite number stops scoring with an
error naming the function and the sample.

The math verifier never evaluates model text: it extracts a number with linear-time regular
expressions from a bounded tail of the response and parses it with `fractions.Fraction` after
checking its size, so a hostile response ("1e999999999", 10^6 digits, nested braces) cannot make
it slow or large.
"""
from __future__ import annotations

import importlib
import math
import queue
import re
import threading
from fractions import Fraction
from typing import Callable, Sequence

from megatron_gspo.samples import Sample

RewardFn = Callable[[Sample], float]

MAX_TEXT_CHARS = 10_000
"""The verifier reads only the last this-many characters of a response."""
MAX_NUMBER_CHARS = 100
"""Longer numbers are not parsed (no answer we grade has more digits)."""
MAX_EXPONENT = 100
"""|exponent| above this in "1e..." is rejected: Fraction would build a huge integer."""


class RewardError(RuntimeError):
    """A reward function failed on a sample; the message names both."""


def exact_match(sample: Sample) -> float:
    """1.0 when the stripped response equals the stripped reference answer."""
    if sample.answer is None:
        raise ValueError("exact_match needs the sample's answer")
    return float((sample.response_text or "").strip() == sample.answer.strip())


_NUMBER = r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?(?:\s*/\s*[-+]?\d+(?:\.\d*)?)?"
_NUMBER_RE = re.compile(_NUMBER)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_FRAC_RE = re.compile(r"^\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}$")


def parse_number(text: str) -> Fraction | None:
    """"3", "-0.25", "1e3", "3/4", "\\frac{3}{4}", "1,000" -> exact Fraction; anything else -> None."""
    text = text.strip().strip("$").strip().rstrip(".").replace(",", "").replace(" ", "")
    if not text or len(text) > MAX_NUMBER_CHARS:
        return None
    frac = _FRAC_RE.match(text)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return None if num is None or den is None or den == 0 else num / den
    if not _NUMBER_RE.fullmatch(text):
        return None
    if "/" in text:
        num, den = (parse_number(part) for part in text.split("/", 1))
        return None if num is None or den is None or den == 0 else num / den
    mantissa, _, exponent = text.lower().partition("e")
    if exponent and abs(int(exponent)) > MAX_EXPONENT:
        return None
    return Fraction(mantissa) * Fraction(10) ** int(exponent or 0)


def last_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} (balanced braces), or None."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):  # one pass: linear time
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(text: str) -> Fraction | None:
    r"""The final numeric answer: the last \boxed{} if there is one, else the last number in the text."""
    text = text[-MAX_TEXT_CHARS:]
    boxed = last_boxed(text)
    if boxed is not None:
        return parse_number(boxed)
    numbers = _NUMBER_RE.findall(text)
    return parse_number(numbers[-1]) if numbers else None


def math_verify(sample: Sample) -> float:
    """1.0 when the response's final number equals the reference answer numerically (exact
    rationals: "0.5" == "1/2" == "\\frac{1}{2}"), else 0.0; an unparsable reference is an error."""
    if sample.answer is None:
        raise ValueError("math verifier needs the sample's answer")
    expected = extract_answer(sample.answer)
    if expected is None:
        raise ValueError(f"reference answer {sample.answer!r} is not a number")
    got = extract_answer(sample.response_text or "")
    return float(got is not None and got == expected)


BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "math": math_verify}


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name ("exact_match", "math") or an import path "package.module:function"."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward {spec!r}: expected one of {sorted(BUILTIN_REWARDS)} or 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no callable {attr!r}")
    return fn


def _describe(fn: RewardFn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _describe_sample(sample: Sample) -> str:
    text = (sample.response_text or "")[:80]
    return f"group {sample.group_id} sample {sample.sample_index} (response {text!r})"


def score_samples(samples: Sequence[Sample], reward_fn: RewardFn, timeout_s: float = 10.0) -> list[float]:
    """Call reward_fn on each sample (in a worker thread, with a per-sample time limit); set and
    return the rewards.

    A hung function cannot be killed from Python: its daemon thread is abandoned and RewardError
    raised, so the run stops with a clear message instead of waiting forever.
    """
    requests: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()

    def worker():
        while (item := requests.get()) is not None:
            try:
                results.put((True, reward_fn(item)))
            except BaseException as e:  # handed to the caller with the sample named
                results.put((False, e))

    threading.Thread(target=worker, daemon=True, name="reward-worker").start()
    rewards = []
    try:
        for sample in samples:
            requests.put(sample)
            try:
                ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise RewardError(f"reward function {_describe(reward_fn)} did not return within "
                                  f"{timeout_s:g} s on {_describe_sample(sample)}") from None
            if not ok:
                raise RewardError(f"reward function {_describe(reward_fn)} raised "
                                  f"{type(value).__name__}: {value} on {_describe_sample(sample)}") from value
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardError(f"reward function {_describe(reward_fn)} returned {value!r} (need a finite "
                                  f"number) on {_describe_sample(sample)}")
            sample.reward = float(value)
            rewards.append(float(value))
    finally:
        requests.put(None)
    return rewards
