"""The rollout side of a step (rollout/manager.py): batches, weight sync, and what a stop signal changes.

One process in a gloo world of one (the collectives are then identities): a fake backend stands in for
SGLang or the in-process sampler. That rank 0's failure reaches the other ranks is tested with two
processes in tests/distributed/test_checkpoint_recovery.py.
"""
import dataclasses
import itertools
import pickle
import time
import types

import pytest
import torch.distributed as dist

from megatron_gspo.config import RolloutConfig

from megatron_gspo.config import GSPOConfig, ModelConfig, RewardConfig, TrainConfig
from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.rollout.protocol import RolloutFailed, RolloutStats
from megatron_gspo.rollout.sglang.client import RolloutError
from megatron_gspo.rollout.manager import Ended, Rollout, staleness_metrics
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

    async def keep_connections(self):
        pass

    async def close_connections(self):
        pass


def stop(signal_name=None):
    return types.SimpleNamespace(signal_name=signal_name)


CONFIG = TrainConfig(model=ModelConfig(hf_path="unused"), gspo=GSPOConfig(group_size=G, prompts_per_step=3, num_minibatches=1))


def test_a_batch_from_the_stream_position_with_its_metrics():
    batch = make_rollout(Backend(), stop()).generate(5)
    assert [g[0].group_id for g in batch.scored.groups] == [5, 6, 7] and batch.next_position == 8
    assert batch.scored.rewards == [0.0, 1.0] * 3
    metrics = batch.metrics()
    assert metrics["reward/mean"] == 0.5 and metrics["rollout/weight_version"] == "3"
    assert metrics["rollout/tokens_per_s"] == 6.0 and metrics["rollout/response_length_mean"] == 1.0


def test_a_failure_is_every_ranks_rollout_failed_unless_a_stop_signal_came_first():
    broken = Backend(fail=RolloutError("server gone"))
    with pytest.raises(RolloutFailed, match="^rollout failed on rank 0: RolloutError: server gone$"):
        make_rollout(broken, stop()).generate(0)
    assert make_rollout(broken, stop("SIGTERM")).generate(0) == Ended("signal")  # interrupted, plainly
    # the trained model as sampler has no servers that a signal could take down: always an error, its own
    with pytest.raises(RolloutError):
        make_rollout(Backend(collective=True, fail=RolloutError("bug")), stop("SIGTERM")).generate(0)


@pytest.mark.parametrize("collective", [False, True], ids=["servers", "trained_model"])
def test_a_broken_reward_function_is_every_ranks_rollout_failed(collective):
    # Only rank 0 scores, with either backend (the trained model's scorer broadcasts rank 0's rewards).
    with RewardPool("tests.unit.reward_fns:raises", workers=1) as pool:
        scorer = Scorer(pool, RewardConfig(fn="tests.unit.reward_fns:raises"), collective=collective)
        rollout = Rollout(Backend(collective=collective), Prompts(), scorer, CONFIG, stop())
        what = "rollout" if not collective else "scoring"
        with pytest.raises(RolloutFailed, match=f"^{what} failed on rank 0: RewardError: reward function "
                                                "'tests.unit.reward_fns:raises' failed on its first 2 samples"):
            rollout.generate(0)


def test_a_failed_evaluation_is_every_ranks_rollout_failed_or_no_results_after_a_stop_signal():
    eval_sets = {"held_out": [Prompt(group_id=0, prompt_ids=[9], answer="1")]}
    broken = Backend(fail=RolloutError("server gone"))
    with pytest.raises(RolloutFailed, match="^evaluation failed on rank 0: RolloutError: server gone$"):
        make_rollout(broken, stop(), eval_sets=eval_sets).evaluate()
    assert make_rollout(broken, stop("SIGTERM"), eval_sets=eval_sets).evaluate() == {}


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
    walked.clear()
    with pytest.raises(RolloutFailed, match="^weight push failed on rank 0: RuntimeError: refused$"):
        make_rollout(Backend(fail=RuntimeError("refused")), stop()).sync_weights(export, "5")
    assert walked == ["a", "b", "c"]  # the push failed: rank 0 still walked the export with the others

    def failing_export():  # a collective of the walk fails: this rank's own error, raised as it is
        yield "a", None
        raise ValueError("gather failed")
    with pytest.raises(ValueError, match="gather failed"):
        make_rollout(Backend(), stop()).sync_weights(failing_export, "5")
    walked.clear()
    assert make_rollout(Backend(collective=True), stop()).sync_weights(export, "6") is True
    assert walked == []  # the trained model samples: nothing to export


