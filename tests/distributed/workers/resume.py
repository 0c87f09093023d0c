"""Exact resume: an interrupted and resumed run ends with the same parameters as an uninterrupted one.

usage: torchrun --nproc-per-node 2 resume.py WORKDIR PHASE [tp=N] [pp=N] [cp=N] [ep=N] [model=dense|moe]
                                            [distributed_optimizer=0|1] [async_save=0|1]
(1, dense and 0 where absent; dp takes the other ranks: trainer_common.worker_args)
(`distributed_optimizer=1`: Megatron's distributed optimizer, Adam state sharded over data-parallel ranks;
`model=moe`: the tiny Qwen3-MoE (with `ep=2`: experts over 2 ranks), GRPO with routing_replay="old";
`async_save=1`: checkpoints written in the background (BackgroundSaves, checkpoint.async_save), step 3
trained while step 2's is still unpublished, and the crash a real one during step 3's background save.)
PHASE "run": (A) trains 4 rollout steps uninterrupted and saves its final parameters as the reference;
  (B) from the same seed trains 2 steps, checkpointing after each (keep_last=1), starts step 3, leaves a
  half-written iter_0000003.tmp behind as a crashed save would, and exits without any clean-up (os._exit).
PHASE "resume": a fresh process with a different model init and RNG state resumes from the latest
  complete checkpoint (step 2), trains steps 3-4, and compares every parameter with the reference.
Each rollout step = 2 mini-batches (Adam steps) under a warm-up + cosine schedule; the batch of a step
is chosen by the data position *and* torch's global RNG, so both must be restored exactly.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_gspo.convert.load import load_weights
from megatron_gspo.config import CorrectionConfig, GSPOConfig, ParallelConfig
from megatron_gspo.model.gpt import model_process_groups
from megatron_gspo.model.routing import MoERouting
from megatron_gspo.parallel.groups import init_megatron
from megatron_gspo.training.checkpoint import (BackgroundSaves, TrainerState, complete_iterations, find_latest,
                                               iteration_dir, load_checkpoint, save_checkpoint)
from megatron_gspo.training.forward_step import LossSettings
from megatron_gspo.training.old_logprobs import StepSettings, old_logprobs_source
from megatron_gspo.training.step import train_on_batch

from checks import check, done
from trainer_common import SHAPE, params, synthetic_responses, tiny_model, worker_args

STEPS, K, GROUP = 4, 2, 4


class SyntheticData:
    """Batches of 2 groups from a fixed pool: the cursor picks the groups, torch's global RNG their order
    and an advantage scale (as a sampler's randomness would), so a resume must restore both."""

    def __init__(self):
        self.pool = synthetic_responses(seed=11, n=STEPS * 2 * GROUP)
        self.position = 0

    def next_batch(self):
        groups = [self.pool[(self.position + g) * GROUP:(self.position + g + 1) * GROUP] for g in range(2)]
        self.position += 2
        scale = 1.0 + torch.rand(()).item()
        return [dataclasses.replace(r, advantage=r.advantage * scale)
                for g in torch.randperm(2).tolist() for r in groups[g]]


def setup(layout, pgs, seed, options):
    model, optimizer, scheduler = tiny_model(layout, pgs=pgs, seed=seed, lr=2e-3, total_steps=STEPS * K,
                                             schedule="cosine", warmup_steps=2, min_lr=1e-4,
                                             distributed_optimizer=options.distributed_optimizer,
                                             preset={"dense": "tiny_dense", "moe": "tiny_moe"}[options.model])
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, data, steps, settings, options):
    moe = options.model == "moe"
    source = old_logprobs_source(GSPOConfig(routing_replay="old" if moe else "off"), MoERouting.attach(model))
    for _ in range(steps):
        records = train_on_batch(model, optimizer, data.next_batch(), settings, source, pgs=model_process_groups(model),
                                 scheduler=scheduler)
        if moe:
            assert all("moe/routing_changed_fraction" in r for r in records), records


def main():
    workdir, phase = Path(sys.argv[1]), sys.argv[2]
    layout, options = worker_args(sys.argv[3:], model="dense", distributed_optimizer=False, async_save=False)
    pgs = init_megatron(layout, seed=1)
    settings = StepSettings(LossSettings(algorithm="grpo" if options.model == "moe" else "gspo", eps_low=0.05,
                                         eps_high=0.05, temperature=1.0, vocab_size=SHAPE.vocab_size),
                            num_minibatches=K, max_tokens_per_microbatch=64,
                            pack_sequences=False, correction=CorrectionConfig())
    if phase == "run":
        run_and_crash(workdir, layout, pgs, settings, options)  # reports its checks and ends the process (os._exit)
    else:
        resume(workdir, layout, pgs, settings, options)
    done()


