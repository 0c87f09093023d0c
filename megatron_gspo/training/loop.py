"""The GSPO driver: one rollout step after another.

    torchrun --nproc-per-node N -m megatron_gspo.training.loop CONFIG [key=value ...]
    (or `megatron-gspo train CONFIG [key=value ...]`, which runs exactly that)

One step, as `train` tells it: prompts from data.train (data/) -> G samples each -> rewards from the
reward pool as groups finish (rollout/manager.py; dynamic sampling rolls out more prompts while groups
have no signal) -> group advantages (loss/advantages.py) -> K mini-batches, one optimizer step each
(training/step.py) -> the new weights to the sampler (rollout/backend.py) -> held-out evaluation when
due (eval.interval, evaluation.py) -> a checkpoint when due -> one metrics record per optimizer step (and,
with logging.save_rollouts, the step's samples in run_dir/rollouts/).

Every rank runs this function. The rollout backend is chosen once (rollout.backend): SGLang servers
driven by rank 0, or the trained model generating on every rank. A stop signal (SIGTERM/SIGINT,
training/preemption.py) during start-up stops at once; during the loop it ends the run after the
current step, with a checkpoint when `checkpoint.save_on_signal`. A rollout interrupted by it comes
back as `Ended("signal")` and ends the run with the previous step's checkpoint, from which a resumed run
continues exactly; `Ended("data")` (data.epochs used up) ends it with a checkpoint of the last step.
A failure of rank 0's rollout, scoring or weight push (a server died, a broken reward function) is raised
on every rank together (`RolloutFailed`), after the background checkpoint every rank has written is
published; what an error on one rank or a kill leaves unpublished, the next start publishes if complete.
"""
from __future__ import annotations

if __name__ == "__main__":
    # A rank: first of all, end with torchrun's agent however it ends (before the imports below, which take
    # seconds; launch.py imports nothing heavy).
    from megatron_gspo.training.launch import end_with_launcher
    end_with_launcher()

import contextlib
import functools
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_gspo.config import TrainConfig, dump_yaml, load_config, to_dict
from megatron_gspo.convert.export import iter_hf_tensors
from megatron_gspo.convert.hf_to_mcore import convert_hf_to_mcore
from megatron_gspo.convert.load import load_weights
from megatron_gspo.convert.mcore_to_hf import convert_mcore_to_hf
from megatron_gspo import profiling
from megatron_gspo.loss.advantages import group_advantages, spread_over_turns, turn_advantages
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.platform.quiet import FALLBACK_NOTE, fallbacks_in_use
from megatron_gspo.rollout.backend import open_backend
from megatron_gspo.rollout.sglang.backend import start_sglang
from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rollout.sglang.server import stop_all
from megatron_gspo.rollout.jsonl import write_rollouts
from megatron_gspo.rollout.manager import Ended, Rollout, RolloutBatch, staleness_metrics
from megatron_gspo.rollout.protocol import RolloutFailed
from megatron_gspo.rollout.scoring import Scorer
from megatron_gspo.training import checkpoint as ckpt
from megatron_gspo.training.metrics import MetricsLogger, plot
from megatron_gspo.training.packing import Response, responses_from_samples
from megatron_gspo.training.preemption import StopRequest
from megatron_gspo.training.preflight import Prepared, nothing_to_do, preflight
from megatron_gspo.training.run_lock import rank_lock
from megatron_gspo.training.setup import Policy, build_policy, old_logprobs, step_settings
from megatron_gspo.training.step import train_on_batch


def train(config: TrainConfig) -> None:
    prepared = preflight(config)
    profiling.enable(config.logging.profile)
    with contextlib.ExitStack() as stack:
        # SGLang servers to launch start first (rank 0): their start-up overlaps Megatron's below.
        started = None
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))  # torchrun's
        if rank == 0 and fallbacks_in_use():
            print(FALLBACK_NOTE, flush=True)  # in place of Megatron-Core's six warnings per rank (platform/quiet.py)
        if config.rollout.backend == "sglang" and not config.rollout.server_urls and rank == 0:
            started = start_sglang(config)
            stack.callback(stop_all, started)  # also if anything below fails before the backend owns them
        _train(config, prepared, started)