class SlowServers(Backend):
    """Servers that take `delay` seconds per generate call, stamp samples with their weight version, and
    fail the test if weights are pushed or an eval runs while a batch is being generated."""

    def __init__(self, delay=0.2):
        super().__init__()
        self.delay, self.version, self.busy = delay, "0", 0
        self.events = []

    async def generate(self, prompts, *, n=None, sampling=None, on_group=None):
        import asyncio
        self.busy += 1
        self.events.append(("start", prompts[0].group_id, "eval" if sampling is not None else self.version))
        await asyncio.sleep(self.delay)
        groups, stats = await super().generate(prompts, n=n, sampling=sampling, on_group=None)
        for group in groups:
            for s in group:
                s.weight_version = self.version
            if on_group:
                on_group(group)
        self.busy -= 1
        self.events.append(("end", prompts[0].group_id, self.version))
        return groups, stats

    def sync_weights(self, named_tensors, version):
        assert not self.busy, "weights pushed while a batch was being generated"
        super().sync_weights(named_tensors, version)
        self.version = version


def overlapping(staleness, backend, eval_sets=None):
    config = dataclasses.replace(CONFIG, rollout=dataclasses.replace(CONFIG.rollout, max_staleness=staleness),
                                 gspo=dataclasses.replace(CONFIG.gspo, old_logprobs="rollout"))
    scorer = Scorer(POOL[0], RewardConfig(fn="exact_match"), collective=False)
    return Rollout(backend, Prompts(), scorer, config, stop(), eval_sets)


def test_one_step_off_generates_the_next_batch_while_the_current_one_trains():
    backend = SlowServers(delay=0.3)
    rollout = overlapping(1, backend)
    position, versions = 0, []
    for step in range(3):
        batch = rollout.generate(position)
        assert batch.position == position
        rollout.prefetch(batch, remaining=3 - step - 1)
        versions.append({s.weight_version for g in batch.scored.groups for s in g})
        time.sleep(0.3)                                   # "training" while the servers generate
        backend.events.append(("trained", step, None))
        rollout.sync_weights(lambda: iter([("w", None)]), str(step + 1))
        position = batch.next_position
    # batch 1 by the start weights; batch 2 was generated during step 1's training, before its weights
    assert versions == [{"0"}, {"0"}, {"1"}]
    assert staleness_metrics(batch, 2) == {"rollout/staleness_mean": 1.0, "rollout/staleness_max": 1.0}
    at = {(e[0], e[1]): i for i, e in enumerate(backend.events)}
    assert at["start", 3] < at["trained", 0] and at["start", 6] < at["trained", 1], backend.events  # overlap
    assert at["trained", 0] < at["start", 6], backend.events  # held back until step 1's weights were pushed
    assert ("start", 9) not in at                           # the run's last step prefetched nothing
    assert not rollout._ahead                              # the run's last step prefetched nothing
    rollout.close()


def test_a_push_waits_for_the_batch_being_generated_and_holds_back_the_next():
    backend = SlowServers(delay=0.3)
    rollout = overlapping(2, backend)
    batch = rollout.generate(0)
    rollout.prefetch(batch, remaining=10)
    time.sleep(0.05)                                        # the next batch is being generated
    rollout.sync_weights(lambda: iter([("w", None)]), "1")  # SlowServers asserts nothing is generating
    assert rollout.sync_wait_s > 0.0
    second, third = rollout.generate(3), rollout.generate(6)
    assert {s.weight_version for g in second.scored.groups for s in g} == {"0"}
    assert {s.weight_version for g in third.scored.groups for s in g} == {"1"}  # started after the push
    rollout.close()


def test_batches_generated_ahead_survive_a_checkpoint():
    backend = SlowServers(delay=0.05)
    rollout = overlapping(1, backend)
    batch = rollout.generate(0)
    rollout.prefetch(batch, remaining=5)
    kept = rollout.ahead()                                   # waits for the one being generated
    assert [b.position for b in kept] == [3]
    rollout.close()
    resumed_backend = SlowServers(delay=0.05)
    resumed = overlapping(1, resumed_backend)
    resumed.preload(pickle.loads(pickle.dumps(kept)))       # through the checkpoint's pickle
    again = resumed.generate(3)
    assert again.scored.groups[0][0].group_id == 3 and not resumed_backend.events  # not generated again
    with pytest.raises(RuntimeError, match="starts at prompt 3, the trainer asks for 6"):
        resumed.preload(kept)
        resumed.generate(6)
    resumed.close()


