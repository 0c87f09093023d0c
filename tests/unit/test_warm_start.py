"""The long_addition format warm start (megatron_gspo/dev/warm_start.py) on the tiny dense and MoE models."""
import hashlib
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_gspo.data.long_addition import PROBLEMS
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
