"""Multi-turn episodes against a fake SGLang server (rollout/agent/): token in / token out bookkeeping, the
loss mask against the rendered conversation, tool calls and every way they fail, the context and turn limits,
custom episodes (rewards per turn, storage), and chat-template deltas (a Qwen3-style template)."""
import asyncio
import json

import pytest

from fake_sglang_server import FakeSGLang
from megatron_gspo.config import RolloutConfig, SamplingConfig
from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_tokenizer
from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rollout.agent.chat import ChatTemplate, Segment, TemplateError
from megatron_gspo.rollout.agent.episode import EpisodeError, EpisodeRunner, load_episode_fn
from megatron_gspo.rollout.agent.tools import ToolBox, parse_tool_calls, tool_episode, tool_schemas
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.config import RewardConfig
from megatron_gspo.samples import Prompt
from tests.agent_checks import check_against_rendering

FAST = dict(retry_backoff_s=0.01, request_timeout_s=10.0, connect_timeout_s=2.0)


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(TinyQwen3Spec(tools=True))


@pytest.fixture(scope="module")
def echo_tools():
    with_pool = ToolBox(["agent_tools:echo"], workers=1, timeout_s=5)
    yield with_pool
    with_pool.close()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def prompt_for(tok, content, tools=None, group_id=0):
    messages = [{"role": "user", "content": content}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return Prompt(group_id=group_id, prompt_ids=ids(tok, text), prompt=text, answer="7"), messages


def scripted(tok, turns, prompt_eos=0):
    """A fake model: turn k (k = how many EOS tokens the context holds after the prompt's `prompt_eos`) outputs
    turns[k] (text, or ids) + EOS, cut at the request's max_new_tokens ("length")."""
    eos = tok.eos_token_id

    def respond(input_ids, params):
        k = min(input_ids.count(eos) - prompt_eos, len(turns) - 1)
        out = (ids(tok, turns[k]) if isinstance(turns[k], str) else list(turns[k])) + [eos]
        if len(out) > params["max_new_tokens"]:
            return out[:params["max_new_tokens"]], "length"
        return out, "stop"
    return respond


def turn_requests(payloads):
    """(input_ids, sampling_params) of every turn the fake was asked for (a batched request holds several)."""
    out = []
    for p in payloads:
        batched = isinstance(p["input_ids"][0], list)
        ids = p["input_ids"] if batched else [p["input_ids"]]
        params = p["sampling_params"] if batched else [p["sampling_params"]]
        out += list(zip(ids, params))
    return out


def run_episodes(tok, respond, prompts, n=1, *, tools=None, episode=tool_episode, max_turns=4, max_context=512,
                 sampling=SamplingConfig(max_new_tokens=40), turns_per_request=64):
    """(groups, stats, the turns the fake was asked for: (input_ids, sampling_params) each)."""
    async def main():
        async with FakeSGLang(name="7", respond=respond) as server:
            from megatron_gspo.rollout.sglang.client import RolloutClient
            client = RolloutClient([server.url], RolloutConfig(turns_per_request=turns_per_request, **FAST))
            chat = ChatTemplate(tok, tools.schemas if tools else None)
            runner = EpisodeRunner(client, tok, RolloutConfig(max_turns=max_turns), episode=episode, name="test",
                                   tools=tools, chat=chat, max_context=max_context)
            groups, stats = await runner.generate(prompts, n, sampling)
            return groups, stats, turn_requests(server.received)
    return asyncio.run(main())


# ---- parsing -----------------------------------------------------------------------------------------

def test_qwen3_tool_calls_are_parsed_and_every_malformed_one_is_reported():
    text = ('let me see <tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call> and '
            '<tool_call>{"name": "calc", "arguments": "{\\"x\\": 2}"}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": {"x": </tool_call>'
            '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "calc", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "calc"')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calc", {"x": 1}), ("calc", {"x": 2})]
    assert [c.error is None for c in calls] == [True, True, False, False, False, False]
    assert "not JSON" in calls[2].error and "no tool name" in calls[3].error
    assert "arguments must be an object" in calls[4].error and "without </tool_call>" in calls[5].error
    assert parse_tool_calls("answer:7") == []


def test_schemas_come_from_signature_and_docstring():
    (schema,) = tool_schemas(["agent_tools:echo"])
    assert schema["function"]["name"] == "echo"
    assert schema["function"]["parameters"]["properties"]["text"]["type"] == "string"
    with pytest.raises(ValueError, match="no JSON schema"):
        tool_schemas(["agent_tools:no_docstring"])
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        tool_schemas(["agent_tools:echo", "agent_tools:echo"])


# ---- token in / token out ----------------------------------------------------------------------------

def test_token_in_token_out_and_the_mask_match_the_rendered_conversation(tok, echo_tools):
    # Turn 1 calls echo with "12" written as the two tokens "1" "2" (the BPE would merge them into "12"): the
    # trajectory must keep them as sampled, and send them back as they are in turn 2's input.
    call = ids(tok, '<tool_call>{"name": "echo", "arguments": {"text": "') + ids(tok, "1") + ids(tok, "2") \
        + ids(tok, '"}}</tool_call>')
    assert ids(tok, "12") != ids(tok, "1") + ids(tok, "2")
    prompt, messages = prompt_for(tok, "3+4", echo_tools.schemas)
    (group,), stats, received = run_episodes(tok, scripted(tok, [call, "answer:7"]), [prompt], tools=echo_tools)
    (s,) = group
    eos = tok.eos_token_id
    env = ids(tok, "<tool_response>12</tool_response>\n")
    assert s.response_ids == call + [eos] + env + ids(tok, "answer:7") + [eos]
    # What the sampler saw, request by request: the exact ids so far.
    assert [ids for ids, _ in received] == [prompt.prompt_ids, prompt.prompt_ids + call + [eos] + env]
    assert s.loss_mask == [1] * (len(call) + 1) + [0] * len(env) + [1] * 4
    model = [lp for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m]
    assert model == [-(t + 1) / 10 for t in range(len(call) + 1)] + [-(t + 1) / 10 for t in range(4)]
    assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if not m)
    assert [(t.start, t.end, t.finish_reason) for t in s.turns] == [(0, len(call) + 1, "stop"),
                                                                   (len(call) + 1 + len(env), len(s.response_ids), "stop")]
    assert [(c.name, c.arguments, c.result, c.error) for c in s.tool_calls] == [("echo", {"text": "12"}, "12", None)]
    assert s.finish_reason == "stop" and s.weight_version == "7" and s.model_tokens == len(call) + 5
    assert s.response_text.endswith("</tool_call><tool_response>12</tool_response>\nanswer:7")
    check_against_rendering(tok, s, messages, echo_tools.schemas)
    assert (stats.episodes, stats.turns, stats.tool_calls, stats.tool_errors) == (1, 2, 1, 0)
    assert (stats.env_tokens, stats.response_tokens) == (len(env), s.model_tokens)


