"""Rollout client against fake SGLang servers: grouping, round-robin, failover, clear errors."""
import asyncio
import pytest

from fake_sglang_server import FakeSGLang
from megatron_gspo.config import RolloutConfig
from megatron_gspo.config import SamplingConfig
from megatron_gspo.rollout.sglang.client import (RolloutClient, RolloutError, ServerResponseError,
                                          sglang_sampling_params)
from megatron_gspo.samples import Prompt

G = 4
FAST = dict(retry_backoff_s=0.01, request_timeout_s=5.0, connect_timeout_s=2.0)


def prompts(k: int) -> list[Prompt]:
    return [Prompt(group_id=i, prompt_ids=[i + 1, 7]) for i in range(k)]


def assert_complete(groups, k: int):
    """Exactly G samples per prompt, in prompt order, none lost or duplicated."""
    assert [g[0].group_id for g in groups] == list(range(k))
    for gid, group in enumerate(groups):
        assert [s.sample_index for s in group] == list(range(G))
        assert all(s.group_id == gid for s in group)
        # The fake encodes the prompt's first id into every output id: the group was not mixed up.
        assert all(s.response_ids[0] // 100 == gid + 1 for s in group)
        assert len({s.weight_version for s in group}) == 1  # a group comes whole from one server


def run(coro):
    return asyncio.run(coro)


def test_groups_are_spread_round_robin_and_complete():
    async def main():
        async with FakeSGLang(name="a") as a, FakeSGLang(name="b") as b:
            client = RolloutClient([a.url, b.url], RolloutConfig(concurrency=3, **FAST))
            groups, stats = await client.generate(prompts(10), G, SamplingConfig(max_new_tokens=3, top_k=5))
            return groups, stats, a, b
    groups, stats, a, b = run(main())
    assert_complete(groups, 10)
    assert (a.answered, b.answered) == (5, 5)
    sent = a.received[0]
    assert sent["sampling_params"] == {"n": G, "temperature": 1.0, "top_p": 1.0, "top_k": 5, "max_new_tokens": 3}
    assert sent["return_logprob"] is True and sent["logprob_start_len"] == -1
    assert stats.response_tokens == 10 * G * 3 and not stats.failures
    assert groups[0][0].rollout_logprobs == [-0.5, -0.5, -0.5]


@pytest.mark.parametrize("keep", [False, True])
def test_kept_connections_outlive_a_call(keep):
    """keep_connections: the calls in one event loop share one connection (a loop kept across rollout
    steps); without it each call connects anew; close_connections closes it."""
    async def main():
        async with FakeSGLang(name="a") as a:
            client = RolloutClient([a.url], RolloutConfig(concurrency=1, **FAST))
            if keep:
                await client.keep_connections()
            for i in range(3):
                groups, _ = await client.generate(prompts(1), G)
                assert_complete(groups, 1)
            await client.close_connections()
            assert not client._kept
            return a.connections
    assert run(main()) == (1 if keep else 3)


def test_copies_ask_for_a_group_as_g_prompts_with_n_1():
    async def main():
        async with FakeSGLang(name="a") as a:
            config = RolloutConfig(parallel_sampling="copies", **FAST)
            groups, _ = await RolloutClient([a.url], config).generate(prompts(3), G, SamplingConfig(max_new_tokens=3))
            return groups, a
    groups, a = run(main())
    assert_complete(groups, 3)
    assert len(a.received) == 3  # still one request per group
    sent = a.received[0]
    assert sent["input_ids"] == [[1, 7]] * G and sent["sampling_params"]["n"] == 1


def test_server_dying_mid_batch_loses_and_duplicates_nothing():
    async def main():
        async with FakeSGLang(name="a", die_after=3, delay_s=0.02) as a, FakeSGLang(name="b", delay_s=0.02) as b:
            client = RolloutClient([a.url, b.url], RolloutConfig(concurrency=2, **FAST))
            groups, stats = await client.generate(prompts(16), G)
            return groups, stats, a, b
    groups, stats, a, b = run(main())
    assert_complete(groups, 16)
    # a answered at most 3 requests before it died (one more may have been cut off mid-answer);
    # every group was delivered exactly once over both servers.
    assert a.answered <= 3 and a.answered + b.answered == 16
    assert a.url in stats.retired
    assert sum(stats.requests_ok.values()) == 16
    assert all(url == a.url for url, _, _ in stats.failures)


def test_stalled_server_times_out_and_its_groups_go_elsewhere():
    async def main():
        async with FakeSGLang(name="a", stall=True) as a, FakeSGLang(name="b") as b:
            config = RolloutConfig(concurrency=2, retry_backoff_s=0.01, request_timeout_s=0.5,
                                  max_server_failures=1)
            groups, stats = await RolloutClient([a.url, b.url], config).generate(prompts(6), G)
            return groups, stats, b
    groups, stats, b = run(main())
    assert_complete(groups, 6)
    assert b.answered == 6
    assert any("Timeout" in err for _, _, err in stats.failures)


def test_aborted_samples_are_retried_on_another_server():
    async def main():
        async with FakeSGLang(name="a", abort=True) as a, FakeSGLang(name="b") as b:
            return await RolloutClient([a.url, b.url], RolloutConfig(**FAST)).generate(prompts(4), G)
    groups, stats = run(main())
    assert_complete(groups, 4)
    assert all(s.weight_version == "b" for g in groups for s in g)


def test_unreachable_servers_give_a_clear_error():
    async def main():
        async with FakeSGLang() as a, FakeSGLang() as b:
            urls = [a.url, b.url]
        # both closed now: connection refused
        await RolloutClient(urls, RolloutConfig(**FAST)).generate(prompts(3), G)
    with pytest.raises(RolloutError, match="all 2 servers failed") as info:
        run(main())
    assert "ConnectError" in str(info.value)


def test_wrong_api_key_fails_fast_without_retries():
    async def main():
        async with FakeSGLang(api_key="secret") as a:
            client = RolloutClient([a.url], RolloutConfig(api_key="wrong", **FAST))
            with pytest.raises(RolloutError, match="HTTP 401.*API key"):
                await client.generate(prompts(3), G)
            ok, _ = await RolloutClient([a.url], RolloutConfig(api_key="secret", **FAST)).generate(prompts(3), G)
            return ok
    assert_complete(run(main()), 3)


@pytest.mark.parametrize("fault,message", [("null_logprob", "log-prob is None"),
                                           ("short_logprobs", "3 output ids but 2 log-probs")])
def test_bad_logprobs_are_errors_not_nan(fault, message):
    async def main():
        async with FakeSGLang(**{fault: True}) as a:
            await RolloutClient([a.url], RolloutConfig(**FAST)).generate(prompts(2), G)
    with pytest.raises(ServerResponseError, match=message):
        run(main())


def test_group_out_of_attempts_names_the_group_and_errors():
    async def main():
        async with FakeSGLang(name="a", abort=True) as a:
            config = RolloutConfig(max_attempts=2, max_server_failures=10, **FAST)
            await RolloutClient([a.url], config).generate(prompts(1), G)
    with pytest.raises(RolloutError, match="group 0 failed after 2 attempts.*aborted"):
        run(main())


def test_invalid_arguments():
    with pytest.raises(ValueError, match="duplicate"):
        RolloutClient(["http://x:1", "http://x:1"], RolloutConfig())
    with pytest.raises(ValueError, match="unique"):
        asyncio.run(RolloutClient(["http://x:1"], RolloutConfig()).generate([Prompt(0, [1]), Prompt(0, [2])], G))
    assert sglang_sampling_params(SamplingConfig(stop_token_ids=(5,)), 2)["stop_token_ids"] == [5]


def answer(tokens, spans=None, version="7"):
    """One /generate answer item: output ids 10, 11, ... with log-probs, optionally per-token versions."""
    ids = list(range(10, 10 + tokens))
    meta = {"finish_reason": {"type": "length"}, "weight_version": version,
            "output_token_logprobs": [[-0.5, t, None] for t in ids]}
    if spans is not None:
        meta["weight_versions"] = spans
    return {"output_ids": ids, "meta_info": meta, "text": "x"}


def test_weight_version_spans_set_the_stale_prefix():
    """A response continued after a weight push (rollout.partial_rollout): the tokens before the last
    version's span are its stale prefix, the last span's version is the sample's."""
    from megatron_gspo.rollout.sglang.client import parse_generate_response
    prompt = Prompt(group_id=3, prompt_ids=[1, 2])
    cut = answer(5, [{"version": "6", "start": 0, "end": 2}, {"version": "7", "start": 2, "end": 5}])
    whole = answer(5, [{"version": "7", "start": 0, "end": 5}])
    twice = answer(6, [{"version": "5", "start": 0, "end": 1}, {"version": "6", "start": 1, "end": 4},
                       {"version": "7", "start": 4, "end": 6}])
    samples = parse_generate_response([cut, whole, twice], prompt, 3, weight_spans=True)
    assert [(s.weight_version, s.stale_prefix) for s in samples] == [("7", 2), ("7", 0), ("7", 4)]
    # without spans in the answer: fine unless they are required
    (plain,) = parse_generate_response(answer(3, version="4"), prompt, 1)
    assert (plain.weight_version, plain.stale_prefix) == ("4", 0)
    with pytest.raises(ServerResponseError, match="no meta_info.weight_versions"):
        parse_generate_response(answer(3), prompt, 1, weight_spans=True)


@pytest.mark.parametrize("spans, message", [
    ([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 3, "end": 5}], "do not cover"),
    ([{"version": "1", "start": 0, "end": 4}], "cover 4 tokens, the answer has 5"),
    ([{"version": "1", "start": 0, "end": 5}, {"version": "2", "start": 5, "end": 5}], "do not cover"),
    ([{"version": "1", "start": 0}], "malformed"),
])
def test_spans_that_do_not_cover_the_response_are_errors(spans, message):
    from megatron_gspo.rollout.sglang.client import parse_generate_response
    with pytest.raises(ServerResponseError, match=message):
        parse_generate_response(answer(5, spans), Prompt(group_id=0, prompt_ids=[1]), 1)


