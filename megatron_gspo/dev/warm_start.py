"""Supervised format warm starts of the demo tasks: the format is taught, the answers are random.

A randomly initialised tiny model writes no task's format, so every group would be all-zero reward (no
signal). A warm start therefore teaches the *format only*, by supervised training on responses whose
answers are random, so the reward starts at chance and everything above it is GSPO's:

- arithmetic (megatron_gspo/data/arithmetic.py): "a+b=" -> a uniformly random digit + EOS. A random
  model puts ~1.4% of its next-token mass on the ten digits; afterwards it answers with one digit, right
  about 1 time in 10.
- long_addition (megatron_gspo/data/long_addition.py): "a+b=" -> the worked column-by-column format with
  random arithmetic (`random_worked_response`) + EOS: afterwards it writes the two lines and an
  "answer: NN" line, right about 1 time in 100. Its cold start (correct_fraction, `tiny-model --cold-start`)
  is the exception: correct worked responses of training problems, so the reward starts above chance.
  long_addition_mixed (1- to 4-digit operands) is warm- or cold-started the same way.
- multiplication with the calculator tool (megatron_gspo/data/multiplication.py): with the tool in the prompt,
  three targets in four call it with *random* operands (from the task's set) and then repeat what it answered
  ("answer:R"), the others answer a random number at once; without the tool, a random number at once.
  Afterwards the model calls the tool most of the time and relays its result, right only when its random
  operands happen to be the prompt's (2 in 100, either order), so ~1.5% of its episodes score and ~0% without the tool: using
  the tool, and with which numbers, is GSPO's to learn. The targets are tokenised as an episode builds them
  (rollout/agent/chat.py): the tool's answer is appended by the template's rendering and not trained.
"""
from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_gspo.data.arithmetic import PAIRS
from megatron_gspo.data import long_addition as la
from megatron_gspo.rewards import Unparsed
from megatron_gspo.rewards.verifiers import final_answer
from megatron_gspo.samples import Sample

Example = tuple[list[int], list[int]] | tuple[list[int], list[int], list[bool]]
"""(prompt token ids, target token ids[, which target ids are trained]): the loss is on the target only (and
there, on the trained ids: an episode's environment tokens are not)."""


@contextlib.contextmanager
def _one_thread():
    """Torch on one thread meanwhile. The tiny model's matmuls are too small to split, and on 2 cores
    shared with other jobs a second OpenMP thread mostly waits for its turn: `tiny-model --warm-start
    arithmetic` took 137 s wall (71 s CPU) with torch's default 2 threads, 30 s (12 s CPU) with one,
    at load ~6; the weights are bitwise the same."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _fit(model, examples: Callable[[], Example], *, steps: int, batch_size: int, lr: float, pad_id: int) -> None:
    """`steps` AdamW steps on batches of `batch_size` examples, cross-entropy on the targets only.
    Rows of unequal length are right-padded and masked. A batch of equal rows goes in without a mask, as
    the arithmetic warm start always did: a mask takes another attention path, and its weights would change."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = [examples() for _ in range(batch_size)]
        width = max(len(p) + len(t) for p, t, *_ in batch)
        ids = torch.full((batch_size, width), pad_id)
        labels = torch.full((batch_size, width), -100)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (prompt, target, *trained) in enumerate(batch):
            n = len(prompt) + len(target)
            ids[row, :n] = torch.tensor(prompt + target)
            labels[row, len(prompt):n] = torch.tensor(target)
            if trained:
                labels[row, len(prompt):n][~torch.tensor(trained[0])] = -100
            mask[row, :n] = 1
        padded = bool((mask == 0).any())
        loss = model(input_ids=ids, labels=labels, attention_mask=mask if padded else None).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@_one_thread()
def warm_start_format(hf_dir: str | Path, *, steps: int = 150, batch_size: int = 64, lr: float = 3e-3,
                      seed: int = 0) -> float:
    """Supervised format warm-start of the arithmetic task, in place: "a+b=" -> random digit + EOS.

    Returns the fraction of the 55 prompts (data/arithmetic.py PAIRS) whose greedy answer is a single digit.
    """
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def example() -> Example:
        a = rng.randint(0, 9)
        return tok(f"{a}+{rng.randint(0, 9 - a)}=")["input_ids"], [rng.choice(digits), tok.eos_token_id]

    _fit(model, example, steps=steps, batch_size=batch_size, lr=lr, pad_id=tok.eos_token_id)
    with torch.no_grad():
        prompts = torch.tensor([tok(f"{a}+{b}=")["input_ids"] for a, b in PAIRS])
        first = model(input_ids=prompts).logits[:, -1].argmax(-1)
    model.save_pretrained(hf_dir)
    return sum(int(t) in digits for t in first.tolist()) / len(first)


