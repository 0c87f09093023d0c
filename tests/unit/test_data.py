"""Prompt data (megatron_gspo/data/): reading the three formats, keys, templates, length limits, the
seeded resumable stream, every bad input's message, and the arithmetic demo files."""
import itertools
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_gspo.config import DataConfig
from megatron_gspo.data import PAIRS, DataError, open_prompt_dataset, write_arithmetic_data
from megatron_gspo.dev.tiny_model import make_tiny_tokenizer

# A Qwen3-style template: "<|im_start|>role\ncontent<|im_end|>\n" turns; the generation prompt opens an
# assistant turn, with an empty think block when enable_thinking is false (as Qwen3's template does).
QWEN_STYLE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_tok(tok):
    """The tiny tokenizer without a chat template."""
    return retemplated(tok, None)


def retemplated(tok, template):
    """The same vocabulary with another chat template (None: none)."""
    copy = tok.__class__(tokenizer_object=tok.backend_tokenizer, eos_token=tok.eos_token, pad_token=tok.pad_token)
    copy.chat_template = template
    return copy


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def rows_of(n):
    return [{"prompt": [{"role": "user", "content": f"{i % 10}+0"}], "answer": str(i % 10), "id": i}
            for i in range(n)]


def open_rows(tmp_path, tok, rows, name="p.jsonl", seed=0, **data):
    return open_prompt_dataset([write_jsonl(tmp_path / name, rows)], DataConfig(**data), tok, seed=seed)


def as_tuples(prompts):
    return [(p.group_id, p.prompt_ids, p.prompt, p.answer, p.metadata) for p in prompts]


def test_jsonl_parquet_and_save_to_disk_give_the_same_prompts(tmp_path, tok):
    rows = rows_of(7)
    jsonl = write_jsonl(tmp_path / "p.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    data = DataConfig(metadata_keys=("id",), shuffle=False)
    got = [as_tuples(open_prompt_dataset([p], data, tok).eval_prompts())
           for p in (jsonl, str(tmp_path / "p.parquet"), str(tmp_path / "saved"))]
    assert got[0] == got[1] == got[2]
    assert got[0][3] == (3, tok("3+0=")["input_ids"], "3+0=", "3", {"id": 3})  # the demo's text, as before


def test_a_list_of_paths_is_concatenated_in_order(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", rows_of(3))
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "x", "answer": 9}])
    ds = open_prompt_dataset([a, b], DataConfig(shuffle=False), tok)
    assert len(ds) == 4 and ds.paths == (a, b)
    assert [p.prompt for p in ds.eval_prompts()] == ["0+0=", "1+0=", "2+0=", "x"]
    assert [p.prompt for p in ds.eval_prompts(limit=2)] == ["0+0=", "1+0="]


def test_dotted_keys_reach_nested_fields_verl_dapo_style(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": "3+4"}], "data_source": "math",
             "reward_model": {"ground_truth": "34", "style": "rule"}, "extra_info": {"index": 5}}]
    ds = open_rows(tmp_path, tok, rows, answer_key="reward_model.ground_truth",
                   metadata_keys=("data_source", "extra_info.index"))
    (p,) = ds.eval_prompts()
    assert (p.answer, p.metadata) == ("34", {"data_source": "math", "extra_info.index": 5})


def test_answers_become_text(tmp_path, tok):
    rows = [{"prompt": "a", "answer": a} for a in (7, 0.5, ["1", "2"], True)]
    # pyarrow JSON needs one type per column: one file per answer type.
    got = [open_rows(tmp_path, tok, [r], name=f"{i}.jsonl").eval_prompts()[0].answer for i, r in enumerate(rows)]
    assert got == ["7", "0.5", '["1", "2"]', "true"]


def test_templates_auto_true_false(tmp_path, tok, plain_tok):
    rows = [{"prompt": "3+4=", "answer": "7"}, {"prompt": [{"role": "user", "content": "1+1"}], "answer": "2"}]
    text = lambda t, **d: [p.prompt for p in open_rows(tmp_path, t, rows[:1 if t is plain_tok else 2], **d)
                           .eval_prompts()]
    assert text(tok) == ["3+4=", "1+1="]  # auto: a string as it is, messages templated
    assert text(tok, chat_template="true") == ["3+4==", "1+1="]  # a string becomes a user message
    assert text(plain_tok) == ["3+4="]
    with pytest.raises(DataError, match=r"p\.jsonl row 1: prompt is a list of messages but data.chat_template=false"):
        open_rows(tmp_path, tok, rows, chat_template="false")
    with pytest.raises(DataError, match="data.chat_template=true but the tokenizer has no chat template"):
        open_rows(tmp_path, plain_tok, rows[:1], chat_template="true")
    with pytest.raises(DataError, match=r"p\.jsonl row 1: prompt is a list of messages but the tokenizer has no"):
        open_rows(tmp_path, plain_tok, rows)
    # false: strings are tokenised as they are, even with the template and a system prompt at hand
    assert [p.prompt for p in open_rows(tmp_path, tok, rows[:1], chat_template="false", system_prompt="S")
            .eval_prompts()] == ["3+4="]


