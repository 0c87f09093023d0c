"""The rollout side of a step (rollout/manager.py): batches, weight sync, and what a stop signal changes.

One process in a gloo world of one (the collectives are then identities): a fake backend stands in for
SGLang or the in-process sampler.
"""
import itertools
import types

import pytest
import torch.distributed as dist

from megatron_gspo.config import GSPOConfig, ModelConfig, RewardConfig, TrainConfig
from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.rollout.client import RolloutError, RolloutStats
from megatron_gspo.rollout.manager import Ended, Rollout
from megatron_gspo.net import free_port
from megatron_gspo.samples import Prompt, Sample

G = 2


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Prompts:
    """Prompt k is "k" (a PromptDataset's stream, endless); a response is right when its text is "1"."""

    def prompts(self, start):
        k = start
        while True:
            yield Prompt(group_id=k, prompt_ids=[k + 1], answer="1")
            k += 1

    @staticmethod
    def epoch_of(position):
        return position // 100


POOL: list[RewardPool] = []


@pytest.fixture(scope="module", autouse=True)
def pool():
    with RewardPool("exact_match", workers=1) as pool:
        POOL.append(pool)
        yield pool
        POOL.clear()


def make_rollout(backend, stop_signal, dataset=None, eval_sets=None) -> Rollout:
    """A Rollout over the endless prompts above, scored by exact_match in the reward pool."""
    scorer = Scorer(POOL[0], RewardConfig(fn="exact_match"), collective=bool(backend and backend.collective))
    return Rollout(backend, dataset or Prompts(), scorer, CONFIG, stop_signal, eval_sets)


class FivePrompts(Prompts):
    """A dataset whose data.epochs end after 5 prompts."""

    def prompts(self, start):
        return itertools.takewhile(lambda p: p.group_id < 5, super().prompts(start))


def test_used_up_data_ends_the_run_plainly():
    rollout = make_rollout(Backend(), stop(), dataset=FivePrompts())
    assert rollout.generate(0).next_position == 3  # 3 prompts per step
    assert rollout.generate(3) == Ended("data")    # 2 left: not a full batch


def test_evaluate_scores_k_samples_per_eval_prompt():
    """The backend answers str(i) for sample i: with k = 2 samples, sample 1 is right ("1")."""
    eval_sets = {"held_out": [Prompt(group_id=i, prompt_ids=[9], answer="1") for i in range(4)]}
    results = make_rollout(Backend(), stop(), eval_sets=eval_sets).evaluate()
    k = CONFIG.eval.samples_per_prompt
    assert k == 1 and results["eval/held_out/mean@1"] == 0.0  # only sample 0 ("0"): always wrong
    two = make_rollout(Backend(), stop(), eval_sets=eval_sets)
    two.eval_k = 2
    results = two.evaluate()
    assert results["eval/held_out/mean@2"] == 0.5 and results["eval/held_out/pass@2"] == 1.0
    assert results["eval/held_out/prompts"] == 4 and results["eval/held_out/truncated_fraction"] == 0.0
    assert make_rollout(Backend(), stop()).evaluate() == {}  # no eval sets


class Backend:
    def __init__(self, collective=False, fail=None):
        self.collective, self.fail = collective, fail
        self.pushed = []

    async def generate(self, prompts, *, n=None, sampling=None, on_group=None):
        if self.fail:
            raise self.fail
        groups = [[Sample(group_id=p.group_id, sample_index=i, prompt_ids=p.prompt_ids, response_ids=[7],
                          rollout_logprobs=[-0.5], finish_reason="stop", response_text=str(i), weight_version="3",
                          answer=p.answer)
                   for i in range(n or G)] for p in prompts]
        for group in groups if on_group else ():
            on_group(group)
        return groups, RolloutStats(elapsed_s=1.0, response_tokens=len(prompts) * G)

    def sync_weights(self, named_tensors, version):
        if self.fail:
            raise self.fail
        self.pushed.append((version, [name for name, _ in named_tensors]))

    def close(self):
        pass


def stop(signal_name=None):
    return types.SimpleNamespace(signal_name=signal_name)


CONFIG = TrainConfig(model=ModelConfig(hf_path="unused"), gspo=GSPOConfig(group_size=G, prompts_per_step=3, num_minibatches=1))


def test_a_batch_from_the_stream_position_with_its_metrics():
    batch = make_rollout(Backend(), stop()).generate(5)
    assert [g[0].group_id for g in batch.scored.groups] == [5, 6, 7] and batch.next_position == 8
    assert batch.scored.rewards == [0.0, 1.0] * 3
    metrics = batch.metrics()
    assert metrics["reward_mean"] == 0.5 and metrics["rollout_weight_version"] == "3"
    assert metrics["rollout_tokens_per_s"] == 6.0 and metrics["response_length_mean"] == 1.0


def test_a_failure_raises_unless_a_stop_signal_came_first():
    broken = Backend(fail=RolloutError("server gone"))
    with pytest.raises(RolloutError, match="server gone"):
        make_rollout(broken, stop()).generate(0)
    assert make_rollout(broken, stop("SIGTERM")).generate(0) == Ended("signal")  # interrupted, plainly
    # the trained model as sampler has no servers that a signal could take down: always an error
    with pytest.raises(RolloutError):
        make_rollout(Backend(collective=True, fail=RolloutError("bug")), stop("SIGTERM")).generate(0)


def test_weight_sync_walks_the_whole_export_and_reports_an_interruption():
    walked = []

    def export():
        for name in ("a", "b", "c"):
            walked.append(name)
            yield name, None

    backend = Backend()
    assert make_rollout(backend, stop()).sync_weights(export, "4") is True
    assert backend.pushed == [("4", ["a", "b", "c"])]
    walked.clear()
    assert make_rollout(None, stop()).sync_weights(export, "4") is True  # a rank without a backend
    assert walked == ["a", "b", "c"]                                              # still walks the export
    walked.clear()
    broken = make_rollout(Backend(fail=RuntimeError("refused")), stop("SIGTERM"))
    assert broken.sync_weights(export, "5") is False and walked == ["a", "b", "c"]
    with pytest.raises(RuntimeError, match="refused"):
        make_rollout(Backend(fail=RuntimeError("refused")), stop()).sync_weights(export, "5")
    walked.clear()
    assert make_rollout(Backend(collective=True), stop()).sync_weights(export, "6") is True
    assert walked == []  # the trained model samples: nothing to export
