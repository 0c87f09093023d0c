"""The GSPO driver: one rollout step after another, told as the list in ../shared/STYLE.md.

    torchrun --nproc-per-node N -m megatron_gspo.training.loop CONFIG [key=value ...]
    (or `megatron-gspo train CONFIG [key=value ...]`, which runs exactly that)

Per step: (rank 0) roll out a batch from the SGLang servers -> rewards -> group advantages (dynamic
sampling drops zero-signal groups if configured) -> the batch is broadcast to every rank ->
`train_on_batch` (K mini-batches, old log-probs recomputed or the rollout's) -> the new weights go to
every server -> metrics -> periodic checkpoint; at the end, optionally, the final checkpoint as a
Hugging Face model (checkpoint.export_hf). Rank 0 owns the servers and the HTTP client; the other
ranks only train, and send their weight shards to rank 0 in the collective export.
With rollout.backend=megatron there are no servers: every rank generates with the model it trains
(rollout/megatron_backend.py; the weights of rollout step s+1 are version "s"), so the weight sync
only moves the version number.

Signals: SIGTERM/SIGINT during start-up stop at once (servers are stopped on the way out); during the
loop they end the run after the current step, with a checkpoint when `checkpoint.save_on_signal`.
A signal that also reached the servers (Slurm signals every process of a job) can make the step's
rollout or weight sync fail: the run then still stops with its checkpoint (of the step before, or of
this step without its sync), from which a resumed run continues exactly.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.config import TrainConfig, dump_yaml, load_config, to_dict
from megatron_gspo.convert.export import iter_hf_tensors
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.training import checkpoint as ckpt
from megatron_gspo.training.metrics import MetricsLogger, plot, response_length_metrics
from megatron_gspo.training.packing import Response
from megatron_gspo.training.preflight import preflight
from megatron_gspo.training.setup import Policy, build_policy, step_settings
from megatron_gspo.training.step import train_on_batch


def train(config: TrainConfig) -> None:
    preflight(config)
    pgs = init_megatron(config.parallel.layout, seed=config.seed)
    rank0 = dist.get_rank() == 0
    stop = StopRequest()
    policy = build_policy(config, pgs)
    settings = step_settings(config, policy.shape)
    state = initial_weights(config, policy)  # resumed checkpoint, or the converted HF model
    run_dir, k = Path(config.logging.run_dir), config.gspo.num_minibatches
    with contextlib.ExitStack() as stack:
        # SGLang: rank 0 talks to the servers. Megatron backend: every rank generates, collectively.
        colocated = config.rollout.backend == "megatron"
        rollout = stack.enter_context(Rollout(config, policy)) if rank0 or colocated else None
        logger = (stack.enter_context(MetricsLogger(run_dir, tensorboard=config.logging.tensorboard,
                                                    wandb_project=config.logging.wandb_project,
                                                    wandb_offline=config.logging.wandb_offline,
                                                    config=to_dict(config),
                                                    resume_after=state.step * k if state.step else None))
                  if rank0 else None)
        if state.step:  # the servers start from the HF weights: give them the resumed ones
            push_weights(rollout, policy, version=str(state.step))
        saved_step = state.step if state.step else None  # the step of the checkpoint on disk
        stop.arm()
        while state.step < config.num_steps:
            step_start = time.perf_counter()
            # 1-3. rollout -> rewards -> advantages (rank 0, or every rank together with the megatron
            # backend), then rank 0's batch on every rank.
            batch, info, data_state = sample(rollout, state, stop) if rollout is not None else (None, None, None)
            box = [batch, info, data_state]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:  # the rollout failed after a stop signal: nothing of this step is done
                stop.signal_name = stop.signal_name or "a signal on rank 0"
                if config.checkpoint.dir and config.checkpoint.save_on_signal and state.step != saved_step:
                    ckpt.save_checkpoint(config.checkpoint.dir, state, policy.model, policy.optimizer,
                                         policy.scheduler, keep_last=config.checkpoint.keep_last)
                if rank0:
                    print(f"stopping on {stop.signal_name} after step {state.step}", flush=True)
                break
            batch, info, state.data_state = box
            # 4. K mini-batches, one optimizer step each.
            records = train_on_batch(policy.model, policy.optimizer, batch, settings, pgs=pgs,
                                     scheduler=policy.scheduler)
            state.step += 1
            # 5. New weights to every server (collective export; rank 0 sends).
            sync_start = time.perf_counter()
            push_weights(rollout, policy, version=str(state.step), stop=stop)
            sync_s = time.perf_counter() - sync_start
            # 6. Checkpoint every `interval` steps, at the end, and when asked to stop.
            stopping = stop.agreed()
            ckpt_s = 0.0
            if config.checkpoint.dir and (state.step % config.checkpoint.interval == 0 or state.step == config.num_steps
                                          or (stopping and config.checkpoint.save_on_signal)):
                ckpt_start = time.perf_counter()
                ckpt.save_checkpoint(config.checkpoint.dir, state, policy.model, policy.optimizer, policy.scheduler,
                                     keep_last=config.checkpoint.keep_last)
                saved_step = state.step
                ckpt_s = time.perf_counter() - ckpt_start
            # 7. Metrics: one record per optimizer step, the step's rollout numbers and timings on each.
            if rank0:
                times = {"time_rollout_s": info.pop("rollout_time_s"),
                         "time_recompute_s": sum(r.get("recompute_time_s", 0.0) for r in records),
                         "time_train_s": sum(r["train_time_s"] for r in records),
                         "time_sync_s": sync_s, "time_checkpoint_s": ckpt_s,
                         "time_step_s": time.perf_counter() - step_start}
                for i, record in enumerate(records):
                    logger.log((state.step - 1) * k + i + 1, {"rollout_step": state.step, **info, **times, **record})
                if config.logging.progress_bar:
                    print(f"step {state.step}/{config.num_steps}  reward {info['reward_mean']:.3f}  "
                          f"zero-signal groups {info['zero_signal_group_fraction']:.2f}  "
                          f"clipped {records[-1].get('clipped_fraction_seq', float('nan')):.3f}  "
                          f"{times['time_step_s']:.1f} s (rollout {times['time_rollout_s']:.1f}, "
                          f"train {times['time_recompute_s'] + times['time_train_s']:.1f}, sync {sync_s:.1f})",
                          flush=True)
            if stopping:
                if rank0:
                    print(f"stopping on {stop.signal_name} after step {state.step}", flush=True)
                break
    stop.arm(False)  # servers are stopped: from here on a signal ends the process at once
    if rank0:
        plot(run_dir)
        # 8. At the end, the final checkpoint as a Hugging Face model.
        if config.checkpoint.export_hf and state.step == config.num_steps:
            export_hf(config)
    dist.barrier()


class StopRequest:
    """SIGTERM/SIGINT: before arm() raise KeyboardInterrupt (unwinding stops the servers); after, note
    the request so the loop ends after the current step. agreed() makes every rank stop together."""

    def __init__(self):
        self.signal_name: str | None = None
        self._armed = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signal_name = signal.Signals(signum).name
        if not self._armed:
            raise KeyboardInterrupt(self.signal_name)

    def arm(self, armed: bool = True) -> None:
        self._armed = armed

    def agreed(self) -> bool:
        flag = torch.tensor([1 if self.signal_name else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal_name is None:
            self.signal_name = "a signal on another rank"
        return bool(flag.item())


def sample(rollout: "Rollout", state: ckpt.TrainerState, stop: StopRequest):
    """rollout.sample at the run's data position; (None, None, None) if it fails after a stop signal
    (the servers got the signal too)."""
    try:
        return rollout.sample(state.data_state or 0)
    except Exception as error:
        if stop.signal_name is None or rollout.config.rollout.backend == "megatron":
            raise
        print(f"rollout failed after {stop.signal_name} ({type(error).__name__}: {error})", flush=True)
        return None, None, None


def initial_weights(config: TrainConfig, policy: Policy) -> ckpt.TrainerState:
    """Load the latest checkpoint when resuming; else the HF model, converted once into run_dir."""
    from megatron_gspo.convert.hf_to_mcore import convert_hf_to_mcore
    from megatron_gspo.convert.load import load_weights

    c = config.checkpoint
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
    from megatron_gspo.convert.mcore_to_hf import convert_mcore_to_hf

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


def push_weights(rollout: "Rollout | None", policy: Policy, version: str, stop: "StopRequest | None" = None) -> None:
    """Collective: every rank walks the export, sending its pieces to rank 0 (which holds `rollout`), which
    sends the full tensors on. The megatron backend walks nothing: every rank holds a rollout that only
    takes the new version.

    When the servers fail after a stop signal (Slurm signals the servers and the trainer together), rank 0
    reports it and finishes the walk with the other ranks, so the run still ends with its checkpoint (a
    resumed run pushes those weights first)."""
    tensors = iter_hf_tensors(policy.model, policy.shape, dst=0)
    try:
        if rollout is not None:
            rollout.sync_weights(tensors, version)
    except Exception as error:
        if stop is None or stop.signal_name is None:
            raise
        print(f"weight sync failed after {stop.signal_name} ({type(error).__name__}: {error}); "
              "the weights go to the servers when the run resumes", flush=True)
    for _ in tensors:  # the rest of the walk (all of it on ranks without `rollout`)
        pass


class Rollout:
    """The sampler's side. sglang: rank 0 only, with the servers (launched or given), the HTTP client and
    the weight transport. megatron: every rank, generating collectively with the trained model itself
    (rollout/megatron_backend.py), so weight sync is only a new version number."""

    def __init__(self, config: TrainConfig, policy: Policy | None = None):
        self.config = config
        self.policy = policy
        self.weight_version = "0"
        """The weights that sample next (the rollout step after which they were synced)."""
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "Rollout":
        from transformers import AutoTokenizer

        from megatron_gspo.tasks import load_task

        c = self.config
        if dist.get_rank() == 0:
            dump_yaml(c, Path(c.logging.run_dir) / "config.yaml")
        try:
            tokenizer = AutoTokenizer.from_pretrained(c.model.hf_path)
            self.task = load_task(c.rollout.task, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                                  c.seed)
            if c.rollout.backend == "megatron":
                self._start_megatron(tokenizer)
            else:
                self._start_sglang()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start_sglang(self) -> None:
        from megatron_gspo.rollout.client import ClientConfig, RolloutClient, SamplingParams
        from megatron_gspo.rollout.server import ServerConfig, launch_servers
        from megatron_gspo.sync.sglang import BroadcastSync

        c, r = self.config, self.config.rollout
        if r.server_urls:
            self.urls = list(r.server_urls)
        else:
            print(f"starting {r.num_servers} SGLang server(s) on {c.model.hf_path} ...", flush=True)
            servers = self._stack.enter_context(launch_servers(ServerConfig(
                model_path=c.model.hf_path, dtype=c.model.dtype, weight_version="0",
                max_running_requests=r.concurrency, log_dir=str(Path(c.logging.run_dir) / "sglang_logs")),
                r.num_servers))
            self.urls = [s.url for s in servers]
            print(f"SGLang ready at {self.urls} after {max(s.ready_after_s for s in servers):.0f} s", flush=True)
        client = RolloutClient(self.urls, ClientConfig(concurrency_per_server=r.concurrency,
                                                       request_timeout_s=r.request_timeout_s))
        sampling = SamplingParams(temperature=c.gspo.temperature, top_p=r.top_p, top_k=r.top_k,
                                  max_new_tokens=r.max_new_tokens)
        self.generate = functools.partial(client.generate, n=c.gspo.group_size, sampling=sampling)
        self.broadcast = None
        if r.weight_sync == "broadcast":
            # NCCL between GPUs (the exported tensors are on rank 0's GPU; SGLang's servers on theirs), else gloo
            self.broadcast = BroadcastSync(self.urls, backend="nccl" if torch.cuda.is_available() else "gloo")
            self.broadcast.connect()
            self._stack.callback(self.broadcast.close)

    def _start_megatron(self, tokenizer) -> None:
        from megatron_gspo.rollout.megatron_backend import GenerationSettings, MegatronGenerator, stop_token_ids

        c, r = self.config, self.config.rollout
        generator = MegatronGenerator(
            self.policy.model, GenerationSettings(
                temperature=c.gspo.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                stop_token_ids=stop_token_ids(c.model.hf_path, tokenizer),
                max_tokens_per_microbatch=c.parallel.max_tokens_per_microbatch),
            vocab_size=self.policy.shape.vocab_size, seed=c.seed,
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), pgs=self.policy.pgs)

        async def generate(prompts):  # collective: every rank calls it with the same prompts
            return generator.generate(prompts, n=c.gspo.group_size, weight_version=self.weight_version)
        self.generate = generate

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def sample(self, position: int) -> tuple[list[Response], dict, int]:
        """One scored batch from prompt-stream position `position`: (responses with advantages,
        rollout metrics, the next position)."""
        from megatron_gspo.loss.advantages import group_advantages
        from megatron_gspo.rollout.sampling import collect_scored_groups

        g = self.config.gspo
        start = time.perf_counter()
        prompts = self.task.prompts(position)
        taken = [0]

        def counted():
            for p in prompts:
                taken[0] += 1
                yield p
        scored = asyncio.run(collect_scored_groups(self.generate, counted(), g.prompts_per_step, self.task.reward,
                                                   drop_zero_variance=g.dynamic_sampling))
        samples = [s for group in scored.groups for s in group]
        rewards = [s.reward for s in samples]
        adv = group_advantages(torch.tensor(rewards), g.group_size,
                               std=None if g.advantage_std == "none" else g.advantage_std, eps=g.advantage_eps)
        responses = [Response(s.prompt_ids, s.response_ids, a, s.rollout_logprobs)
                     for s, a in zip(samples, adv.advantages_R.tolist())]
        info = {**scored.metrics(),  # reward over every generated sample, and over the kept groups
                **response_length_metrics([len(s.response_ids) for s in samples])}
        versions = sorted({s.weight_version for s in samples if s.weight_version is not None})
        info.update({"dynamic_sampling_dropped_groups": float(scored.num_dropped),
                     "rollout_weight_version": ",".join(versions),
                     # over every round of dynamic sampling: all response tokens / all generation time
                     "rollout_tokens_per_s": (sum(st.response_tokens for st in scored.rollout_stats)
                                              / max(sum(st.elapsed_s for st in scored.rollout_stats), 1e-9)),
                     "rollout_time_s": time.perf_counter() - start})
        return responses, info, position + taken[0]

    def sync_weights(self, tensors, version: str) -> None:
        from megatron_gspo.sync.sglang import sync_from_disk, write_hf_checkpoint

        self.weight_version = version
        if self.config.rollout.backend == "megatron":
            return  # the model that trains is the model that samples: `tensors` is never walked
        if self.broadcast is not None:
            self.broadcast.sync(tensors, version)
        else:
            folder = write_hf_checkpoint(tensors, Path(self.config.logging.run_dir) / "weights",
                                         self.config.model.hf_path)
            sync_from_disk(self.urls, folder.resolve(), version)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: torchrun --nproc-per-node N -m megatron_gspo.training.loop CONFIG [key=value ...]",
              file=sys.stderr)
        return 2
    train(load_config(argv[0], argv[1:]))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
