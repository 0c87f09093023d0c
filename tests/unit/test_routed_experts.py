"""Routed experts from SGLang 0.5.23 answers into Sample.routed_experts: the wire format as SGLang builds
it, shape / id checks, trimming, dtypes, the JSONL encoding, the client option, the server flag, and the
reward workers not receiving the array."""
import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fake_sglang_server import FakeSGLang, fake_routing
from megatron_gspo.config import RolloutConfig
from megatron_gspo.config import SamplingConfig
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, tiny_qwen3_config
from megatron_gspo.rewards.pool import RewardPool, Score
from megatron_gspo.rollout.sglang.client import RolloutClient, ServerResponseError
from megatron_gspo.rollout.jsonl import JsonlError, read_samples, write_samples
from megatron_gspo.rollout.sglang.routed_experts import (RoutingSpec, bytes_per_token, decode_routed_experts,
                                                  encode_for_sglang_wire, routing_dtype)
from megatron_gspo.rollout.sglang.server import CPU_STUBS_DIR, ServerConfig, SGLangServer, default_sglang_python
from megatron_gspo.samples import Prompt, Sample

SPEC = RoutingSpec(num_layers=3, topk=2, num_experts=8)


def sglang_like_answer(host_TLk: np.ndarray, req_to_token: np.ndarray, seqlen: int) -> str:
    """meta_info["routed_experts"] built the way SGLang 0.5.23 builds it (paths under sglang/srt/):
    the int32 host buffer [KV slots, L, k] (state_capturer/base.py:68-72) is indexed by the request's KV
    slots of positions [0, seqlen - 1) (base.py:183-188, start_len 0; seqlen = prompt + output ids,
    managers/scheduler_components/batch_result_processor.py:155), then base64 of the tensor's bytes
    (managers/detokenizer_manager.py:443)."""
    rows = host_TLk[req_to_token[: seqlen - 1]]
    return base64.b64encode(rows.tobytes()).decode("utf-8")


def test_parser_reads_the_rows_sglang_sends():
    P, R = 4, 3
    rng = np.random.default_rng(0)
    # 16 KV slots; the request's P + R tokens sit in scattered slots, as the allocator hands them out.
    host = rng.integers(0, SPEC.num_experts, size=(16, SPEC.num_layers, SPEC.topk)).astype(np.int32)
    req_to_token = rng.permutation(16)[: P + R]
    ids = decode_routed_experts(sglang_like_answer(host, req_to_token, P + R), prompt_len=P, response_len=R,
                                spec=SPEC)
    # Position p's routing is the host row of p's slot: positions 0..P+R-2 (the last token has none).
    np.testing.assert_array_equal(ids, host[req_to_token[: P + R - 1]])
    assert ids.shape == (P + R - 1, 3, 2) and ids.dtype == np.uint8 and ids.flags.writeable


def test_one_extra_trailing_position_is_trimmed():
    P, R = 2, 3
    full = fake_routing(P + R, 3, 2, 8, salt=0)  # also the last response token's routing
    ids = decode_routed_experts(encode_for_sglang_wire(full), prompt_len=P, response_len=R, spec=SPEC)
    np.testing.assert_array_equal(ids, full[: P + R - 1])


@pytest.mark.parametrize("positions", [3, 6])  # P + R - 1 = 4: one short, two too many
def test_wrong_position_count_names_the_sample(positions):
    wire = encode_for_sglang_wire(fake_routing(positions, 3, 2, 8, salt=0))
    with pytest.raises(ValueError, match=rf"group 7, sample 1: routed_experts covers {positions} positions, "
                                         r"expected P \+ R - 1 = 2 \+ 3 - 1 = 4"):
        decode_routed_experts(wire, prompt_len=2, response_len=3, spec=SPEC, where="group 7, sample 1")


def test_wrong_layer_or_topk_is_an_error():
    wire = encode_for_sglang_wire(fake_routing(4, 3, 2, 8, salt=0))  # 4 * 3 * 2 int32 = 96 bytes
    with pytest.raises(ValueError, match=r"96 bytes, not a multiple of 4 \* L \* k = 40 \(L=5 layers, k=2"):
        decode_routed_experts(wire, prompt_len=2, response_len=3, spec=RoutingSpec(5, 2, 8))
    # 4 positions of L=3, k=2 are also 3 positions of L=4, k=2 (96 bytes either way): the count catches it.
    with pytest.raises(ValueError, match="covers 3 positions"):
        decode_routed_experts(wire, prompt_len=2, response_len=3, spec=RoutingSpec(4, 2, 8))


@pytest.mark.parametrize("bad", [8, -1])
def test_ids_outside_the_experts_are_errors(bad):
    ids = fake_routing(4, 3, 2, 8, salt=0)
    ids[2, 1, 0] = bad
    with pytest.raises(ValueError, match=rf"routed_experts\[2, 1, 0\] = {bad} is not an expert id \(0..7\)"):
        decode_routed_experts(encode_for_sglang_wire(ids), prompt_len=2, response_len=3, spec=SPEC)


