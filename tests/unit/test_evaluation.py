"""Eval metrics (mean@k, unbiased pass@k) and the scorer's counts (timeouts, errors, truncated=zero)."""
import asyncio
import math
import random

import pytest

from megatron_gspo.config import RewardConfig
from megatron_gspo.evaluation import eval_metrics, pass_at_k
from megatron_gspo.rewards.pool import RewardError, RewardPool
from megatron_gspo.rollout.batch_filling import ScoredBatch
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.samples import Sample


def sample(text, reward=None, finish="stop", answer="1", group=0, index=0):
    return Sample(group_id=group, sample_index=index, prompt_ids=[1], response_ids=[2, 3], rollout_logprobs=[-1, -1],
                  finish_reason=finish, response_text=text, answer=answer, reward=reward)


def test_pass_at_k_matches_its_definition():
    """1 - C(n-c, k)/C(n, k) is P(some correct) when k of the n samples are drawn without replacement."""
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 = c / n
    rng = random.Random(0)
    draws = [any(rng.sample([1, 1, 0, 0, 0, 0], 3)) for _ in range(20000)]
    assert pass_at_k(6, 2, 3) == pytest.approx(sum(draws) / len(draws), abs=0.01)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_eval_metrics_of_two_prompts():
    groups = [[sample("1", 1.0), sample("0", 0.0, finish="length")], [sample("0", 0.0), sample("0", 0.0)]]
    m = eval_metrics("aime", groups, k=2)
    assert m["eval/aime/mean@2"] == 0.25 and m["eval/aime/pass@2"] == 0.5
    assert m["eval/aime/truncated_fraction"] == 0.25 and m["eval/aime/response_length"] == 2 and m["eval/aime/prompts"] == 2
    with pytest.raises(ValueError, match="unscored"):
        eval_metrics("aime", [[sample("1")]], k=1)


def score(scorer, groups):
    for g in groups:
        scorer.submit(g)
    return asyncio.run(scorer.score(groups))


def test_scorer_counts_timeouts_errors_and_truncation():
    groups = [[sample("1", group=0, index=0), sample("0", group=0, index=1)],
              [sample("1", finish="length", group=1, index=0), sample("1", group=1, index=1)]]
    with RewardPool("exact_match", workers=2) as pool:
        counts = score(Scorer(pool, RewardConfig(fn="exact_match")), groups)
        assert [[s.reward for s in g] for g in groups] == [[1.0, 0.0], [1.0, 1.0]]
        assert (counts.samples, counts.truncated, counts.timeouts, counts.errors) == (4, 1, 0, 0)
        counts = score(Scorer(pool, RewardConfig(fn="exact_match", truncated="zero")), groups)
        assert [[s.reward for s in g] for g in groups] == [[1.0, 0.0], [0.0, 1.0]]  # the cut response scores 0
    # A verifier that raises on some samples: they score 0 and are counted; more than half failing stops.
    with RewardPool("tests.unit.reward_fns:raises", workers=1) as pool:
        with pytest.raises(RewardError, match="raises"):
            score(Scorer(pool, RewardConfig(fn="tests.unit.reward_fns:raises")), groups)


def test_scorer_counts_unparsed_responses_and_the_batch_logs_their_fraction():
    groups = [[sample("answer: 1", group=0, index=0), sample("one", group=0, index=1)],
              [sample("no answer", group=1, index=0), sample("answer: 2", group=1, index=1)],
              [sample("answe", finish="length", group=2, index=0), sample("answer: 1", group=2, index=1)]]
    with RewardPool("final_answer", workers=0) as pool:
        counts = score(Scorer(pool, RewardConfig(fn="final_answer")), groups)
        # reward.truncated=zero: the cut response is not scored, so it is not counted as unparsed either
        counts = score(Scorer(pool, RewardConfig(fn="final_answer", truncated="zero")), groups)
        assert (counts.samples, counts.unparsed, counts.truncated) == (6, 2, 1)
        counts = score(Scorer(pool, RewardConfig(fn="final_answer")), groups)   # truncated=keep
        assert [[s.reward for s in g] for g in groups] == [[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]]
        assert (counts.samples, counts.unparsed, counts.errors, counts.truncated) == (6, 3, 0, 1)
    metrics = ScoredBatch(groups=groups, generated_rewards=[[s.reward for s in g] for g in groups],
                          score_counts=counts).metrics()
    assert metrics["reward/unparsed_fraction"] == 0.5   # 3 of 6