@pytest.mark.parametrize("parallel_sampling", ["n", "copies"])
def test_several_groups_per_request_come_back_whole_and_in_order(parallel_sampling):
    """groups_per_request=3: 8 groups in requests of 3, 3 and 2 (SGLang's batch form); a server dying mid-call
    has its request's groups sent again together, none lost or duplicated; on_group sees every group once."""
    seen = []

    async def main():
        async with FakeSGLang(name="a", die_after=1) as a, FakeSGLang(name="b") as b:
            config = RolloutConfig(parallel_sampling=parallel_sampling, groups_per_request=3, **FAST)
            groups, stats = await RolloutClient([a.url, b.url], config).generate(prompts(8), G, on_group=seen.append)
            return groups, stats, a, b
    groups, stats, a, b = run(main())
    assert_complete(groups, 8)
    assert sorted(g[0].group_id for g in seen) == list(range(8))
    payloads = a.received + b.received
    sizes = sorted(len(p["input_ids"]) // (G if parallel_sampling == "copies" else 1) for p in payloads)
    assert set(sizes) == {2, 3} and sizes.count(2) >= 1 and sizes.count(3) >= 2
    failed = {gid for _, gid, _ in stats.failures}          # a request's groups fail and go again together
    assert failed and all(chunk <= failed or not chunk & failed for chunk in ({0, 1, 2}, {3, 4, 5}, {6, 7}))
    assert a.answered + b.answered == 3 and a.url in stats.retired  # each request delivered once


def test_a_connection_the_server_closed_is_replaced_without_counting_a_failure():
    """Kept-alive connections a healthy server closed (uvicorn after 5 s idle; episodes send hundreds of short
    requests) fail the request sent on them: it goes again on a new connection at once, uncounted. Counted, two
    in a row would retire the only server."""
    async def main():
        async with FakeSGLang(name="a", drop_reused=True) as a:
            client = RolloutClient([a.url], RolloutConfig(concurrency=1, max_server_failures=2, **FAST))
            await client.keep_connections()
            try:
                for _ in range(4):   # one kept-alive client: every call after the first meets a closed connection
                    groups, stats = await client.generate(prompts(2), G, SamplingConfig(max_new_tokens=3))
                    assert_complete(groups, 2)
                    assert not stats.failures
            finally:
                await client.close_connections()
            return a.dropped
    assert run(main()) >= 4
