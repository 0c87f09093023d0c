"""A task that needs a tool: multiplying two two-digit numbers, with a `calculator` the model may call.

A prompt "27*83" (rendered "tools:calculator(expression)\\n27*83=" by the tiny tokenizer's chat template with
the tool) is answered by a line "answer:2241" (reward `final_answer`: the integer on the trajectory's last
"answer: N" line). A tiny model cannot multiply; with the tool it can in two turns:

    27*83=  <tool_call>{"name": "calculator", "arguments": {"expression": "27*83"}}</tool_call><eos>
            <tool_response>2241</tool_response>\\n                         (the environment's: not trained)
            answer:2241<eos>

The operands come from a set of ten two-digit numbers (`OPERANDS`, each one token of the tiny tokenizer): 100
ordered pairs, 55 distinct products. The test file holds out whole products: `test_products` unordered pairs,
both orders, chosen by a seeded shuffle, so no test product is ever a training answer and memorising the
training products scores nothing on it. The format warm start (dev/warm_start.py) calls the calculator with
*random* operands from the set (right 2 times in 100: either order), or answers at random: what is left to learn is which
numbers to give it, and that relaying its answer is worth it.
"""
from __future__ import annotations

import ast
import random
from pathlib import Path

from megatron_gspo.data.splits import write_split

OPERANDS = (13, 19, 27, 34, 48, 57, 62, 76, 83, 91)
"""The operands: two-digit numbers, each a single token of the tiny tokenizer; no two unordered pairs of them
have the same product."""

PAIRS = tuple((a, b) for a in OPERANDS for b in OPERANDS)
"""The 100 ordered (a, b)."""

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


def write_multiplication_data(out_dir: str | Path, *, seed: int = 0, test_products: int = 8) -> tuple[Path, Path]:
    """Write test.jsonl (`test_products` held-out products: their unordered pairs, both orders) and train.jsonl
    (every other ordered pair) into `out_dir`; the same seed gives byte-identical files. Returns (train path,
    test path)."""
    unordered = sorted({tuple(sorted(pair)) for pair in PAIRS})
    if not 0 < test_products < len(unordered):
        raise ValueError(f"test_products must be in [1, {len(unordered) - 1}], got {test_products}")
    random.Random(seed).shuffle(unordered)
    held_out = set(unordered[:test_products])
    test = [pair for pair in PAIRS if tuple(sorted(pair)) in held_out]
    train = [pair for pair in PAIRS if tuple(sorted(pair)) not in held_out]
    random.Random(seed + 1).shuffle(train)
    return write_split(out_dir, [multiplication_row(*pair) for pair in train],
                       [multiplication_row(*pair) for pair in test])


def tool_corpus(num_lines: int, seed: int) -> list[str]:
    """Text in the task's format (tools line, prompt, call JSON, result, answer) for the tiny tokenizer's BPE,
    without the <tool_call> / <tool_response> tags (those are added tokens of their own). The results are random
    3-4 digit numbers, not the products: a product stays several tokens (as most numbers the BPE saw), so an
    answer the model makes up is right about never, while relaying the tool's tokens is a copy. (With every
    product one token, a made-up answer is right about 1 time in 55, and RL memorises the training products
    instead of learning which numbers to give the tool.)"""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        a, b, x, y = (rng.choice(OPERANDS) for _ in range(4))
        result = rng.randint(100, 9999)
        call = call_text(f"{x}*{y}").replace("<tool_call>", "\n").replace("</tool_call>", "\n")
        lines.append(f"tools:calculator(expression)\n{a}*{b}={call}{result}\n{answer_text(result)}")
    return lines
