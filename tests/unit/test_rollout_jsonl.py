"""Prompt and sample JSONL files: round trip, and errors that name the file and line."""
import json
import re

import pytest

from megatron_gspo.rollout.jsonl import JsonlError, read_prompts, read_samples, write_samples
from megatron_gspo.samples import Sample


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def sample(**overrides):
    fields = dict(group_id=3, sample_index=1, prompt_ids=[1, 2], response_ids=[5, 6, 0],
                  rollout_logprobs=[-0.1, -2.5, -0.01], finish_reason="stop", weight_version="v7",
                  reward=1.0, response_text="12", prompt="5+7=", answer="12")
    fields.update(overrides)
    return Sample(**fields)


def test_samples_round_trip(tmp_path):
    samples = [sample(), sample(sample_index=2, reward=None, prompt=None, answer=None)]
    path = tmp_path / "s.jsonl"
    assert write_samples(path, samples) == 2
    assert read_samples(path) == samples
    first = json.loads(path.read_text().splitlines()[0])
    for key in ("prompt_ids", "response_ids", "rollout_logprobs", "group_id", "reward", "finish_reason",
                "weight_version"):
        assert key in first


@pytest.mark.parametrize("line,message", [
    ('{"group_id": 0', r":2: not valid JSON"),
    ('[1, 2]', r":2: expected a JSON object"),
    ('{"group_id": 0}', r":2: missing field\(s\) sample_index, prompt_ids"),
    ('{"group_id":0,"sample_index":0,"prompt_ids":[1],"response_ids":[2,3],"rollout_logprobs":[-1],'
     '"finish_reason":"stop"}', r":2: .*2 response ids but 1 log-probs"),
    ('{"group_id":0,"sample_index":0,"prompt_ids":[1],"response_ids":[2],"rollout_logprobs":[NaN],'
     '"finish_reason":"stop"}', r":2: rollout_logprobs must be a list of finite numbers"),
    ('{"group_id":0,"sample_index":0,"prompt_ids":["a"],"response_ids":[2],"rollout_logprobs":[-1],'
     '"finish_reason":"stop"}', r":2: prompt_ids must be a list of integers"),
    ('{"group_id":0,"sample_index":0,"prompt_ids":[1],"response_ids":[2],"rollout_logprobs":[-1],'
     '"finish_reason":"stop","rewrd":1}', r":2: unknown field\(s\) rewrd"),
])
def test_malformed_sample_line_names_file_and_line(tmp_path, line, message):
    good = json.dumps({"group_id": 0, "sample_index": 0, "prompt_ids": [1], "response_ids": [2],
                       "rollout_logprobs": [-1.0], "finish_reason": "stop"})
    path = write_lines(tmp_path / "bad.jsonl", [good, line])
    with pytest.raises(JsonlError, match=r"bad\.jsonl" + message):
        read_samples(path)


def test_prompts_text_ids_answers_and_blank_lines(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "1+2=", "answer": 3}', "",
                                               '{"prompt_ids": [4, 5]}'])
    prompts = read_prompts(path, encode=lambda text: [ord(c) for c in text])
    assert [p.group_id for p in prompts] == [0, 1]
    assert prompts[0].prompt_ids == [49, 43, 50, 61] and prompts[0].answer == "3" and prompts[0].prompt == "1+2="
    assert prompts[1].prompt_ids == [4, 5] and prompts[1].answer is None


@pytest.mark.parametrize("line,message", [
    ('{"answer": 3}', r":1: needs `prompt`"),
    ('{"prompt_ids": []}', r":1: empty prompt"),
    ('{"prompt_ids": [1, 2.5]}', r":1: prompt_ids must be a list of integers"),
    ('{"prompt": "hi"}', r":1: text prompt but no tokenizer"),
    ('{"prompt_ids": [1], "answer": [1]}', r":1: answer must be a string or a number"),
])
def test_malformed_prompt_line(tmp_path, line, message):
    path = write_lines(tmp_path / "p.jsonl", [line])
    with pytest.raises(JsonlError, match=message):
        read_prompts(path)


def test_rollout_cli_reads_training_data_files_and_the_old_prompt_lines(tmp_path, capsys):
    """`megatron-gspo rollout --prompts` takes the project's own message-format data (as data.train reads it:
    through the tokenizer's chat template) as well as {prompt | prompt_ids, answer} lines."""
    import asyncio
    import threading

    from megatron_gspo import cli
    from megatron_gspo.data import write_arithmetic_data
    from megatron_gspo.dev.tiny_model import make_tiny_tokenizer
    from tests.unit.fake_sglang_server import FakeSGLang

    tokenizer = make_tiny_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    _, test = write_arithmetic_data(tmp_path / "data")  # 10 rows {"prompt": [{"role": "user", ...}], "answer"}
    rows = [json.loads(line) for line in test.read_text().splitlines()]
    old = write_lines(tmp_path / "old.jsonl", ['{"prompt": "1+2=", "answer": 3}', '{"prompt_ids": [4, 5]}'])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(FakeSGLang(delay_s=0).__aenter__(), loop).result()
    try:
        def rollout(prompts, *tokenizer_flag):
            out = tmp_path / "samples.jsonl"
            assert cli.main(["rollout", "--servers", server.url, "--prompts", str(prompts), "--out", str(out),
                             "--n", "2", *tokenizer_flag]) == 0
            return read_samples(out)

        samples = rollout(test, "--tokenizer", str(tmp_path / "tok"))
        # "3+4" as a user message renders "3+4=" (the tiny chat template)
        templated = [row["prompt"][0]["content"] + "=" for row in rows]
        assert [s.prompt for s in samples[::2]] == templated
        assert [s.prompt_ids for s in samples[::2]] == [tokenizer(t, add_special_tokens=False)["input_ids"]
                                                        for t in templated]
        assert [s.answer for s in samples[::2]] == [row["answer"] for row in rows]
        assert [(s.group_id, s.sample_index) for s in samples[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        samples = rollout(old, "--tokenizer", str(tmp_path / "tok"))
        assert [(s.prompt, s.prompt_ids, s.answer) for s in samples[::2]] == [
            ("1+2=", tokenizer("1+2=", add_special_tokens=False)["input_ids"], "3"), (None, [4, 5], None)]
        assert cli.main(["rollout", "--servers", server.url, "--prompts", str(test), "--out", str(tmp_path / "x")]) == 1
        assert re.search(r"test\.jsonl: prompts given as messages .* need a tokenizer", capsys.readouterr().err)
    finally:
        loop.call_soon_threadsafe(server.kill)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