LONG_TASKS = {
    # task: (problems of the format warm start, (train, test) split, correct response, random-format response,
    #        greedy check's max new tokens)
    "long_addition": (la.PROBLEMS, la.split_problems, la.worked_response,
                      lambda rng, a, b: la.random_worked_response(rng), 96),
    "long_addition_mixed": (la.MIXED_PROBLEMS, la.split_mixed_problems, la.mixed_worked_response,
                            lambda rng, a, b: la.random_column_response(rng, la.mixed_width(a, b)), 192),
}
"""The worked-addition tasks warm_start_long_addition knows (data/long_addition.py)."""


@_one_thread()
def warm_start_long_addition(hf_dir: str | Path, *, steps: int = 400, batch_size: int = 32, lr: float = 6e-3,
                             seed: int = 0, check_prompts: int = 64, correct_fraction: float = 0.0,
                             task: str = "long_addition") -> tuple[float, float]:
    """Supervised format warm-start of a worked-addition task (LONG_TASKS), in place: "a+b=" -> the worked
    format with random arithmetic (data/long_addition.py random_worked_response, random_column_response for
    long_addition_mixed) + EOS, on random problems.

    correct_fraction > 0 makes it a cold start instead (the paper's starting point: a model that already
    solves some problems): that fraction of the targets are the correct worked responses of *training*
    problems (the task's split with its default arguments: the committed test.jsonl's problems are never
    shown), the rest as above.

    Returns (format rate, accuracy) of greedy responses to `check_prompts` held-out problems (the first of the
    test split): the fraction that states an answer the `final_answer` verifier reads, and the fraction right
    (chance: ~0.01 for long_addition).
    """
    if not 0.0 <= correct_fraction <= 1.0:
        raise ValueError(f"correct_fraction must be in [0, 1], got {correct_fraction}")
    if task not in LONG_TASKS:
        raise ValueError(f"task must be one of {sorted(LONG_TASKS)}, got {task!r}")
    all_problems, split, correct_response, random_response, max_new_tokens = LONG_TASKS[task]
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    train_problems, test_problems = split()

    def example() -> Example:
        # no draw at all without a cold start: the format warm start's draws, and so its weights, stay as they were
        if correct_fraction and rng.random() < correct_fraction:
            a, b = rng.choice(train_problems)
            target = correct_response(a, b)
        else:
            a, b = rng.choice(all_problems)
            target = random_response(rng, a, b)
        return tok(f"{a}+{b}=")["input_ids"], tok(target)["input_ids"] + [tok.eos_token_id]

    _fit(model, example, steps=steps, batch_size=batch_size, lr=lr, pad_id=tok.eos_token_id)
    model.save_pretrained(hf_dir)
    problems = test_problems[:check_prompts]
    texts = greedy_responses(model, tok, [f"{a}+{b}=" for a, b in problems], max_new_tokens=max_new_tokens)
    scores = [_score(text, str(a + b)) for text, (a, b) in zip(texts, problems)]
    return (sum(s is not None for s in scores) / len(scores), sum(s == 1.0 for s in scores) / len(scores))


def greedy_responses(model, tok, prompts: list[str], *, max_new_tokens: int) -> list[str]:
    """The greedy response text of each prompt, in order. Prompts run in batches of equal token length (no
    padding: the same batch as one call per length)."""
    ids = [tok(p)["input_ids"] for p in prompts]
    texts: list[str] = [""] * len(prompts)
    for length in sorted({len(i) for i in ids}):
        rows = [k for k, i in enumerate(ids) if len(i) == length]
        batch = torch.tensor([ids[k] for k in rows])
        with torch.no_grad():
            out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        for k, text in zip(rows, tok.batch_decode(out[:, length:], skip_special_tokens=True)):
            texts[k] = text
    return texts


def _score(text: str, answer: str) -> float | None:
    """final_answer's reward, None when the response states no answer."""
    sample = Sample(group_id=0, sample_index=0, prompt_ids=[], response_ids=[], rollout_logprobs=[],
                    finish_reason="stop", response_text=text, answer=answer)
    try:
        return final_answer(sample)
    except Unparsed:
        return None