def test_every_tool_failure_is_an_error_message_and_counted(tok):
    """raise, hang (past the time limit), crash, non-string, unknown tool, wrong arguments, malformed JSON: each
    an error message to the model, the episode goes on, the pool replaces the killed and the dead worker."""
    tools = ToolBox(["agent_tools:misbehave"], workers=1, timeout_s=1.0)
    try:
        calls = [('{"name": "misbehave", "arguments": {"how": "%s"}}' % how) for how in ("raise", "hang", "crash",
                                                                                        "number", "fine")]
        calls += ['{"name": "nope", "arguments": {}}', '{"name": "misbehave", "arguments": {"wrong": 1}}',
                  '{"name": "misbehave", "arguments": {"how": ']
        text = "".join(f"<tool_call>{c}</tool_call>" for c in calls)
        prompt, messages = prompt_for(tok, "3+4", tools.schemas)
        (group,), stats, _ = run_episodes(tok, scripted(tok, [text, "answer:7"]), [prompt], tools=tools,
                                          sampling=SamplingConfig(max_new_tokens=400), max_context=2048)
        (s,) = group
        errors = [c.error for c in s.tool_calls]
        assert errors[0] == "misbehave raised ValueError: asked to raise"
        assert errors[1] == "misbehave timed out after 1 s"
        assert errors[2].startswith("misbehave crashed (worker died (exit code 7")
        assert errors[3] == "misbehave returned int, not a string"
        assert errors[4] is None and s.tool_calls[4].result == "fine"
        assert errors[5] == "unknown tool 'nope' (tools: misbehave)"
        assert errors[6].startswith("misbehave raised TypeError")
        assert errors[7].startswith("malformed tool call: not JSON") and s.tool_calls[7].name is None
        assert stats.tool_errors == 7 and stats.tool_calls == 8 and len(s.turns) == 2
        rendered = check_against_rendering(tok, s, messages, tools.schemas)
        assert rendered.count("<tool_response>Error: ") == 7
        assert tools.replacements == 2   # the hung worker killed, the crashed one replaced
    finally:
        tools.close()


