"""Tools and episodes for the multi-turn tests, loaded as "agent_tools:NAME" (tests/unit is on the test process's
sys.path; the tool pool passes it on to its workers). `misbehave` fails in each way a tool can."""
import os
import time

from megatron_gspo.rollout.agent.tools import parse_tool_calls


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: What to repeat.
    """
    return text


def misbehave(how: str) -> str:
    """Fail on purpose.

    Args:
        how: "raise", "hang", "crash", "number" or anything else (returned as it is).
    """
    if how == "raise":
        raise ValueError("asked to raise")
    if how == "hang":
        while True:
            time.sleep(0.05)
    if how == "crash":
        os._exit(7)
    if how == "number":
        return 42
    return how


def no_docstring(x: int) -> str:
    return str(x)


async def rewarded_episode(ep) -> None:
    """Two turns with an environment message between them; a reward per turn; something stored."""
    first = await ep.generate()
    ep.add_reward(0.25)
    ep.storage["first"] = first.text
    ep.append_messages([{"role": "user", "content": "again"}])
    await ep.generate(max_new_tokens=8)
    ep.add_reward(0.5)


async def raising_episode(ep) -> None:
    await ep.generate()
    raise RuntimeError("the environment broke")


async def hot_episode(ep) -> None:
    await ep.generate(temperature=2.0)


async def raw_episode(ep) -> None:
    """Turns separated by raw text, until the context runs out (no max_turns in the way of the test)."""
    while True:
        await ep.generate()
        ep.append(" obs\n")


async def tool_then_parse(ep) -> None:
    """The tool episode spelled out with the public API (what a custom episode with tools does)."""
    turn = await ep.generate()
    ep.append_messages(await ep.call_tools(parse_tool_calls(turn.text)))
    await ep.generate()


def not_async(ep):
    return None


def one(sample) -> float:
    """A reward function: 1.0 for every sample (the outcome reward of the per-turn tests)."""
    return 1.0
