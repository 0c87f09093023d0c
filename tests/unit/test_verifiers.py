"""Built-in reward functions (math on math-verify, exact_match) and loading user functions."""
import time

import pytest

from megatron_gspo.rewards.verifiers import (BUILTIN, MAX_RESPONSE_CHARS, exact_match, load_reward_fn,
                                             math_reward, parse_gold)
from megatron_gspo.samples import Sample


def sample(response, answer="7"):
    return Sample(group_id=0, sample_index=0, prompt_ids=[], response_ids=[], rollout_logprobs=[],
                  finish_reason="stop", response_text=response, answer=answer)


@pytest.mark.parametrize("answer, response", [
    ("7", "The answer is 7."),
    ("7", "so \\boxed{7}"),
    ("7", "First I got 3, then 7. Final answer: \\boxed{7}"),
    ("\\frac{1}{2}", "\\boxed{0.5}"),
    ("0.5", "the answer is $\\frac{1}{2}$"),
    ("2/3", "\\boxed{\\frac{2}{3}}"),
    ("-3", "\\boxed{-3}"),
    ("1,000", "\\boxed{1000}"),
    ("3\\sqrt{2}", "\\boxed{\\sqrt{18}}"),   # bare "3\sqrt{2}" would parse as 3: gold goes through $...$
    ("x^2+1", "\\boxed{1 + x^2}"),
    ("(1,2]", "the solution set is \\boxed{(1,2]}"),
    ("\\{1,2\\}", "\\boxed{\\{2, 1\\}}"),    # sets: order does not matter
    ("$5$", "5"),
])
def test_math_equivalent_answers_score_one(answer, response):
    assert math_reward(sample(response, answer)) == 1.0


@pytest.mark.parametrize("answer, response", [
    ("7", "The answer is 8."),
    ("7", ""),
    ("7", "I do not know"),
    ("\\frac{1}{2}", "\\boxed{0.49}"),
    ("3\\sqrt{2}", "\\boxed{3}"),
    ("(1,2]", "\\boxed{[1,2]}"),          # closed vs half-open interval
    ("\\{1,2\\}", "\\boxed{\\{1,2,3\\}}"),
    ("7", "\\boxed{7} no wait, \\boxed{5}"),  # the last boxed answer counts
])
def test_math_wrong_answers_score_zero(answer, response):
    assert math_reward(sample(response, answer)) == 0.0


def test_math_needs_a_parsable_answer():
    with pytest.raises(ValueError, match="needs the sample's answer"):
        math_reward(sample("7", answer=None))
    with pytest.raises(ValueError, match="reference answer '' cannot be parsed"):
        parse_gold("")


def test_math_reads_only_the_tail_of_a_long_response():
    # The final answer sits in the last MAX_RESPONSE_CHARS: found; an answer before them is not read.
    filler = "blah " * (MAX_RESPONSE_CHARS // 5 + 100)
    assert math_reward(sample(filler + "\\boxed{7}")) == 1.0
    assert math_reward(sample("\\boxed{7}" + filler)) == 0.0
    start = time.perf_counter()
    math_reward(sample("1" * 1_000_000))          # a 10^6-digit number: only its tail is parsed
    math_reward(sample("{" * 100_000 + "7" + "}" * 100_000))
    assert time.perf_counter() - start < 5.0


def test_exact_match():
    assert exact_match(sample("  Paris \n", "Paris")) == 1.0
    assert exact_match(sample("paris", "Paris")) == 0.0
    assert exact_match(sample(None, "")) == 1.0      # no text is the empty string
    with pytest.raises(ValueError, match="needs the sample's answer"):
        exact_match(sample("x", None))


def test_load_builtins_and_user_functions():
    assert load_reward_fn("math") is math_reward and load_reward_fn("exact_match") is exact_match
    assert set(BUILTIN) == {"math", "exact_match"}
    assert load_reward_fn("reward_fns:nan").__name__ == "nan"


@pytest.mark.parametrize("spec, message", [
    ("nosuch", r"expected a built-in \(exact_match, math\) or 'package.module:function'"),
    ("reward_fns:", "expected a built-in"),
    (":nan", "expected a built-in"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
    ("reward_fns:missing", "module 'reward_fns' has no attribute 'missing'"),
    ("reward_fns:NOT_CALLABLE", r"reward_fns.NOT_CALLABLE is a int, not callable"),
])
def test_load_errors_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)