def test_context_full_mid_episode_ends_it_with_length(tok, echo_tools):
    call = '<tool_call>{"name": "echo", "arguments": {"text": "hello there"}}</tool_call>'
    prompt, _ = prompt_for(tok, "3+4", echo_tools.schemas)
    first = len(ids(tok, call)) + 1
    env = len(ids(tok, "<tool_response>hello there</tool_response>\n"))
    # Room for turn 1 and the tool result, and 3 tokens of turn 2: its request asks for exactly those.
    limit = len(prompt.prompt_ids) + first + env + 3
    (group,), _, received = run_episodes(tok, scripted(tok, [call, "answer:77777"]), [prompt], tools=echo_tools,
                                         max_context=limit)
    (s,) = group
    assert [params["max_new_tokens"] for _, params in received] == [40, 3]
    assert s.finish_reason == "length" and [t.finish_reason for t in s.turns] == ["stop", "length"]
    assert len(s.prompt_ids) + len(s.response_ids) == limit
    # The tool's answer would fill the context: not appended, the episode ends after turn 1.
    (group,), _, received = run_episodes(tok, scripted(tok, [call, "answer:7"]), [prompt], tools=echo_tools,
                                         max_context=len(prompt.prompt_ids) + first + env)
    (s,) = group
    assert len(received) == 1 and s.finish_reason == "length" and s.loss_mask == [1] * first
    assert [c.result for c in s.tool_calls] == ["hello there"]   # it ran; there was no room for its answer


def test_max_turns_ends_the_episode_and_the_last_calls_are_not_run(tok, echo_tools):
    call = '<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>'
    prompt, _ = prompt_for(tok, "3+4", echo_tools.schemas)
    (group,), stats, received = run_episodes(tok, scripted(tok, [call]), [prompt], tools=echo_tools, max_turns=3)
    (s,) = group
    assert len(received) == 3 and len(s.turns) == 3 and len(s.tool_calls) == 2
    assert s.finish_reason == "stop" and s.loss_mask[-1] == 1   # ends on the model's turn


@pytest.mark.parametrize("turns_per_request", [1, 5])
def test_groups_are_complete_and_raw_appends_work_without_a_template_turn(tok, turns_per_request):
    """Also: turns asked for together are batched, at most turns_per_request per request (1: one each)."""
    prompts = [prompt_for(tok, f"{k}+1", group_id=k)[0] for k in range(3)]
    raw = load_episode_fn("agent_tools:raw_episode")

    async def sizes():
        async with FakeSGLang(name="7", respond=scripted(tok, ["7"])) as server:
            from megatron_gspo.rollout.sglang.client import RolloutClient
            client = RolloutClient([server.url], RolloutConfig(turns_per_request=turns_per_request, **FAST))
            runner = EpisodeRunner(client, tok, RolloutConfig(max_turns=50), episode=raw, name="test", tools=None,
                                   chat=ChatTemplate(tok), max_context=len(prompts[0].prompt_ids) + 13)
            groups, stats = await runner.generate(prompts, 4, SamplingConfig(max_new_tokens=40))
            batched = [len(p["input_ids"]) if isinstance(p["input_ids"][0], list) else 1 for p in server.received]
            return groups, stats, batched
    groups, stats, batched = asyncio.run(sizes())
    assert sum(batched) == stats.turns and max(batched) == turns_per_request   # 12 episodes' turns at once
    assert sum(stats.requests_ok.values()) == len(batched)
    assert [[(s.group_id, s.sample_index) for s in g] for g in groups] == [[(k, i) for i in range(4)] for k in range(3)]
    obs = ids(tok, " obs\n")
    for s in (s for g in groups for s in g):
        # "7" EOS " obs\n" "7" EOS " obs\n" ... until no room is left for another model token
        assert s.response_ids[:2 + len(obs)] == ids(tok, "7") + [tok.eos_token_id] + obs
        assert s.finish_reason == "length" and len(s.prompt_ids) + len(s.response_ids) <= 13 + len(s.prompt_ids)


def test_custom_episode_rewards_per_turn_storage_and_the_outcome_on_the_last_turn(tok):
    prompt, _ = prompt_for(tok, "3+4")
    episode = load_episode_fn("agent_tools:rewarded_episode")
    (group,), _, received = run_episodes(tok, scripted(tok, ["5", "7"]), [prompt], n=2, episode=episode)
    assert sorted(params["max_new_tokens"] for _, params in received) == [8, 8, 40, 40]  # turn 2's override
    for s in group:
        assert [t.reward for t in s.turns] == [0.25, 0.5] and s.storage == {"first": "5"}
    # The outcome reward (here 1.0 for every sample) goes on the last turn; the sample's reward is the sum.
    with RewardPool("agent_tools:one", workers=1) as pool:
        asyncio.run(Scorer(pool, RewardConfig(fn="agent_tools:one", workers=1)).score([group]))
    assert [s.reward for s in group] == [1.75, 1.75] and [t.reward for t in group[0].turns] == [0.25, 1.5]
    # The reward function reads the whole trajectory, environment tokens included.
    assert group[0].response_text == "5again=7"