def test_system_prompt_and_template_kwargs_qwen3_style(tmp_path, tok):
    qwen = retemplated(tok, QWEN_STYLE)
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}, {"prompt": "yo", "answer": "y"}]
    think = open_rows(tmp_path, qwen, rows, system_prompt="Be brief.", shuffle=False).eval_prompts()
    assert think[0].prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert think[1].prompt == "yo"  # auto: a string prompt is raw; the system prompt is for templated ones
    no_think = open_rows(tmp_path, qwen, rows, chat_template_kwargs={"enable_thinking": False}).eval_prompts()
    assert no_think[0].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert no_think[0].prompt_ids == qwen(no_think[0].prompt, add_special_tokens=False)["input_ids"]
    tiny = open_rows(tmp_path, tok, rows[:1], system_prompt="S").eval_prompts()
    assert tiny[0].prompt == "S\nhi="
    with pytest.raises(DataError, match=r"p\.jsonl row 0: the messages already start with a system message"):
        open_rows(tmp_path, tok, [{"prompt": [{"role": "system", "content": "A"}, {"role": "user", "content": "b"}],
                                   "answer": "1"}], system_prompt="S")


def test_too_long_prompts_are_skipped_and_counted(tmp_path, tok):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1+1=" * 20, "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    limit = len(tok("1+1=")["input_ids"])
    ds = open_rows(tmp_path, tok, rows, max_prompt_tokens=limit, shuffle=False)
    assert (len(ds), ds.skipped) == (2, 1)
    assert [p.prompt for p in ds.eval_prompts()] == ["1+1=", "2+2="]
    with pytest.raises(DataError, match=rf"all 3 prompts of .*p\.jsonl are longer than data.max_prompt_tokens=1"):
        open_rows(tmp_path, tok, rows, max_prompt_tokens=1)


def test_shuffle_is_a_seeded_permutation_per_epoch(tmp_path, tok):
    path = [write_jsonl(tmp_path / "p.jsonl", rows_of(20))]
    ds = open_prompt_dataset(path, DataConfig(metadata_keys=("id",)), tok, seed=3)
    ids = [p.metadata["id"] for p in itertools.islice(ds.prompts(), 60)]
    epochs = [ids[0:20], ids[20:40], ids[40:60]]
    assert all(sorted(e) == list(range(20)) for e in epochs)  # each epoch every prompt once
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(20))
    again = open_prompt_dataset(path, DataConfig(metadata_keys=("id",)), tok, seed=3)
    assert [p.metadata["id"] for p in itertools.islice(again.prompts(), 60)] == ids
    other = open_prompt_dataset(path, DataConfig(metadata_keys=("id",)), tok, seed=4)
    assert [p.metadata["id"] for p in itertools.islice(other.prompts(), 20)] != epochs[0]
    unshuffled = open_prompt_dataset(path, DataConfig(metadata_keys=("id",), shuffle=False), tok)
    assert [p.metadata["id"] for p in itertools.islice(unshuffled.prompts(), 40)] == list(range(20)) * 2
    assert [ds.epoch_of(k) for k in (0, 19, 20, 59)] == [0, 0, 1, 2]


def test_resume_continues_the_stream_exactly(tmp_path, tok):
    ds = open_rows(tmp_path, tok, rows_of(7), metadata_keys=("id",), seed=1)
    full = as_tuples(itertools.islice(ds.prompts(), 30))
    assert [g for g, *_ in full] == list(range(30))  # group_id = stream position
    for k in (3, 7, 12, 20):  # mid-epoch, at and across epoch boundaries
        assert as_tuples(itertools.islice(ds.prompts(k), 30 - k)) == full[k:]


def test_epochs_end_the_stream(tmp_path, tok):
    ds = open_rows(tmp_path, tok, rows_of(5), epochs=2)
    assert len(list(ds.prompts())) == 10
    assert [p.group_id for p in ds.prompts(8)] == [8, 9]
    assert list(ds.prompts(10)) == []


