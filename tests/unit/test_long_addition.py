"""The long-response task (megatron_gspo/data/long_addition.py): its problems and files, the worked responses'
length with the tiny tokenizer, the warm start's random format, and `megatron-gspo make-data long_addition`; the
same for long_addition_mixed (1- to 4-digit operands)."""
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from megatron_gspo.cli import main as cli_main
from megatron_gspo.config import load_config
from megatron_gspo.data.long_addition import (MIXED_PROBLEMS, PROBLEMS, column_response, mixed_width,
                                              mixed_worked_response, random_column_response, random_worked_response,
                                              split_mixed_problems, split_problems, worked_response,
                                              write_long_addition_data)
from megatron_gspo.dev.tiny_model import make_tiny_tokenizer
from megatron_gspo.rewards.verifiers import final_answer
from megatron_gspo.samples import Sample

REPO = Path(__file__).parents[2]
EXAMPLE_DATA = REPO / "examples" / "data" / "long_addition"


def sample(response, answer):
    return Sample(group_id=0, sample_index=0, prompt_ids=[], response_ids=[], rollout_logprobs=[],
                  finish_reason="stop", response_text=response, answer=answer)


def rows(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def operands(row):
    a, b = row["prompt"][0]["content"].split("+")
    return int(a), int(b)


def test_problems_are_the_two_digit_sums_below_100():
    assert len(PROBLEMS) == len(set(PROBLEMS)) == 3240   # sum over a = 10..89 of the 90 - a choices of b
    assert all(10 <= a and 10 <= b and a + b <= 99 for a, b in PROBLEMS)
    assert (10, 10) in PROBLEMS and (89, 10) in PROBLEMS and (50, 50) not in PROBLEMS


def test_worked_response_by_hand():
    assert worked_response(37, 45) == ("ones: 7+5+0=12, write 2, carry 1\n"
                                       "tens: 3+4+1=8, write 8, carry 0\n"
                                       "answer: 82")
    assert worked_response(10, 10).endswith("tens: 1+1+0=2, write 2, carry 0\nanswer: 20")
    with pytest.raises(ValueError, match="a \\+ b <= 99"):
        worked_response(50, 50)


def test_files_are_a_seeded_disjoint_split_written_whole(tmp_path):
    train, test = write_long_addition_data(tmp_path / "a", seed=0)
    again = write_long_addition_data(tmp_path / "b", seed=0)
    assert (train.read_bytes(), test.read_bytes()) == (again[0].read_bytes(), again[1].read_bytes())
    assert write_long_addition_data(tmp_path / "c", seed=1)[1].read_bytes() != test.read_bytes()
    tr, te = {operands(r) for r in rows(train)}, {operands(r) for r in rows(test)}
    assert (len(rows(train)), len(rows(test))) == (3040, 200) and (len(tr), len(te)) == (3040, 200)
    assert not tr & te and tr | te == set(PROBLEMS)
    assert all(r["answer"] == str(sum(operands(r))) for r in rows(train) + rows(test))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["test.jsonl", "train.jsonl"]  # no temporaries
    with pytest.raises(ValueError, match="test_problems must be in"):
        write_long_addition_data(tmp_path / "d", test_problems=3240)


def test_split_problems_are_the_committed_files_in_order():
    # what the cold start (dev/warm_start.py) trains on and keeps away from: the committed files' problems
    train, test = split_problems()
    assert train == [operands(r) for r in rows(EXAMPLE_DATA / "train.jsonl")]
    assert test == [operands(r) for r in rows(EXAMPLE_DATA / "test.jsonl")]
    assert split_problems(seed=1)[1] != test
    with pytest.raises(ValueError, match="test_problems must be in"):
        split_problems(test_problems=0)


def test_the_worked_response_of_every_test_row_verifies():
    test_rows = rows(EXAMPLE_DATA / "test.jsonl")
    assert len(test_rows) == 200
    for row in test_rows:
        response = worked_response(*operands(row))
        assert final_answer(sample(response, row["answer"])) == 1.0
        assert final_answer(sample(response, str(int(row["answer"]) + 1))) == 0.0


def test_worked_responses_are_74_tokens_with_the_tiny_tokenizer():
    # By hand: a column line is 32 tokens (letters and spaces are one token each, numbers below 100 one
    # token: "ones:" 5, " " 1, "7+5+0=12" 7, "," 1, " write" 6, " 2" 2, "," 1, " carry" 6, " 1" 2, "\n" 1),
    # "answer: 82" is 9 ("answer:" 7, " " 1, "82" 1), EOS 1: 32 + 32 + 9 + 1 = 74.
    tok = make_tiny_tokenizer()

    def response_tokens(a, b, text):
        user = [{"role": "user", "content": f"{a}+{b}"}]
        prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(user + [{"role": "assistant", "content": text}], tokenize=False)
        return len(tok(full)["input_ids"]) - len(tok(prompt)["input_ids"])

    assert {response_tokens(a, b, worked_response(a, b)) for a, b in PROBLEMS} == {74}
    rng = random.Random(0)
    assert {response_tokens(37, 45, random_worked_response(rng)) for _ in range(300)} <= {74, 75}


def test_random_worked_responses_state_a_uniform_two_digit_answer():
    # The warm start's target: always an answer line (format), its two digits uniform (chance 1/100), and the
    # answer is the lines' written digits (the format's bookkeeping), whatever the stated sums.
    rng = random.Random(0)
    texts = [random_worked_response(rng) for _ in range(20_000)]
    answers = Counter(t.rsplit("answer: ", 1)[1] for t in texts)
    assert set(answers) == {f"{n:02d}" for n in range(100)} and max(answers.values()) < 2 * 20_000 / 100
    for text in texts[:500]:
        lines = text.split("\n")
        written = [line.split("write ")[1][0] for line in lines[:2]]
        assert lines[2] == f"answer: {written[1]}{written[0]}"
        assert lines[1].split("+")[2].startswith(lines[0][-1])   # the ones carry is the tens line's carry-in
    problems = random.Random(1).choices(PROBLEMS, k=len(texts))
    correct = sum(final_answer(sample(t, str(a + b))) for t, (a, b) in zip(texts, problems))
    assert 0.007 < correct / len(texts) < 0.013


def test_make_data_cli_writes_the_committed_files(tmp_path, capsys):
    assert cli_main(["make-data", "long_addition", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl")]
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLE_DATA / name).read_bytes()
    with pytest.raises(SystemExit):
        cli_main(["make-data", "long_subtraction", str(tmp_path)])


def test_example_config_trains_on_the_task_with_room_for_its_responses():
    config = load_config(REPO / "examples" / "tiny_long_cpu.yaml")
    assert [REPO / p for p in config.data.train] == [EXAMPLE_DATA / "train.jsonl"]
    assert REPO / config.eval.datasets["held_out"] == EXAMPLE_DATA / "test.jsonl"
    assert config.reward.fn == "final_answer" and config.sampling.max_new_tokens > 74   # a right response: 74


MIXED_DATA = REPO / "examples" / "data" / "long_addition_mixed"


def test_mixed_problems_are_sums_of_equal_width_operands_one_to_four_digits():
    widths = Counter(mixed_width(a, b) for a, b in MIXED_PROBLEMS)
    assert len(set(MIXED_PROBLEMS)) == len(MIXED_PROBLEMS) == 1000 and widths == {1: 100, 2: 300, 3: 300, 4: 300}
    assert all(len(str(a)) == len(str(b)) for a, b in MIXED_PROBLEMS)


def test_column_response_by_hand_carries_out_of_the_last_column():
    assert mixed_worked_response(5, 7) == "ones: 5+7+0=12, write 2, carry 1\nanswer: 12"
    assert mixed_worked_response(987, 456) == ("ones: 7+6+0=13, write 3, carry 1\n"
                                               "tens: 8+5+1=14, write 4, carry 1\n"
                                               "hundreds: 9+4+1=14, write 4, carry 1\n"
                                               "answer: 1443")
    assert column_response(37, 45, 2) == worked_response(37, 45)
    with pytest.raises(ValueError, match="over 2 columns"):
        column_response(123, 4, 2)
    with pytest.raises(ValueError, match="width <= 4"):
        column_response(1, 2, 5)


def test_mixed_responses_span_four_length_buckets_with_the_tiny_tokenizer():
    # 42, 74, 111, 148 tokens (EOS included) for widths 1-4: the buckets len_32-63 .. len_128-191
    tok = make_tiny_tokenizer()
    lengths: dict[int, set] = {}
    for a, b in MIXED_PROBLEMS:
        lengths.setdefault(mixed_width(a, b), set()).add(len(tok(mixed_worked_response(a, b))["input_ids"]) + 1)
    assert {w: (min(v), max(v)) for w, v in lengths.items()} == {1: (42, 42), 2: (74, 75), 3: (110, 111),
                                                                   4: (148, 149)}


def test_mixed_split_holds_out_each_width_and_matches_the_committed_files(tmp_path):
    train, test = split_mixed_problems()
    assert Counter(mixed_width(*p) for p in test) == {1: 20, 2: 20, 3: 20, 4: 20}
    assert not set(train) & set(test) and set(train) | set(test) == set(MIXED_PROBLEMS)
    assert len({mixed_width(*p) for p in test[:8]}) > 1                    # eval's first prompts mix widths
    assert train == [operands(r) for r in rows(MIXED_DATA / "train.jsonl")]
    assert test == [operands(r) for r in rows(MIXED_DATA / "test.jsonl")]
    assert cli_main(["make-data", "long_addition_mixed", str(tmp_path)]) == 0
    for name in ("train.jsonl", "test.jsonl"):
        assert (tmp_path / name).read_bytes() == (MIXED_DATA / name).read_bytes()
    for row in rows(MIXED_DATA / "test.jsonl"):
        assert final_answer(sample(mixed_worked_response(*operands(row)), row["answer"])) == 1.0
    with pytest.raises(ValueError, match="test_per_width must be in"):
        split_mixed_problems(test_per_width=100)


def test_random_column_responses_keep_the_format_and_answer_at_chance():
    rng = random.Random(0)
    for width in (1, 2, 3, 4):
        for _ in range(200):
            lines = random_column_response(rng, width).split("\n")
            assert len(lines) == width + 1 and lines[-1].startswith("answer: ")
            written = "".join(line.split("write ")[1][0] for line in reversed(lines[:-1]))
            carry = lines[-2].rsplit("carry ", 1)[1]
            assert lines[-1] == f"answer: {'1' if carry == '1' else ''}{written}"
    texts = [random_column_response(rng, 1) for _ in range(5000)]
    problems = random.Random(2).choices(MIXED_PROBLEMS[:100], k=5000)           # the one-digit sums
    right = sum(final_answer(sample(t, str(a + b))) for t, (a, b) in zip(texts, problems))
    assert 0.02 < right / 5000 < 0.08                       # width 1: 1 in 20 (written digit 1/10, carry 1/2)