def _train(config: TrainConfig, prepared: Prepared, started: list | None) -> None:
    pgs = init_megatron(config.parallel, seed=config.seed)  # every process group, built once
    stop = StopRequest()
    policy = build_policy(config, pgs)
    settings, source = step_settings(config, policy.shape), old_logprobs(config, policy)
    state = initial_weights(config, policy)  # the resumed checkpoint, or the converted HF model
    export = functools.partial(iter_hf_tensors, policy.model, policy.shape, dst=0)
    with contextlib.ExitStack() as stack:
        rollout = stack.enter_context(contextlib.closing(open_rollout(config, policy, stop, prepared, stack,
                                                                      started)))
        # Background checkpoints: the last one is published when the loop ends, and before a RolloutFailed
        # that every rank raises (checkpoint.py: an error on one rank alone cannot).
        saves = (stack.enter_context(ckpt.BackgroundSaves(collective_errors=(RolloutFailed,)))
                 if config.checkpoint.async_save else None)
        rollout.preload(state.user_state.get("rollout_ahead", []))  # batches sampled before the checkpoint
        logger = stack.enter_context(open_logger(config, state)) if dist.get_rank() == 0 else None
        if state.step:  # the servers start from the HF weights: give them the resumed ones
            rollout.sync_weights(export, version=str(state.step))
        saved_step = state.step or None  # the step of the checkpoint on disk
        stop.arm()
        if state.step == 0 and config.eval.interval:  # the starting point of the eval curve
            log_eval(logger, config, state.step, rollout.evaluate())
        evaluated_step, data_ended, previous = state.step, False, None
        while state.step < config.num_steps:
            times = {"time/step_s": time.perf_counter()}
            # 1-2. Prompts -> G samples each -> rewards; the same batch on every rank.
            batch = timed(times, "time/rollout_s", rollout.generate, state.data_state or 0)
            if isinstance(batch, Ended):  # nothing of this step is done
                data_ended = batch.reason == "data"
                # a stop signal (the servers got it too), or the data's epochs are used up
                if state.step != saved_step and (batch.reason == "data" or config.checkpoint.save_on_signal):
                    save_checkpoint(config, state, policy, rollout, saves)
                if batch.reason == "data" and config.eval.interval and evaluated_step != state.step:
                    log_eval(logger, config, state.step, rollout.evaluate())
                break
            # (rollout.max_staleness > 0: the servers generate the next batches while this one trains.)
            rollout.prefetch(batch, remaining=config.num_steps - state.step - 1)
            times.update(overlap_times(rollout, batch, previous, state.step))
            previous = batch
            # 3. Group-normalised advantages: one per sample.
            with profiling.span("advantages"):
                responses = with_advantages(batch, config)
            # 4. K mini-batches, one optimizer step each.
            with profiling.span("train"):
                records = train_on_batch(policy.model, policy.optimizer, responses, settings, source, pgs=pgs,
                                         scheduler=policy.scheduler)
            state.step, state.data_state = state.step + 1, batch.next_position
            # 5. The new weights to the sampler (a push interrupted by a stop signal reaches it on resume).
            timed(times, "time/sync_s", rollout.sync_weights, export, str(state.step))
            times["time/sync_wait_s"] = rollout.sync_wait_s
            stopping = stop.agreed()
            # 6. Held-out evaluation every eval.interval rollout steps and at the end.
            times["time/eval_s"], evaluation = 0.0, {}
            if eval_due(config, state.step, stopping):
                evaluation = timed(times, "time/eval_s", rollout.evaluate)
                evaluated_step = state.step
            # 7. A checkpoint every `interval` steps, at the end, and when asked to stop (with
            # checkpoint.async_save, written in the background and published once every rank has).
            due, times["time/checkpoint_s"] = checkpoint_due(config, state.step, stopping), 0.0
            if due or saves is not None:
                timed(times, "time/checkpoint_s", checkpoint, config, state, policy, rollout, saves, due)
            saved_step = state.step if due else saved_step
            # 8. One record per optimizer step: the step's rollout numbers and timings on each (with
            # logging.profile, the parts of this step; the logging of a step counts in the next one's).
            if config.logging.profile:
                times.update(profiling.collect())
            with profiling.span("log"):
                if logger is not None:
                    log_step(logger, config, state.step, batch, records, times)
                    log_eval(logger, config, state.step, evaluation)
                    save_rollouts(config, state.step, batch, responses, prepared.tokenizer)
            if stopping:
                break
    if stop.requested and dist.get_rank() == 0:
        print(f"stopping on {stop.signal_name} after step {state.step}", flush=True)
    stop.arm(False)  # the servers are stopped: from here on a signal ends the process at once
    if dist.get_rank() == 0:
        plot(config.logging.run_dir)
        # 9. At the end, the final checkpoint as a Hugging Face model.
        if config.checkpoint.export_hf and (state.step == config.num_steps or data_ended):
            export_hf(config)
    dist.barrier()