@pytest.mark.parametrize("value, message", [("not base64!", "not valid base64"),
                                            ([[1, 2]], "is list, expected SGLang's base64 string")])
def test_malformed_field(value, message):
    with pytest.raises(ValueError, match=message):
        decode_routed_experts(value, prompt_len=2, response_len=3, spec=SPEC)


def test_dtypes_and_sizes():
    assert routing_dtype(8) == np.uint8 and routing_dtype(256) == np.uint8
    assert routing_dtype(257) == np.int16 and routing_dtype(32768) == np.int16
    with pytest.raises(ValueError, match="32769 does not fit int16"):
        routing_dtype(32769)
    assert bytes_per_token(48, 8, 128) == 384          # Qwen3-30B-A3B: 48 layers x 8 of 128 experts, 1 byte
    assert bytes_per_token(94, 8, 128) == 752          # Qwen3-235B-A22B
    assert bytes_per_token(61, 8, 384) == 61 * 8 * 2   # more than 256 experts: 2 bytes
    big = RoutingSpec(num_layers=2, topk=2, num_experts=300)
    ids = fake_routing(4, 2, 2, 300, salt=292)  # ids 292..299: need int16
    out = decode_routed_experts(encode_for_sglang_wire(ids), prompt_len=2, response_len=3, spec=big)
    assert out.dtype == np.int16 and out.max() == 299
    np.testing.assert_array_equal(out, ids)
    with pytest.raises(ValueError, match="need L >= 1 and 1 <= k <= num_experts"):
        RoutingSpec(num_layers=2, topk=9, num_experts=8)


def test_spec_from_the_hf_config(tmp_path):
    moe = tiny_qwen3_config(TinyQwen3Spec(num_layers=3, num_experts=8, num_experts_per_tok=2))
    (tmp_path / "moe").mkdir()
    moe.to_json_file(tmp_path / "moe" / "config.json")
    assert RoutingSpec.from_hf_config(tmp_path / "moe") == RoutingSpec(num_layers=3, topk=2, num_experts=8)
    (tmp_path / "dense").mkdir()
    tiny_qwen3_config(TinyQwen3Spec()).to_json_file(tmp_path / "dense" / "config.json")
    with pytest.raises(ValueError, match=r"dense/config.json: not a MoE config, no num_experts_per_tok"):
        RoutingSpec.from_hf_config(tmp_path / "dense")


def routed_sample(ids, group_id=3, index=0, P=2, R=3):
    return Sample(group_id=group_id, sample_index=index, prompt_ids=list(range(1, P + 1)),
                  response_ids=list(range(10, 10 + R)), rollout_logprobs=[-0.5] * R, finish_reason="stop",
                  response_text="x", routed_experts=ids)


def test_jsonl_round_trip_keeps_values_and_dtype(tmp_path):
    small = fake_routing(4, 3, 2, 8, salt=1).astype(np.uint8)
    wide = fake_routing(4, 3, 2, 300, salt=299).astype(np.int16)
    samples = [routed_sample(small), routed_sample(wide, index=1), routed_sample(None, index=2)]
    write_samples(tmp_path / "s.jsonl", samples)
    line = json.loads((tmp_path / "s.jsonl").read_text().splitlines()[0])
    assert line["routed_experts"]["dtype"] == "uint8" and line["routed_experts"]["shape"] == [4, 3, 2]
    back = read_samples(tmp_path / "s.jsonl")
    for original, read in zip(samples[:2], back[:2]):
        assert read.routed_experts.dtype == original.routed_experts.dtype
        np.testing.assert_array_equal(read.routed_experts, original.routed_experts)
    assert back[2].routed_experts is None
    assert back[1].routed_experts.max() == 299  # not wrapped to a byte on the way


@pytest.mark.parametrize("change, message", [
    (dict(shape=[5, 3, 2]), "has 5 positions, but P \\+ R - 1 = 4"),
    (dict(dtype="int32"), "dtype 'int32' is not one of"),
    (dict(data=base64.b64encode(b"\0" * 23).decode()), "data has 23 bytes, shape \\[4, 3, 2\\] of uint8 needs 24"),
    (dict(data="%%%"), "data is not base64"),
])
def test_malformed_routing_in_jsonl_names_file_and_line(tmp_path, change, message):
    write_samples(tmp_path / "s.jsonl", [routed_sample(fake_routing(4, 3, 2, 8, salt=0).astype(np.uint8))])
    row = json.loads((tmp_path / "s.jsonl").read_text())
    row["routed_experts"].update(change)
    (tmp_path / "s.jsonl").write_text("\n" + json.dumps(row) + "\n")
    with pytest.raises(JsonlError, match=rf"s.jsonl:2: routed_experts {message}"):
        read_samples(tmp_path / "s.jsonl")


