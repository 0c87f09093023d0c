"""The tool demo's task (megatron_gspo/data/multiplication.py): held-out products that no training prompt has,
the files `megatron-gspo make-data multiplication` writes, and the tools tokenizer's view of the numbers."""
import json

import pytest

from megatron_gspo.cli import main as cli_main
from megatron_gspo.data.multiplication import OPERANDS, PAIRS, calculator, write_multiplication_data


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_held_out_products_are_never_a_training_answer(tmp_path):
    train, test = write_multiplication_data(tmp_path, seed=0, test_products=8)
    train_rows, test_rows = rows(train), rows(test)
    assert len(train_rows) + len(test_rows) == len(PAIRS) == 100
    train_answers = {r["answer"] for r in train_rows}
    test_answers = {r["answer"] for r in test_rows}
    assert len(test_answers) == 8 and not train_answers & test_answers
    prompts = [r["prompt"][0]["content"] for r in train_rows + test_rows]
    assert sorted(prompts) == sorted(f"{a}*{b}" for a, b in PAIRS)
    for r in train_rows + test_rows:
        assert r["answer"] == calculator(r["prompt"][0]["content"])
    for r in test_rows:  # both orders of a held-out pair are held out
        a, b = r["prompt"][0]["content"].split("*")
        assert {"prompt": [{"role": "user", "content": f"{b}*{a}"}], "answer": r["answer"]} in test_rows
    # every operand is still seen in training, on both sides of the "*"
    firsts = {r["prompt"][0]["content"].split("*")[0] for r in train_rows}
    seconds = {r["prompt"][0]["content"].split("*")[1] for r in train_rows}
    assert firsts == seconds == {str(o) for o in OPERANDS}


def test_make_data_is_reproducible_and_refuses_a_bad_count(tmp_path):
    assert cli_main(["make-data", "multiplication", str(tmp_path / "a")]) == 0
    write_multiplication_data(tmp_path / "b", seed=0)
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    write_multiplication_data(tmp_path / "c", seed=1)
    assert (tmp_path / "c" / "test.jsonl").read_bytes() != (tmp_path / "a" / "test.jsonl").read_bytes()
    with pytest.raises(ValueError, match="test_products must be in"):
        write_multiplication_data(tmp_path / "d", test_products=55)


def test_the_tools_tokenizer_keeps_operands_whole_and_products_in_pieces():
    """An operand is one token (copying it into the call is one token's choice); a product is mostly several,
    so an answer made up without the tool is almost never right, and the reward comes from the tool."""
    from megatron_gspo.dev.tiny_model import train_tokenizer

    tokenizer = train_tokenizer(512, seed=1234, tools=True)
    pieces = lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
    assert all(pieces(str(o)) == 1 for o in OPERANDS)
    products = {a * b for a, b in PAIRS}
    whole = sorted(p for p in products if pieces(str(p)) == 1)
    assert len(whole) <= len(products) // 10, whole