def timed(times: dict, key: str, fn, *args):
    """fn(*args), its wall time in times[key] ("time/NAME_s"; with logging.profile also the part NAME)."""
    start = time.perf_counter()
    with profiling.span(key.removeprefix("time/").removesuffix("_s")):
        result = fn(*args)
    times[key] = time.perf_counter() - start
    return result


def open_rollout(config: TrainConfig, policy: Policy, stop: StopRequest, prepared: Prepared,
                 stack: contextlib.ExitStack, started: list | None = None) -> Rollout:
    """The prompt stream, the reward pool (rank 0; closed by `stack`) and the configured backend on the
    ranks that hold one (SGLang: rank 0, with the servers `started` earlier; megatron: every rank)."""
    backend, scorer = None, None
    if config.rollout.backend == "megatron" or dist.get_rank() == 0:
        pool = None
        if dist.get_rank() == 0:
            r = config.reward
            pool = stack.enter_context(RewardPool(r.fn, workers=r.workers, timeout_s=r.timeout_s))
        backend = open_backend(config, model=policy.model, vocab_size=policy.shape.vocab_size,
                               tokenizer=prepared.tokenizer, pgs=policy.pgs, routing=policy.routing,
                               started=started)
        scorer = Scorer(pool, config.reward, collective=backend.collective)
    if dist.get_rank() == 0:
        d = prepared.dataset
        print(f"data: {len(d)} training prompts from {', '.join(d.paths)}"
              + (f" ({d.skipped} longer than data.max_prompt_tokens skipped)" if d.skipped else "")
              + "".join(f"; eval {name}: {len(p)} prompts" for name, p in prepared.eval_sets.items()), flush=True)
    return Rollout(backend, prepared.dataset, scorer, config, stop, prepared.eval_sets)


def eval_due(config: TrainConfig, step: int, stopping: bool) -> bool:
    """Every eval.interval rollout steps and at the last step (not when stopping on a signal)."""
    interval = config.eval.interval
    return bool(interval) and not stopping and (step % interval == 0 or step == config.num_steps)


def log_eval(logger: MetricsLogger | None, config: TrainConfig, step: int, results: dict) -> None:
    """Rank 0: one record of eval/* metrics at optimizer step step * num_minibatches (the last optimizer
    step of rollout step `step`; 0 before training) and a line per dataset."""
    if logger is not None and results:
        logger.log(step * config.gspo.num_minibatches, {"rollout_step": step, **results})
        k = config.eval.samples_per_prompt
        for name in config.eval.datasets:
            print(f"eval {name} after step {step}: mean@{k} {results[f'eval/{name}/mean@{k}']:.3f}  "
                  f"pass@{k} {results[f'eval/{name}/pass@{k}']:.3f}  ({results['eval/time_s']:.1f} s)", flush=True)


def open_logger(config: TrainConfig, state: ckpt.TrainerState) -> MetricsLogger:
    """Rank 0's metrics logger (a resumed run keeps the records up to its checkpoint), and the resolved
    config beside it."""
    log = config.logging
    dump_yaml(config, Path(log.run_dir) / "config.yaml")
    return MetricsLogger(log.run_dir, tensorboard=log.tensorboard, wandb_project=log.wandb_project,
                         wandb_offline=log.wandb_offline, config=to_dict(config),
                         resume_after=state.step * config.gspo.num_minibatches if state.step else None)