def test_eval_holds_the_background_batch_back():
    eval_sets = {"held_out": [Prompt(group_id=100 + i, prompt_ids=[9], answer="1") for i in range(2)]}
    backend = SlowServers(delay=0.2)
    rollout = overlapping(1, backend, eval_sets)
    batch = rollout.generate(0)
    rollout.prefetch(batch, remaining=5)
    time.sleep(0.05)
    rollout.evaluate()
    starts = [e for e in backend.events if e[0] == "start"]
    ends = [e for e in backend.events if e[0] == "end"]
    # the eval's requests start only after the background batch (group 3) ended
    eval_start = next(i for i, e in enumerate(backend.events) if e[0] == "start" and e[2] == "eval")
    assert any(e[0] == "end" and e[1] == 3 for e in backend.events[:eval_start]), backend.events
    assert len(starts) == len(ends)
    rollout.close()


class PausingServers(SlowServers):
    """Servers that take a push while a batch is being generated (rollout.partial_rollout: they pause and
    continue it); the push is recorded among the generation events."""

    def sync_weights(self, named_tensors, version):
        Backend.sync_weights(self, named_tensors, version)
        self.version = version
        self.events.append(("pushed", version, self.busy))


def test_partial_rollouts_push_into_the_batch_being_generated():
    backend = PausingServers(delay=0.4)
    config = dataclasses.replace(CONFIG, rollout=dataclasses.replace(CONFIG.rollout, max_staleness=1,
                                                                    partial_rollout=True),
                                 gspo=dataclasses.replace(CONFIG.gspo, old_logprobs="rollout"))
    rollout = Rollout(backend, Prompts(), Scorer(POOL[0], RewardConfig(fn="exact_match")), config, stop())
    batch = rollout.generate(0)
    rollout.prefetch(batch, remaining=10)
    time.sleep(0.05)                                         # the next batch is being generated
    rollout.sync_weights(lambda: iter([("w", None)]), "1")
    assert ("pushed", "1", 1) in backend.events              # while it was busy: nothing waited
    assert rollout.sync_wait_s < 0.2
    assert ("end", 3, "1") not in backend.events             # the push returned before the batch ended
    second = rollout.generate(3)
    assert backend.events.index(("pushed", "1", 1)) < backend.events.index(("end", 3, "1"))
    assert {s.weight_version for g in second.scored.groups for s in g} == {"1"}
    rollout.close()


class ClientBackend:
    """The SGLang backend's rollout path (rollout/sglang/client.py's RolloutClient) over fake servers that run on an
    event loop of their own thread, as real servers run in processes of their own."""

    collective = False

    def __init__(self, client):
        self.client, self.pushed = client, []

    async def generate(self, prompts, *, n=None, sampling=None, on_group=None):
        return await self.client.generate(prompts, n or G, on_group=on_group)

    def sync_weights(self, named_tensors, version):
        self.pushed.append(version)

    def close(self):
        pass

    async def keep_connections(self):
        await self.client.keep_connections()

    async def close_connections(self):
        await self.client.close_connections()


def test_a_server_dying_mid_overlap_loses_no_sample():
    """One of two servers dies while the batch generated ahead is in flight: its groups go to the other
    server, and the batch the trainer gets has every group whole, each sample exactly once."""
    import asyncio
    import threading
    from fake_sglang_server import FakeSGLang
    from megatron_gspo.rollout.sglang.client import RolloutClient

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    dying, healthy = FakeSGLang(name="a", die_after=3, delay_s=0.05), FakeSGLang(name="b", delay_s=0.05)
    for server in (dying, healthy):
        asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result()
    try:
        client = RolloutClient([dying.url, healthy.url], RolloutConfig(concurrency=1, retry_backoff_s=0.01))
        rollout = overlapping(1, ClientBackend(client))
        first = rollout.generate(0)                         # 3 groups: server a answers 2 of them
        assert dying.answered == 2 and not dying.dead
        rollout.prefetch(first, remaining=5)                # the next batch: a dies at its 4th request
        second = rollout.generate(first.next_position)
        assert dying.dead and dying.answered == 3
        groups = second.scored.groups
        assert [g[0].group_id for g in groups] == [3, 4, 5]
        assert all([s.sample_index for s in g] == list(range(G)) for g in groups)
        assert all(s.response_ids[0] // 100 == g[0].group_id + 1 for g in groups for s in g)  # the group's own
        assert dying.answered + healthy.answered == 6       # 6 groups delivered, none twice
        rollout.close()
    finally:
        async def shut_down():  # on the servers' loop; their connection handlers end before it stops
            for server in (dying, healthy):
                server.kill()
            await asyncio.sleep(0.1)
        asyncio.run_coroutine_threadsafe(shut_down(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