def test_episode_errors_are_named_and_overrides_checked(tok):
    prompt, _ = prompt_for(tok, "3+4")
    with pytest.raises(EpisodeError, match="episode test raised on group 0 sample 0 after 1 turn.*the environment broke"):
        run_episodes(tok, scripted(tok, ["5"]), [prompt], episode=load_episode_fn("agent_tools:raising_episode"))
    with pytest.raises(EpisodeError, match="cannot override temperature"):
        run_episodes(tok, scripted(tok, ["5"]), [prompt], episode=load_episode_fn("agent_tools:hot_episode"))
    with pytest.raises(ValueError, match="must be an async function"):
        load_episode_fn("agent_tools:not_async")


# ---- chat-template deltas ----------------------------------------------------------------------------

QWEN3_STYLE = (  # the structure of Qwen3's template, shortened: <|im_start|>role\n...<|im_end|>\n, the tools in a
    # system block, consecutive tool results grouped into one user block (its think blocks left out)
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{% for t in tools %}{{- t | tojson }}{% endfor %}"
    "{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def qwen_tok():
    t = make_tiny_tokenizer(TinyQwen3Spec(tools=True))
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    t.chat_template = QWEN3_STYLE
    t.eos_token = "<|im_end|>"
    return t


def test_qwen3_style_deltas_carry_the_newline_after_the_end_of_turn_token(qwen_tok):
    chat = ChatTemplate(qwen_tok)
    tool = [{"role": "tool", "content": "42"}]
    # The model wrote "...<|im_end|>": the environment appends the template's newline after it, the tool block,
    # and (before the next turn) the generation prompt.
    segment = Segment(chat, "<|im_end|>")
    assert segment.add(tool) == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    assert segment.generation_prompt() == "<|im_start|>assistant\n"
    # A turn cut by max_new_tokens wrote no end-of-turn token: the environment writes it.
    assert Segment(chat, "").add(tool).startswith("<|im_end|>\n<|im_start|>user")
    # Two results appended one by one render differently (regrouped into one user block): refused.
    segment = Segment(chat, "<|im_end|>")
    segment.add(tool)
    with pytest.raises(TemplateError, match="append all of a turn's messages in one call"):
        segment.add(tool)
    # Together they are one text.
    both = Segment(chat, "<|im_end|>").add(tool + tool)
    assert both.count("<tool_response>") == 2 and both.count("<|im_start|>user") == 1


def test_qwen3_style_episode_matches_its_rendering_token_by_token(qwen_tok, echo_tools):
    call = '<tool_call>\n{"name": "echo", "arguments": {"text": "4"}}\n</tool_call>'
    prompt, messages = prompt_for(qwen_tok, "2+2", echo_tools.schemas)
    respond = scripted(qwen_tok, [call, "4"], prompt_eos=prompt.prompt_ids.count(qwen_tok.eos_token_id))
    (group,), _, received = run_episodes(qwen_tok, respond, [prompt], tools=echo_tools)
    (s,) = group
    check_against_rendering(qwen_tok, s, messages, echo_tools.schemas)
    text = qwen_tok.decode(received[1][0], skip_special_tokens=False)
    assert text.endswith("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_calls_in_a_custom_episode_with_tools(tok, echo_tools):
    call = '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>'
    prompt, messages = prompt_for(tok, "3+4", echo_tools.schemas)
    (group,), _, _ = run_episodes(tok, scripted(tok, [call, "answer:7"]), [prompt], tools=echo_tools,
                                  episode=load_episode_fn("agent_tools:tool_then_parse"))
    check_against_rendering(tok, group[0], messages, echo_tools.schemas)
    assert json.dumps([c.result for c in group[0].tool_calls]) == '["hi"]'


def test_tools_need_a_template_that_renders_them_and_templated_prompts(tok):
    from megatron_gspo.config import DataConfig
    from megatron_gspo.data.errors import DataError
    from megatron_gspo.data.templates import render_prompt
    from megatron_gspo.training.preflight import check_tool_template

    schemas = tool_schemas(["agent_tools:echo"])
    check_tool_template(tok, schemas, {})   # the tiny template renders both
    saved = tok.chat_template
    try:
        tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
        with pytest.raises(ValueError, match="does not render tools"):
            check_tool_template(tok, schemas, {})
        tok.chat_template = ("{% if tools %}{{ tools[0].function.name }}{% endif %}"
                             "{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}")
        with pytest.raises(ValueError, match="leaves out a tool message's content"):
            check_tool_template(tok, schemas, {})
    finally:
        tok.chat_template = saved
    with pytest.raises(DataError, match="rollout.tools are rendered by the chat template"):
        render_prompt("3+4=", DataConfig(), tok, "row 0", schemas)
    assert render_prompt("3+4", DataConfig(chat_template="true"), tok, "row 0", schemas) == "tools:echo(text)\n3+4="