def with_advantages(batch: RolloutBatch, config: TrainConfig) -> list[Response]:
    """The batch's samples with their group-normalised advantages (GSPO eq. 6); multi-turn episodes with
    gspo_token: each model token its turn's (the group-normalised return from that turn on,
    loss/advantages.py turn_advantages)."""
    g = config.gspo
    std = None if g.advantage_std == "none" else g.advantage_std
    samples = batch.scored.samples
    if g.algorithm == "gspo_token" and samples and samples[0].turns is not None:
        per_turn = turn_advantages([[t.reward for t in s.turns] for s in samples], batch.scored.rewards, g.group_size,
                                   std=std, eps=g.advantage_eps)
        return responses_from_samples(samples, [spread_over_turns(a, [(t.start, t.end) for t in s.turns],
                                                                  len(s.response_ids)) for s, a in zip(samples, per_turn)])
    advantages = group_advantages(torch.tensor(batch.scored.rewards), g.group_size, std=std, eps=g.advantage_eps)
    return responses_from_samples(samples, advantages.advantages_R)


def save_rollouts(config: TrainConfig, step: int, batch: RolloutBatch, responses: list[Response], tokenizer) -> None:
    """Rank 0, every logging.save_rollouts steps: the trained samples of rollout step `step` with their
    advantages in run_dir/rollouts/step_NNNNNN.jsonl (rollout/jsonl.py write_rollouts)."""
    every = config.logging.save_rollouts_every
    if every and step % every == 0:
        write_rollouts(Path(config.logging.run_dir) / "rollouts" / f"step_{step:06d}.jsonl", batch.scored.samples,
                       [r.advantage for r in responses], tokenizer, step)


def checkpoint_due(config: TrainConfig, step: int, stopping: bool) -> bool:
    c = config.checkpoint
    return bool(c.dir) and (step % c.interval == 0 or step == config.num_steps or (stopping and c.save_on_signal))


def save_checkpoint(config: TrainConfig, state: ckpt.TrainerState, policy: Policy, rollout: Rollout | None = None,
                    background: ckpt.BackgroundSaves | None = None) -> None:
    """A checkpoint of `state`, with the batches the servers generated ahead (rank 0 saves them);
    with `background`, written in the background."""
    if config.checkpoint.dir:
        if rollout is not None:
            state.user_state["rollout_ahead"] = rollout.ahead()
        ckpt.save_checkpoint(config.checkpoint.dir, state, policy.model, policy.optimizer, policy.scheduler,
                             keep_last=config.checkpoint.keep_last, background=background)


def checkpoint(config: TrainConfig, state: ckpt.TrainerState, policy: Policy, rollout: Rollout,
               saves: ckpt.BackgroundSaves | None, due: bool) -> None:
    """Publish the background checkpoints every rank has finished writing; then this step's when due."""
    if saves is not None:
        saves.finish()
    if due:
        save_checkpoint(config, state, policy, rollout, saves)


def overlap_times(rollout: Rollout, batch: RolloutBatch, previous: RolloutBatch | None, version: int) -> dict:
    """What overlapping rollouts with training shows: the staleness of the batch's weights, its generation
    time (in the background with max_staleness > 0) and how long the sampler sat idle before it."""
    out = {"time/rollout_generate_s": batch.generate_s, **staleness_metrics(batch, version)}
    if previous is not None and batch.started_at and previous.ended_at:
        out["time/sampler_idle_s"] = max(batch.started_at - previous.ended_at, 0.0)
    return out


