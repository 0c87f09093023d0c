"""A task that needs a tool: multiplying two 2-3 digit numbers, with a `calculator` the model may call.

A prompt "27*125" (rendered "tools:calculator(expression)\\n27*125=" by the tiny tokenizer's chat template with
the tool) is answered by a line "answer:3375" (reward `final_answer`: the integer on the trajectory's last
"answer: N" line). A tiny model cannot multiply; with the tool it can in two turns:

    27*125=  <tool_call>{"name": "calculator", "arguments": {"expression": "27*125"}}</tool_call><eos>
             <tool_response>3375</tool_response>\\n                         (the environment's: not trained)
             answer:3375<eos>

The operands come from a small set (`OPERANDS`, each one token of the tiny tokenizer): 36 ordered pairs (21
distinct products), split once, by a seeded shuffle, into train and test files. The
format warm start (dev/warm_start.py) calls the calculator with *random* operands from the set, or answers
at random: what is left to learn is which numbers to give it, and that calling it is worth it.
"""
from __future__ import annotations

import ast
import random
from pathlib import Path

from megatron_gspo.data.splits import write_shuffled_split

OPERANDS = (13, 27, 48, 76, 125, 250)
"""The operands: 2-3 digit numbers, each a single token of the tiny tokenizer."""

PAIRS = tuple((a, b) for a in OPERANDS for b in OPERANDS)
"""The 36 ordered (a, b)."""

TOOL = "megatron_gspo.data.multiplication:calculator"
"""The task's tool, as rollout.tools names it."""

_MAX_DIGITS = 12


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: Integers joined by +, - and *, with parentheses, e.g. "27*125".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None
    return str(_evaluate(tree.body))


def _evaluate(node) -> int:
    """Integers, + - * and unary minus only (no names, calls or powers: nothing that runs code or blows up)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = -_evaluate(node.operand)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        left, right = _evaluate(node.left), _evaluate(node.right)
        value = left + right if isinstance(node.op, ast.Add) else left - right if isinstance(node.op, ast.Sub) \
            else left * right
    else:
        raise ValueError(f"unsupported: {ast.unparse(node)!r} (integers, + - * and parentheses only)")
    if len(str(abs(value))) > _MAX_DIGITS:
        raise ValueError(f"a number of more than {_MAX_DIGITS} digits")
    return value


def multiplication_row(a: int, b: int) -> dict:
    """One prompt row: {"prompt": [{"role": "user", "content": "a*b"}], "answer": "a*b's value"}."""
    return {"prompt": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b)}


def answer_text(value: int | str) -> str:
    """The final answer line the reward reads (final_answer: "answer: N"; no space, so N is one piece)."""
    return f"answer:{value}"


def call_text(expression: str) -> str:
    """A calculator call in Qwen3's format (rollout.tool_parser=qwen3)."""
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def write_multiplication_data(out_dir: str | Path, *, seed: int = 0, test_pairs: int = 6) -> tuple[Path, Path]:
    """Write train.jsonl (36 - test_pairs rows) and test.jsonl (test_pairs rows) into `out_dir`; the same seed
    gives byte-identical files. Returns (train path, test path)."""
    return write_shuffled_split(out_dir, PAIRS, multiplication_row, test_count=test_pairs, seed=seed,
                                what="test_pairs")


def tool_corpus(num_lines: int, seed: int) -> list[str]:
    """Text in the task's format (tools line, prompt, call JSON, result, answer) for the tiny tokenizer's BPE,
    without the <tool_call> / <tool_response> tags (those are added tokens of their own)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        a, b, x, y = (rng.choice(OPERANDS) for _ in range(4))
        call = call_text(f"{x}*{y}").replace("<tool_call>", "\n").replace("</tool_call>", "\n")
        lines.append(f"tools:calculator(expression)\n{a}*{b}={call}{x * y}\n{answer_text(x * y)}")
    return lines
