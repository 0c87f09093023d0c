"""Reward functions: math verifier (incl. hostile text), exact match, loading, failures named."""
import time
from fractions import Fraction

import pytest

from megatron_gspo.rollout.rewards import (RewardError, exact_match, extract_answer, load_reward_fn, math_verify,
                                           parse_number, score_samples)
from megatron_gspo.samples import Sample


def sample(text, answer="12", group_id=0, index=0):
    return Sample(group_id=group_id, sample_index=index, prompt_ids=[1], response_ids=[], rollout_logprobs=[],
                  finish_reason="stop", response_text=text, answer=answer)


@pytest.mark.parametrize("text,expected", [
    ("so the answer is 12", Fraction(12)),
    (r"first 3 then \boxed{12} and later 7", Fraction(12)),     # boxed wins over the last number
    (r"\boxed{\frac{3}{4}}", Fraction(3, 4)),
    (r"\boxed{ {1}/{2} }", None),                                 # braces inside a number: not parsed
    ("0.75", Fraction(3, 4)),
    ("-2.50", Fraction(-5, 2)),
    ("3/4", Fraction(3, 4)),
    ("1,000", Fraction(1000)),
    ("1.5e3", Fraction(1500)),
    ("no number here", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("response,answer,reward", [
    ("5+7=12", "12", 1.0), ("12.0", "12", 1.0), ("1/2", "0.5", 1.0), (r"\boxed{\dfrac{1}{2}}", "1/2", 1.0),
    ("13", "12", 0.0), ("", "12", 0.0), ("twelve", "12", 0.0), ("1/0", "12", 0.0),
])
def test_math_verify(response, answer, reward):
    assert math_verify(sample(response, answer)) == reward


@pytest.mark.parametrize("hostile", [
    "1e999999999",                        # Fraction would build a 10^9-digit integer
    "9" * 1_000_000,                      # a million digits
    r"\boxed{" * 100_000,                 # unbalanced, deeply nested
    "1" + " " * 200_000 + "x",            # long whitespace run after a number
    "__import__('os').system('echo pwned')",
])
def test_hostile_responses_are_fast_and_never_evaluated(hostile):
    start = time.perf_counter()
    assert math_verify(sample(hostile, "12")) == 0.0
    assert time.perf_counter() - start < 0.5


def test_parse_number_bounds():
    assert parse_number("1e100") == 10 ** 100 and parse_number("1e101") is None
    assert parse_number("1" * 101) is None


def test_exact_match():
    assert exact_match(sample(" 12\n", "12")) == 1.0 and exact_match(sample("12.0", "12")) == 0.0


def test_load_reward_fn():
    assert load_reward_fn("math") is math_verify
    assert load_reward_fn("megatron_gspo.rollout.rewards:exact_match") is exact_match
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        load_reward_fn("no_such_mod:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_reward_fn("megatron_gspo.rollout.rewards:nope")
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("mathh")


def boom(s):
    raise KeyError("missing")


def hang(s):
    time.sleep(30)


def test_score_samples_sets_rewards():
    samples = [sample("12"), sample("11", index=1)]
    assert score_samples(samples, math_verify) == [1.0, 0.0]
    assert [s.reward for s in samples] == [1.0, 0.0]


def test_raising_reward_names_function_and_sample():
    with pytest.raises(RewardError, match=r"test_rewards:boom raised KeyError.*group 4 sample 2 \(response 'hi'\)"):
        score_samples([sample("hi", group_id=4, index=2)], boom)


def test_hanging_reward_times_out_with_names():
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"test_rewards:hang did not return within 0.2 s on group 1 sample 0"):
        score_samples([sample("x", group_id=1)], hang, timeout_s=0.2)
    assert time.perf_counter() - start < 2


@pytest.mark.parametrize("value", [float("nan"), None, "1"])
def test_non_numeric_reward_is_an_error(value):
    with pytest.raises(RewardError, match="need a finite number"):
        score_samples([sample("x")], lambda s: value)