def log_step(logger: MetricsLogger, config: TrainConfig, step: int, batch: RolloutBatch, records: list[dict],
             times: dict) -> None:
    """One record per optimizer step of rollout step `step`; a progress line when asked."""
    times = {**times, "time/step_s": time.perf_counter() - times["time/step_s"],
             "time/recompute_s": sum(r.get("time/minibatch_recompute_s", 0.0) for r in records),
             "time/train_s": sum(r["time/minibatch_train_s"] for r in records)}
    rollout_metrics = batch.metrics()
    # Mini-batch 1 trains the sampling weights' batch before any update: with rollout log-probs (and a
    # stale batch) its ratios show the gap between behaviour and training policy.
    rollout_metrics.update({f"{key}_minibatch1": records[0][key] for key in ("loss/clipped_fraction_seq",
                            "loss/clipped_fraction_token") if key in records[0]})
    k = config.gspo.num_minibatches
    for i, values in enumerate(records):
        logger.log((step - 1) * k + i + 1, {"rollout_step": step, **rollout_metrics, **times, **values})
    if config.logging.progress_bar:
        print(f"step {step}/{config.num_steps}  reward {rollout_metrics['reward/mean']:.3f}  "
              f"zero-signal groups {rollout_metrics['reward/zero_signal_group_fraction']:.2f}  "
              f"clipped {records[-1].get('loss/clipped_fraction_seq', float('nan')):.3f}  "
              f"{times['time/step_s']:.1f} s (rollout {times['time/rollout_s']:.1f}, "
              f"train {times['time/recompute_s'] + times['time/train_s']:.1f}, sync {times['time/sync_s']:.1f})",
              flush=True)


def initial_weights(config: TrainConfig, policy: Policy) -> ckpt.TrainerState:
    """Load the latest checkpoint when resuming (one a crash left complete but unpublished included);
    else the HF model, converted once into run_dir."""
    c = config.checkpoint
    if c.dir and c.resume:
        if dist.get_rank() == 0:
            for line in ckpt.recover_unpublished(c.dir, keep_last=c.keep_last):
                print(line, flush=True)
        dist.barrier()
    if c.dir and c.resume and ckpt.find_latest(c.dir) is not None:
        state = ckpt.load_checkpoint(c.dir, policy.model, policy.optimizer, policy.scheduler)
        if dist.get_rank() == 0:
            print(f"resumed from {c.dir} at step {state.step}", flush=True)
        return state
    init = config.model.init_checkpoint
    if init is None and config.model.hf_path is not None:
        init = Path(config.logging.run_dir) / "mcore_init"
        if dist.get_rank() == 0 and not init.exists():
            convert_hf_to_mcore(config.model.hf_path, init, progress=False)
        dist.barrier()
    if init is not None:
        load_weights(policy.model, init)
        policy.optimizer.reload_model_params()  # mixed precision: refresh the fp32 main copy
    return ckpt.TrainerState(step=0, data_state=0)


def export_hf(config: TrainConfig) -> Path:
    """Convert the latest checkpoint to checkpoint.export_hf with the checkpoint tools; an earlier
    export there is swapped out only once the new one is complete."""
    out = Path(config.checkpoint.export_hf)
    fresh, stale = out.with_name(f".{out.name}.new-{os.getpid()}"), out.with_name(f".{out.name}.old-{os.getpid()}")
    start = time.perf_counter()
    convert_mcore_to_hf(config.checkpoint.dir, config.model.hf_path, fresh, progress=False)
    if out.exists():
        os.rename(out, stale)
    os.rename(fresh, out)
    shutil.rmtree(stale, ignore_errors=True)
    print(f"exported the final weights to {out} (Hugging Face format) in {time.perf_counter() - start:.1f} s",
          flush=True)
    return out


@record  # an uncaught exception goes to torchrun's error file: `megatron-gspo train` prints it (training/launch.py)
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: torchrun --nproc-per-node N -m megatron_gspo.training.loop CONFIG [key=value ...]",
              file=sys.stderr)
        return 2
    config = load_config(argv[0], argv[1:])
    rank = int(os.environ.get("RANK", "0"))  # torchrun's global rank
    done = nothing_to_do(config)  # (`megatron-gspo train` says so before it starts torchrun)
    if done:
        if rank == 0:
            print(done, flush=True)
        return 0
    with rank_lock(config, rank):  # started by plain torchrun, rank 0 holds the run directories' lock
        train(config)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