FAST = dict(retry_backoff_s=0.01, request_timeout_s=5.0, connect_timeout_s=2.0)
PROMPTS = [Prompt(group_id=i, prompt_ids=[i + 1, 7, 9]) for i in range(3)]


def rollout(fake_kwargs, routing):
    async def main():
        async with FakeSGLang(**fake_kwargs) as server:
            client = RolloutClient([server.url], RolloutConfig(**FAST), routed_experts=routing)
            groups, _ = await client.generate(PROMPTS, 2, SamplingConfig(max_new_tokens=3))
            return groups, server.received
    return asyncio.run(main())


def test_client_fills_routed_experts():
    groups, received = rollout(dict(routing=(3, 2, 8), response_len=4), SPEC)
    assert all(payload["return_routed_experts"] is True for payload in received)
    for group in groups:
        for sample in group:
            P, R = len(sample.prompt_ids), len(sample.response_ids)
            assert sample.routed_experts.shape == (P + R - 1, 3, 2) == (6, 3, 2)
            assert sample.routed_experts.dtype == np.uint8
            np.testing.assert_array_equal(sample.routed_experts, fake_routing(6, 3, 2, 8, salt=sample.sample_index))


def test_client_without_the_option_asks_for_nothing():
    groups, received = rollout(dict(routing=(3, 2, 8)), None)
    assert all("return_routed_experts" not in payload for payload in received)
    assert all(s.routed_experts is None for g in groups for s in g)


def test_server_without_the_flag_is_a_clear_error():
    with pytest.raises(ServerResponseError, match=r"group 0, sample 0: no meta_info.routed_experts .*"
                                                  r"--enable-return-routed-experts"):
        rollout(dict(routing=None), SPEC)


def test_routing_of_another_model_names_group_and_sample():
    with pytest.raises(ServerResponseError, match=r"group \d, sample 0: routed_experts covers 7 positions, "
                                                  r"expected P \+ R - 1 = 3 \+ 3 - 1 = 5"):
        rollout(dict(routing=(3, 2, 8), routing_extra_positions=2), SPEC)


def test_server_flag(tmp_path):
    def command(**kw):
        return SGLangServer(ServerConfig(model_path=str(tmp_path), settings=RolloutConfig(), device="cpu", dtype=None,
                                         python=sys.executable, log_dir=str(tmp_path), **kw), port=1).command()
    assert "--enable-return-routed-experts" in command(return_routed_experts=True)
    assert "--enable-return-routed-experts" not in command()


def test_reward_workers_do_not_receive_the_routing(tmp_path, monkeypatch):
    # A reward function that reports what reached it; the pool hands the test's sys.path to its workers.
    (tmp_path / "routing_probe.py").write_text(
        "import sys\n"
        "def probe(sample):\n"
        "    return float(sample.routed_experts is None) + 2 * float('numpy' in sys.modules)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sample = routed_sample(np.zeros((4, 48, 8), np.uint8))
    with RewardPool("routing_probe:probe", workers=1, timeout_s=10) as pool:
        assert pool.score([sample]) == [Score(1.0, "ok")]  # no array, and numpy never imported
    assert sample.routed_experts is not None  # the trainer's sample keeps it


@pytest.mark.sglang
def test_sglangs_own_code_builds_what_the_parser_reads():
    """SGLang 0.5.23's own BaseTopkCapturer.get_topk and DetokenizerManager._b64_encode_per_request (in its
    environment, with the CPU import stand-ins) make the string; the parser gets back the same rows."""
    python = default_sglang_python()
    if not Path(python).exists():
        pytest.skip(f"no SGLang environment at {python} (scripts/setup_sglang.sh)")
    script = """
import json, types, torch
from sglang.srt.state_capturer.base import BaseTopkCapturer
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
gen = torch.Generator().manual_seed(0)
capturer = BaseTopkCapturer.__new__(BaseTopkCapturer)  # no device buffers: only the host readback
capturer.host_cache = types.SimpleNamespace(buffer=torch.randint(0, 8, (16, 3, 2), dtype=torch.int32, generator=gen))
slots = torch.randperm(16, generator=gen)[:7]
pool = types.SimpleNamespace(req_to_token=slots[None, :])
rows = capturer.get_topk(req_pool_idx=0, seqlen=7, req_to_token_pool=pool)
wire = DetokenizerManager._b64_encode_per_request([rows])[0]
print(json.dumps({"wire": wire, "rows": rows.tolist()}))
"""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(CPU_STUBS_DIR))
    out = subprocess.run([python, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    ids = decode_routed_experts(answer["wire"], prompt_len=4, response_len=3, spec=SPEC)
    np.testing.assert_array_equal(ids, np.array(answer["rows"]))
    assert ids.shape == (6, 3, 2)