def run_and_crash(workdir: Path, layout: ParallelConfig, pgs, settings: StepSettings, options):
    """(A) the uninterrupted reference, (B) 2 checkpointed steps, then a crash during step 3's save."""
    rank = dist.get_rank()
    ckpt = workdir / "checkpoints"
    model, optimizer, scheduler = setup(layout, pgs, seed=5, options=options)
    train(model, optimizer, scheduler, SyntheticData(), STEPS, settings, options)
    torch.save(params(model), workdir / f"reference_rank{rank}.pt")

    model, optimizer, scheduler = setup(layout, pgs, seed=5, options=options)
    data = SyntheticData()
    background = BackgroundSaves() if options.async_save else None

    def save(step):
        save_checkpoint(ckpt, TrainerState(step, data_state=data.position, user_state={"rollouts": step}),
                        model, optimizer, scheduler, keep_last=1, background=background)

    for step in (1, 2):
        train(model, optimizer, scheduler, data, 1, settings, options)
        save(step)
        if options.async_save:
            with check(f"a background save (step {step}) is not the latest before it is published"):
                assert not iteration_dir(ckpt, step).exists() and find_latest(ckpt) == (step - 1 or None)
    train(model, optimizer, scheduler, data, 1, settings, options)       # step 3 starts ...
    if options.async_save:  # ... while step 2's checkpoint may still be being written: it must hold step 2's state
        background.finish(wait=True)
    with check("keep_last=1 keeps only the step-2 checkpoint"):
        assert complete_iterations(ckpt) == [2], complete_iterations(ckpt)   # keep_last pruned step 1
    if options.async_save:                                              # ... and its save crashes:
        save(3)                                                         # the process ends while it writes
    elif rank == 0:                                                     # ... its save crashes midway
        (ckpt / "iter_0000003.tmp").mkdir(parents=True)
        (ckpt / "iter_0000003.tmp" / "__0_0.distcp").write_bytes(b"\0" * 100)
    dist.barrier()
    done()
    os._exit(0)  # no destroy_process_group, no atexit: as abrupt as a kill after the last flush


def resume(workdir: Path, layout: ParallelConfig, pgs, settings: StepSettings, options):
    """A fresh start from the latest complete checkpoint, trained to the end and compared with (A)."""
    rank = dist.get_rank()
    ckpt = workdir / "checkpoints"
    # A different init and RNG state: the checkpoint's must win.
    model, optimizer, scheduler = setup(layout, pgs, seed=99, options=options)
    torch.manual_seed(12345)
    with check("the latest complete checkpoint is step 2"):
        assert find_latest(ckpt) == 2, find_latest(ckpt)
    with check("the checkpoint restores the trainer state and the schedule"):
        state = load_checkpoint(ckpt, model, optimizer, scheduler)
        assert state.step == 2 and state.user_state == {"rollouts": 2}, state
        assert scheduler.num_steps == 2 * K, scheduler.num_steps
    at_step2 = params(model)
    data = SyntheticData()
    data.position = state.data_state
    train(model, optimizer, scheduler, data, STEPS - state.step, settings, options)
    reference = torch.load(workdir / f"reference_rank{rank}.pt")
    with check("resumed parameters are those of the uninterrupted run within 1e-7"):
        worst = 0.0
        for name, p in params(model).items():
            worst = max(worst, (p - reference[name]).abs().max().item())
        assert worst <= 1e-7, f"rank {rank}: resumed parameters differ from the uninterrupted run by {worst:.3e}"
    with check("resumed parameters are bitwise identical to the uninterrupted run"):
        different = [n for n, p in params(model).items() if not torch.equal(p, reference[n])]
        assert not different, f"not bitwise identical (max |diff| {worst:.1e}): {different[:5]}"
    # The checkpoint tools read it as a Megatron checkpoint (last: building a model reseeds the RNG).
    with check("load_weights reads the checkpoint as a Megatron checkpoint"):
        other, _, _ = setup(layout, pgs, seed=123, options=options)
        load_weights(other, ckpt)
        assert all(torch.equal(p, at_step2[n]) for n, p in params(other).items())


if __name__ == "__main__":
    main()
    dist.barrier()
    dist.destroy_process_group()
