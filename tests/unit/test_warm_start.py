"""The long_addition (and long_addition_mixed) format warm start and cold start (megatron_gspo/dev/warm_start.py)
on the tiny dense and MoE models."""
import hashlib
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_gspo.cli import main as cli_main
from megatron_gspo.data.long_addition import (PROBLEMS, mixed_width, mixed_worked_response, split_mixed_problems,
                                              split_problems, worked_response)
from megatron_gspo.dev import warm_start
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
from megatron_gspo.dev.warm_start import _score, greedy_responses, warm_start_long_addition


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def greedy_format_rate_and_accuracy(hf_dir, problems):
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    texts = greedy_responses(model, tok, [f"{a}+{b}=" for a, b in problems], max_new_tokens=96)
    scores = [_score(text, str(a + b)) for text, (a, b) in zip(texts, problems)]
    return sum(s is not None for s in scores) / len(scores), sum(s == 1.0 for s in scores) / len(scores)


@pytest.mark.parametrize("experts", [0, 4])   # dense Qwen3, Qwen3-MoE (`tiny-model --moe`)
def test_warm_start_trains_and_saves_in_place(tmp_path, experts):
    hf = make_tiny_qwen3(tmp_path / "hf", TinyQwen3Spec(num_experts=experts))
    before, threads = digest(hf), torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        format_rate, accuracy = warm_start_long_addition(hf, steps=2, batch_size=4, check_prompts=2)
        assert torch.get_num_threads() == 3   # it trains on one thread, then gives the caller's setting back
    finally:
        torch.set_num_threads(threads)
    assert 0.0 <= accuracy <= format_rate <= 1.0
    assert digest(hf) != before


@pytest.mark.slow
def test_warm_start_teaches_the_format_and_no_answers(tmp_path):
    # ~20 s on 2 shared cores. A random model states no answer; 100 small steps later nearly every greedy
    # response is an "answer: NN" line, and right only about 1 time in 100 (the targets' digits are random).
    hf = make_tiny_qwen3(tmp_path / "hf")
    problems = random.Random(5).sample(PROBLEMS, 32)
    assert greedy_format_rate_and_accuracy(hf, problems) == (0.0, 0.0)
    warm_start_long_addition(hf, steps=100, batch_size=16, check_prompts=8)
    format_rate, accuracy = greedy_format_rate_and_accuracy(hf, problems)
    assert format_rate >= 0.9 and accuracy <= 0.1


def drawn_examples(monkeypatch, hf, count, **kwargs):
    """The (prompt, target) texts warm_start_long_addition would train on: its _fit replaced by a recorder."""
    tok = AutoTokenizer.from_pretrained(hf)
    drawn = []

    def record(model, examples, **_):
        for _ in range(count):
            prompt_ids, target_ids = examples()
            drawn.append((tok.decode(prompt_ids), tok.decode(target_ids, skip_special_tokens=True)))

    monkeypatch.setattr(warm_start, "_fit", record)
    warm_start_long_addition(hf, check_prompts=2, **kwargs)
    return drawn


def problem(prompt):
    """(a, b) of a drawn prompt "a+b="."""
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


def test_cold_start_shows_correct_responses_of_training_problems_only(tmp_path, monkeypatch):
    hf = make_tiny_qwen3(tmp_path / "hf")
    train, test = map(set, split_problems())

    cold = drawn_examples(monkeypatch, hf, 400, correct_fraction=1.0)
    assert all(problem(p) in train and t == worked_response(*problem(p)) for p, t in cold)
    half = drawn_examples(monkeypatch, hf, 400, correct_fraction=0.5)
    correct = [(p, t) for p, t in half if t == worked_response(*problem(p))]
    assert 150 < len(correct) < 250 and all(problem(p) in train for p, _ in correct)
    # the format warm start: random digits on any problem (a right one by chance ~1 in 100: answer and steps)
    fmt = drawn_examples(monkeypatch, hf, 400)
    assert sum(t == worked_response(*problem(p)) for p, t in fmt) <= 2
    assert any(problem(p) in test for p, _ in fmt)
    with pytest.raises(ValueError, match="correct_fraction must be in"):
        warm_start_long_addition(hf, correct_fraction=1.5)


def test_mixed_cold_start_shows_training_problems_of_every_width_and_checks_held_out_ones(tmp_path, monkeypatch):
    # long_addition_mixed: the cold start draws correct responses of its own training split (all four widths),
    # the format warm start random-digit responses of the right width; the greedy check runs prompts of
    # different token lengths (one batch per length) and keeps their order
    hf = make_tiny_qwen3(tmp_path / "hf")
    train, test = map(set, split_mixed_problems())

    cold = drawn_examples(monkeypatch, hf, 400, correct_fraction=1.0, task="long_addition_mixed")
    assert all(problem(p) in train and t == mixed_worked_response(*problem(p)) for p, t in cold)
    assert {mixed_width(*problem(p)) for p, _ in cold} == {1, 2, 3, 4}
    fmt = drawn_examples(monkeypatch, hf, 200, task="long_addition_mixed")
    assert all(t.count("\n") == mixed_width(*problem(p)) for p, t in fmt)       # one line per column + answer
    with pytest.raises(ValueError, match="task must be one of"):
        warm_start_long_addition(hf, task="long_subtraction")
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    prompts = ["7+5=", "1234+5678=", "37+45=", "8+1="]
    assert len({len(tok(p)["input_ids"]) for p in prompts}) > 1
    together = greedy_responses(model, tok, prompts, max_new_tokens=8)
    assert together == [greedy_responses(model, tok, [p], max_new_tokens=8)[0] for p in prompts]


def test_tiny_model_cli_refuses_a_cold_start_without_its_task(tmp_path):
    with pytest.raises(SystemExit, match="--cold-start 200 needs --warm-start long_addition"):
        cli_main(["tiny-model", str(tmp_path / "hf"), "--warm-start", "arithmetic", "--cold-start", "200"])
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_cold_start_teaches_answers_to_held_out_problems(tmp_path):
    # ~60 s on 2 shared cores. The format warm start leaves greedy answers at chance; 250 steps on correct
    # worked responses of training problems (measured: 89% of the 200 held-out problems right, greedy).
    hf = make_tiny_qwen3(tmp_path / "hf")
    format_rate, accuracy = warm_start_long_addition(hf, correct_fraction=1.0, steps=250, check_prompts=64)
    assert format_rate >= 0.9 and accuracy >= 0.5