@pytest.mark.parametrize("content, data, message", [
    (None, {}, r"data\.train: .*nope\.jsonl: no such file"),
    ("x", {}, r"unknown prompt file type '\.txt'"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer"\n', {}, r"p\.jsonl line 2 \(row 1\): not valid JSON: "
                                                                    r"Expecting ':' delimiter \(column 25\)$"),
    ('{"prompt": "a", "answer": "1"}\n\n[{"prompt": "b"}]\n', {}, r"p\.jsonl line 3 \(row 1\): expected a JSON object, "
                                                                r"got list"),
    ("", {}, r"p\.jsonl: (no rows|cannot read)"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b"}\n', {}, r"p\.jsonl row 1: no key 'answer' \(or null in a JSON file; keys: \['prompt'\]\)"),
    ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": null}\n', {}, r"p\.jsonl row 1: no key 'answer'"),
    ('{"prompt": "a", "x": {"y": 1}}\n', {"answer_key": "x.z"}, r"p\.jsonl row 0: no key 'x\.z'"),
    ('{"question": "a", "answer": "1"}\n', {}, r"p\.jsonl row 0: no key 'prompt' \(or null in a JSON file; keys: \['answer', 'question'\]\)"),
    ('{"prompt": 5, "answer": "1"}\n', {}, r"p\.jsonl row 0 key 'prompt': prompt must be a string or .* got int 5"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}\n', {}, r"row 0 key 'prompt': message 0 must be a dict"),
    ('{"prompt": [], "answer": "1"}\n', {}, r"row 0 key 'prompt': prompt must be a string or a non-empty list"),
    ('{"prompt": "a", "answer": "1"}\n', {"metadata_keys": ("src",)}, r"p\.jsonl row 0: no key 'src'"),
])
def test_bad_inputs_name_file_row_and_key(tmp_path, tok, content, data, message):
    name = "p.txt" if "txt" in message else "p.jsonl"
    path = tmp_path / ("nope.jsonl" if content is None else name)
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message):
        open_prompt_dataset([str(path)], DataConfig(**data), tok)


def test_a_truncated_line_is_named_as_invalid_json(tmp_path, tok):
    rows = [json.dumps({"prompt": f"{i}+0", "answer": str(i)}) for i in range(30)]
    truncated = tmp_path / "truncated.jsonl"  # a copy cut short in the middle of line 21
    truncated.write_text("\n".join(rows[:20] + [rows[20][:25]] + rows[21:]) + "\n")
    with pytest.raises(DataError, match=r"data\.train: .*truncated\.jsonl line 21 \(row 20\): not valid JSON: "
                                        r"Unterminated string starting at \(column 20\)$"):
        open_prompt_dataset([str(truncated)], DataConfig(), tok)


def test_a_trailing_comma_is_invalid_json(tmp_path, tok):
    rows = [json.dumps({"prompt": f"{i}+0", "answer": str(i)}) for i in range(30)]
    trailing_comma = tmp_path / "comma.jsonl"  # pandas' reader took it as {"prompt": "3+0", "answer": "3"}
    trailing_comma.write_text("\n".join(rows[:3] + ['{"prompt": "3+0", "answer": "3",}'] + rows[4:]) + "\n")
    with pytest.raises(DataError, match=r"comma\.jsonl line 4 \(row 3\): not valid JSON: Expecting property name "
                                        r"enclosed in double quotes \(column 33\)$"):
        open_prompt_dataset([str(trailing_comma)], DataConfig(), tok)


def test_bad_parquet_and_empty_list_and_field_name(tmp_path, tok):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"eval\.datasets\.held: .*bad\.parquet: cannot read it"):
        open_prompt_dataset([str(tmp_path / "bad.parquet")], DataConfig(), tok, field="eval.datasets.held")
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]),
                   tmp_path / "null.parquet")
    with pytest.raises(DataError, match=r"null\.parquet row 1: key 'answer' is null"):
        open_prompt_dataset([str(tmp_path / "null.parquet")], DataConfig(), tok)
    with pytest.raises(DataError, match="data.train: no prompt files given"):
        open_prompt_dataset([], DataConfig(), tok)


def test_arithmetic_files(tmp_path, tok):
    train, test = write_arithmetic_data(tmp_path / "a", seed=0)
    assert (train.name, test.name) == ("train.jsonl", "test.jsonl")
    again = write_arithmetic_data(tmp_path / "b", seed=0)
    assert (train.read_bytes(), test.read_bytes()) == (again[0].read_bytes(), again[1].read_bytes())
    assert write_arithmetic_data(tmp_path / "c", seed=1)[1].read_bytes() != test.read_bytes()
    data = DataConfig(shuffle=False)
    tr, te = (open_prompt_dataset([str(p)], data, tok).eval_prompts() for p in (train, test))
    assert (len(tr), len(te)) == (45, 10)
    pairs = {p.prompt for p in tr} | {p.prompt for p in te}
    assert pairs == {f"{a}+{b}=" for a, b in PAIRS} and not {p.prompt for p in tr} & {p.prompt for p in te}
    assert all(int(p.prompt[0]) + int(p.prompt[2]) == int(p.answer) for p in tr + te)
    assert all(p.prompt_ids == tok(p.prompt)["input_ids"] for p in te)
    assert sorted(tmp_path.joinpath("a").iterdir()) == [test, train]  # no temporary files left


def test_json_values_stay_exact_when_a_column_mixes_types(tmp_path, tok):
    # One file mixing string and message prompts, string and number answers: "007" must stay "007"
    # (datasets 5.2's Json feature would decode it to 7; pyarrow's JSON reader refuses the file).
    rows = [{"prompt": "1+1=", "answer": "007"}, {"prompt": [{"role": "user", "content": "2+2"}], "answer": 4},
            {"prompt": "3+3=", "answer": "1.50"}]
    got = [(p.prompt, p.answer) for p in open_rows(tmp_path, tok, rows).eval_prompts()]
    assert got == [("1+1=", "007"), ("2+2=", "4"), ("3+3=", "1.50")]