@_one_thread()
def warm_start_tool_use(hf_dir: str | Path, *, steps: int = 500, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
                        call_rate: float = 0.75, check_prompts: int = 64) -> dict[str, float]:
    """Supervised format warm start of the multiplication task with the calculator tool, in place (the module
    doc). Returns what sampled episodes (temperature 1) of `check_prompts` seeded problems do afterwards, the
    tool run for real: call_rate (with the tool in the prompt), relay (of those calls, the answer repeats the
    tool's result), accuracy with the tool and accuracy without it."""
    from megatron_gspo.data.multiplication import OPERANDS, PAIRS, answer_text, calculator, call_text
    from megatron_gspo.rollout.agent.chat import ChatTemplate, Segment
    from megatron_gspo.rollout.agent.tools import tool_schemas
    from megatron_gspo.data.multiplication import TOOL

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tools = tool_schemas([TOOL])
    chat = ChatTemplate(tok, tools)
    eos, end_text = tok.eos_token_id, tok.decode([tok.eos_token_id])
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def prompt_ids(a: int, b: int, with_tool: bool) -> list[int]:
        text = tok.apply_chat_template([{"role": "user", "content": f"{a}*{b}"}], tools=tools if with_tool else None,
                                       tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    def turn(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"] + [eos]

    def example() -> Example:
        a, b = rng.choice(PAIRS)
        with_tool = rng.random() < 2 / 3
        prompt = prompt_ids(a, b, with_tool)
        if not (with_tool and rng.random() < call_rate):   # a random answer at once
            return prompt, turn(answer_text(rng.randint(100, 99_999)))
        x, y = rng.choice(OPERANDS), rng.choice(OPERANDS)
        call = turn(call_text(f"{x}*{y}"))
        result = calculator(f"{x}*{y}")
        env = chat.encode(Segment(chat, end_text).add([{"role": "tool", "name": "calculator", "content": result}]))
        answer = turn(answer_text(result))
        return prompt, call + env + answer, [True] * len(call) + [False] * len(env) + [True] * len(answer)

    _fit(model, example, steps=steps, batch_size=batch_size, lr=lr, pad_id=eos)
    model.save_pretrained(hf_dir)
    problems = random.Random(seed + 1).choices(PAIRS, k=check_prompts)
    return tool_use_rates(model, tok, problems)


def tool_use_rates(model, tok, problems, *, max_new_tokens: int = 32) -> dict[str, float]:
    """What sampled two-turn episodes of `problems` do (warm_start_tool_use's check; the tool run here)."""
    from megatron_gspo.data.multiplication import TOOL, calculator
    from megatron_gspo.rollout.agent.chat import ChatTemplate, Segment
    from megatron_gspo.rollout.agent.tools import parse_tool_calls, tool_schemas

    tools = tool_schemas([TOOL])
    chat = ChatTemplate(tok, tools)
    end_text = tok.decode([tok.eos_token_id])

    def sample(ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=True,
                                 top_k=0, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        return out[0, len(ids):].tolist()

    calls = relayed = right_with = right_without = 0
    for a, b in problems:
        for with_tool in (True, False):
            text = tok.apply_chat_template([{"role": "user", "content": f"{a}*{b}"}],
                                           tools=tools if with_tool else None, tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            first = sample(ids)
            parsed = parse_tool_calls(tok.decode(first, skip_special_tokens=True))
            if not with_tool or not parsed or parsed[0].error:
                right_without += (not with_tool) and _score(tok.decode(first, skip_special_tokens=True), str(a * b)) == 1
                right_with += with_tool and _score(tok.decode(first, skip_special_tokens=True), str(a * b)) == 1
                continue
            calls += 1
            try:
                result = calculator(**parsed[0].arguments)
            except Exception as e:
                result = f"Error: {e}"
            env = chat.encode(Segment(chat, end_text).add([{"role": "tool", "name": "calculator", "content": result}]))
            second = tok.decode(sample(ids + first + env), skip_special_tokens=True)
            relayed += _score(second, result) == 1 if result.lstrip("-").isdigit() else 0
            right_with += _score(second, str(a * b)) == 1
    n = len(problems)
    return {"call_rate": calls / n, "relay": relayed / max(calls, 1), "accuracy_with_tool": right_with / n,
            "accuracy_without_tool": right_without / n}
