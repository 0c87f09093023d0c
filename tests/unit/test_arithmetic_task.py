"""The demo task: its prompt stream resumes from a position, its reward is exact match before EOS."""
from collections import Counter

from megatron_gspo.cli import main
from megatron_gspo.tasks import load_task
from megatron_gspo.tasks.arithmetic import PAIRS, problem
from megatron_gspo.samples import Sample


def sample(text, answer):
    return Sample(group_id=0, sample_index=0, prompt_ids=[1], response_ids=[], rollout_logprobs=[],
                  finish_reason="stop", response_text=text, answer=answer)


def test_problems_are_single_digit_sums():
    for i in range(200):
        text, answer = problem(7, i)
        a, b = text.rstrip("=").split("+")
        assert int(a) + int(b) == int(answer) <= 9


def test_prompts_are_uniform_over_the_55_pairs():
    """No prompt (and no answer) dominates: "9+0=" is as frequent as "0+5=", chance stays 1 in 10."""
    assert len(PAIRS) == 55
    counts = Counter(problem(0, i)[0] for i in range(55_000))
    assert len(counts) == 55 and max(counts.values()) < 1.2 * 1000 and min(counts.values()) > 0.8 * 1000


def test_stream_resumes_from_a_position():
    task = load_task("arithmetic", encode=lambda t: [ord(c) for c in t], seed=3)
    first = [p for _, p in zip(range(5), task.prompts(0))]
    again = [p for _, p in zip(range(2), task.prompts(3))]
    assert again == first[3:5] and [p.group_id for p in first] == [0, 1, 2, 3, 4]


def test_reward_is_exact_match():
    reward = load_task("arithmetic", encode=list, seed=0).reward
    # SGLang's text omits EOS: "7" is a digit then EOS; "7+1" and "17" kept going.
    assert [reward(sample(t, "7")) for t in ("7", "7+1", "17", "", "8")] == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_train_rejects_a_bad_config_before_launching(capsys):
    assert main(["train", "examples/tiny_cpu.yaml", "gspo.eps_low=-1"]) == 1
    assert "gspo.eps_low must be in [0, 1)" in capsys.readouterr().err


def test_unknown_task_is_a_config_error(capsys):
    assert main(["train", "examples/tiny_cpu.yaml", "rollout.task=algebra"]) == 1
    assert "rollout.task must be one of ['arithmetic']" in capsys.readouterr().err
