"""Multi-turn episodes against the real SGLang servers (CPU, the tiny random Qwen3): every token of a trajectory
checked against the chat template's rendering of its conversation, the sampler's log-probs of every turn against
a float32 recompute of the whole trajectory (the token-in/token-out gap per turn), every tool failure mode
through the worker pool, and the context length reached mid-episode (ours, and the server's own).

A random tiny model writes no tool call, so the episode here (`scripted_calls`) takes each real model turn and
then runs the calls of a script, as if the turn had written them: the tool pool, the error messages, the
template's rendering and the next turn's request are the real ones; parsing model text is tests/unit's."""
import asyncio

import pytest
import torch

from megatron_gspo.config import RolloutConfig, SamplingConfig
from megatron_gspo.rollout.agent.chat import ChatTemplate
from megatron_gspo.rollout.agent.episode import EpisodeRunner
from megatron_gspo.rollout.agent.tools import ToolBox, parse_tool_calls
from megatron_gspo.rollout.sglang.client import RolloutClient
from megatron_gspo.samples import Prompt
from sglang_test_utils import API_KEY, recompute_logprobs
from tests.agent_checks import check_against_rendering

pytestmark = pytest.mark.sglang

SCRIPT = [  # the calls "written" after each model turn; every failure mode of a tool call, and two that work
    '<tool_call>{"name": "misbehave", "arguments": {"how": "fine"}}</tool_call>'
    '<tool_call>{"name": "misbehave", "arguments": {"how": "raise"}}</tool_call>',
    '<tool_call>{"name": "misbehave", "arguments": {"how": "hang"}}</tool_call>'
    '<tool_call>{"name": "misbehave", "arguments": {"how": "crash"}}</tool_call>',
    '<tool_call>{"name": "misbehave", "arguments": {"how": "number"}}</tool_call>'
    '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    '<tool_call>{"name": "misbehave", "arguments": {"how": </tool_call>'
    '<tool_call>{"name": "echo", "arguments": {"text": "ok"}}</tool_call>',
]
ERRORS = ["misbehave raised ValueError: asked to raise", "misbehave timed out after 1 s", "misbehave crashed",
          "misbehave returned int, not a string", "unknown tool 'calculator'", "malformed tool call: not JSON"]


async def scripted_calls(ep) -> None:
    for text in SCRIPT:
        await ep.generate()
        ep.append_messages(await ep.call_tools(parse_tool_calls(text)))
    await ep.generate()


async def raw_turns(ep) -> None:
    while True:
        await ep.generate()
        ep.append("=")


def run(servers, tokenizer, prompts, n, episode, *, tools=None, max_context, sampling):
    async def main():
        client = RolloutClient([s.url for s in servers], RolloutConfig(api_key=API_KEY, concurrency=8))
        chat = ChatTemplate(tokenizer, tools.schemas if tools else None)
        runner = EpisodeRunner(client, tokenizer, RolloutConfig(max_turns=8), episode=episode, name="test",
                               tools=tools, chat=chat, max_context=max_context)
        return await runner.generate(prompts, n, sampling)
    return asyncio.run(main())


def test_episodes_are_their_rendered_conversation_and_every_tool_failure_is_a_message(servers, tokenizer, hf_model):
    tools = ToolBox(["tests.unit.agent_tools:misbehave", "tests.unit.agent_tools:echo"], workers=2, timeout_s=1.0)
    try:
        messages = [[{"role": "user", "content": f"{k}+{k + 1}"}] for k in range(3)]
        prompts = [Prompt(k, tokenizer(tokenizer.apply_chat_template(m, tools=tools.schemas, tokenize=False,
                                                                       add_generation_prompt=True))["input_ids"])
                   for k, m in enumerate(messages)]
        groups, stats = run(servers, tokenizer, prompts, 2, scripted_calls, tools=tools, max_context=2048,
                            sampling=SamplingConfig(temperature=1.0, max_new_tokens=6))
    finally:
        tools.close()
    gaps = [[] for _ in range(len(SCRIPT) + 1)]
    for group, prompt_messages in zip(groups, messages):
        for s in group:
            check_against_rendering(tokenizer, s, prompt_messages, tools.schemas)
            assert len(s.turns) == len(SCRIPT) + 1 and s.loss_mask.count(0) > 0
            errors = [c.error for c in s.tool_calls if c.error]
            assert len(errors) == len(ERRORS) and all(e.startswith(want) for e, want in zip(errors, ERRORS)), errors
            assert [c.result for c in s.tool_calls if c.error is None] == ["fine", "ok"]
            # The sampler saw exactly these ids turn by turn: its log-probs are a float32 recompute's of them.
            delta = (torch.tensor(s.rollout_logprobs) - recompute_logprobs(hf_model, s, 1.0)).abs()
            for k, t in enumerate(s.turns):
                gaps[k].append(delta[t.start:t.end])
    per_turn = [torch.cat(g) for g in gaps]
    print("\n|sampler - float32 recompute| per turn, mean / max: "
          + ", ".join(f"{d.mean():.1e} / {d.max():.1e}" for d in per_turn))
    assert all(d.mean() < 1e-4 and d.max() < 1e-3 for d in per_turn)
    assert (stats.episodes, stats.tool_calls, stats.tool_errors) == (6, 6 * 8, 6 * len(ERRORS))


def test_context_length_reached_mid_episode_ends_it_with_length(servers, tokenizer, tiny_model_dir):
    prompt = Prompt(0, tokenizer("3+4=")["input_ids"])
    # Our limit: room for a few turns of up to 5 tokens and their "=", then a turn cut short.
    limit = len(prompt.prompt_ids) + 17
    (group,), _ = run(servers, tokenizer, [prompt], 3, raw_turns, max_context=limit,
                      sampling=SamplingConfig(max_new_tokens=5))
    for s in group:
        assert s.finish_reason == "length" and len(s.prompt_ids) + len(s.response_ids) <= limit
        assert len(s.turns) >= 3 and s.loss_mask.count(0) == len(s.turns) - 1
    # The server's own: the default limit, the model's context length (2048) less what SGLang keeps back. Turns
    # right up to it are served (SGLang refuses an input of 2042 tokens, and would cut a longer max_new_tokens).
    from megatron_gspo.rollout.sglang.backend import SGLANG_CONTEXT_RESERVE, model_context_length
    limit = model_context_length(tiny_model_dir) - SGLANG_CONTEXT_RESERVE
    long_prompt = Prompt(1, (tokenizer("12+7=")["input_ids"] * 700)[:limit - 9])
    (group,), _ = run(servers, tokenizer, [long_prompt], 2, raw_turns, max_context=limit,
                      sampling=SamplingConfig(max_new_tokens=5))
    for s in group:
        assert s.finish_reason == "length" and len(s.turns) >= 2
        assert limit - 1 <= len(s.prompt_ids) + len(s.response_ids) <= limit
