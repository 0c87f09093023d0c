"""Built-in reward functions (math on math-verify, exact_match, final_answer) and loading user functions."""
import random
import time

import pytest

from megatron_gspo.rewards import Unparsed
from megatron_gspo.rewards.verifiers import (BUILTIN, MAX_RESPONSE_CHARS, exact_match, final_answer,
                                             load_reward_fn, math_reward, parse_gold)
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
    assert load_reward_fn("final_answer") is final_answer
    assert set(BUILTIN) == {"math", "exact_match", "final_answer", "none"}
    assert load_reward_fn("none")(sample("anything", "7")) == 0.0   # episodes whose ep.add_reward gives all
    assert load_reward_fn("reward_fns:nan").__name__ == "nan"


@pytest.mark.parametrize("spec, message", [
    ("nosuch", r"expected a built-in \(exact_match, final_answer, math, none\) or 'package.module:function'"),
    ("reward_fns:", "expected a built-in"),
    (":nan", "expected a built-in"),
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
    ("reward_fns:missing", "module 'reward_fns' has no attribute 'missing'"),
    ("reward_fns:NOT_CALLABLE", r"reward_fns.NOT_CALLABLE is a int, not callable"),
])
def test_load_errors_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec)


WORKED = "ones: 7+5+0=12, write 2, carry 1\ntens: 3+4+1=8, write 8, carry 0\nanswer: 82"


@pytest.mark.parametrize("response, reward", [
    (WORKED, 1.0),
    ("answer: 82", 1.0),                      # the steps are not read
    ("  Answer:082 \r\n", 1.0),               # case, spaces, a leading zero, CRLF
    (WORKED.replace("answer: 82", "answer: 83"), 0.0),
    ("ones: 7+5+0=12, write 2, carry 1\nanswer: 12\nanswer: 82", 1.0),   # the last answer line counts
    ("answer: 82\nanswer: 12", 0.0),
    ("answer: -82", 0.0),
    ("answer: 82\nanswer: 820", 0.0),
])
def test_final_answer_reads_the_last_answer_line(response, reward):
    assert final_answer(sample(response, "82")) == reward


@pytest.mark.parametrize("response", [
    "", None, "82", "ones: 7+5+0=12, write 2, carry 1\ntens: 3+4+1=8, write 8, carry 0\n",
    "answer: ", "answer: eighty-two", "the answer: 82", "answer: 82 (I think)", "answer: 8 2", "answer: 8.2",
])
def test_final_answer_without_an_answer_line_is_unparsed(response):
    with pytest.raises(Unparsed, match="no line 'answer: N'"):
        final_answer(sample(response, "82"))


def test_final_answer_needs_an_integer_reference():
    for answer in (None, "", "eighty", "8.2"):
        with pytest.raises(ValueError, match="needs an integer answer"):
            final_answer(sample("answer: 82", answer))


def test_final_answer_on_garbage_and_huge_input_never_raises_anything_else():
    rng = random.Random(0)
    pieces = ["answer:", "answer: ", "\n", " ", "\t", "\r", "0", "7", "82", "-", "+", ":", "é", "\x00", "\ud800"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60))) for _ in range(2000)]
    texts += [bytes(rng.randrange(256) for _ in range(300)).decode("latin-1") for _ in range(200)]
    texts += ["answer: " + "9" * 100_000,                  # int() refuses > 4300 digits; no int() here
              "answer: " + "0" * 100_000 + "82",
              "answer: " * 200_000, "\n" * 1_000_000, "\n" + " " * 1_000_000 + "answer: 82",
              "answer: 82\n" + "x" * 1_000_000]       # the whole response is read, not only its tail
    start = time.perf_counter()
    outcomes = set()
    for text in texts:
        try:
            outcomes.add(final_answer(sample(text, "82")))
        except Unparsed:
            outcomes.add("unparsed")
    assert outcomes == {0.0, 1.0, "unparsed"}
    assert final_answer(sample(texts[-1], "82")) == final_answer(sample(texts[-2], "82")) == 1.0
    assert time.perf_counter() - start < 10.0
