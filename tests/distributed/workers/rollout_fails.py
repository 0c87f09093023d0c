"""Rank 0's rollout fails while a background checkpoint is unpublished (tests/distributed/test_checkpoint_recovery.py).

usage: torchrun --nproc-per-node 2 rollout_fails.py WORKDIR HF_DIR

`train` (training/loop.py) on examples/tiny_moe_cpu.yaml: EP2 over 2 processes, the trained model samples
(rollout.backend megatron), 4 prompts x 4 samples per step, checkpoints every step written in the background
(checkpoint.async_save; keep_last 2). The reward function breaks on step 3's samples
(reward_breaks_at_step_3.py) and only rank 0 scores, so the failure starts on rank 0, while step 2's
checkpoint is written but unpublished: a background save is published at the next step's checkpoint, which
step 3 never reaches.
Checks: every rank raises RolloutFailed with rank 0's message; step 2's checkpoint is published and the latest.
Then step 2 is put back as a kill between Megatron's finalize and the publication leaves it (iter_0000002.tmp,
`latest` at 1) and the run is started again (num_steps=2): it publishes iter_0000002 and resumes from it.
The run's folder (WORKDIR/run/ckpt: iter_0000001, iter_0000002) is what the recovery tests start from.
"""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_gspo.config import load_config
from megatron_gspo.rollout.protocol import RolloutFailed
from megatron_gspo.training.checkpoint import LATEST, complete_iterations, find_latest
from megatron_gspo.training.loop import train

from checks import check, done, shutdown

REPO = Path(__file__).resolve().parents[3]


def main():
    workdir, hf_dir = Path(sys.argv[1]), sys.argv[2]
    data = REPO / "examples" / "data" / "arithmetic"
    overrides = [
        "rollout.backend=megatron", f"model.hf_path={hf_dir}", f"logging.run_dir={workdir / 'run'}",
        f"checkpoint.dir={workdir / 'run' / 'ckpt'}",
        "checkpoint.async_save=true", "checkpoint.interval=1", "num_steps=4", "eval.interval=0",
        "gspo.prompts_per_step=4", "gspo.group_size=4", "gspo.num_minibatches=2",
        f"data.train={data / 'train.jsonl'}", f"eval.datasets.held_out={data / 'test.jsonl'}",
        "reward.fn=tests.distributed.workers.reward_breaks_at_step_3:score", "reward.workers=1"]
    config = load_config(REPO / "examples" / "tiny_moe_cpu.yaml", overrides)
    with check("every rank raises RolloutFailed with rank 0's message"):
        try:
            train(config)
        except RolloutFailed as error:
            message = str(error)
        else:
            raise AssertionError("the run did not fail")
        assert message.startswith("scoring failed on rank 0: RewardError: reward function "
                                  "'tests.distributed.workers.reward_breaks_at_step_3:score' failed on 16 of 16 "
                                  "samples"), message
        assert "RuntimeError: deliberate failure at step 3" in message, message
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, message)
        assert messages == [message] * dist.get_world_size(), messages
    ckpt = workdir / "run" / "ckpt"
    with check("step 2's background checkpoint is published before the error ends the run"):
        assert complete_iterations(ckpt) == [1, 2] and find_latest(ckpt) == 2, sorted(p.name for p in ckpt.iterdir())
        assert not list(ckpt.glob("*.tmp")), sorted(p.name for p in ckpt.iterdir())
    dist.barrier()  # every rank has looked
    if dist.get_rank() == 0:  # publication undone: the folder a kill right before it leaves
        (ckpt / "iter_0000002").rename(ckpt / "iter_0000002.tmp")
        (ckpt / LATEST).write_text("1\n")
    dist.barrier()
    with check("the next start publishes the complete iter_0000002.tmp and resumes from it"):
        output = io.StringIO()
        with contextlib.redirect_stdout(output):
            train(load_config(REPO / "examples" / "tiny_moe_cpu.yaml", [*overrides, "num_steps=2"]))
        print(output.getvalue(), end="", flush=True)
        if dist.get_rank() == 0:  # (rank 0 prints)
            assert "published iter_0000002 left complete by the previous run\n" in output.getvalue(), output.getvalue()
            assert f"resumed from {ckpt} at step 2\n" in output.getvalue(), output.getvalue()
        assert complete_iterations(ckpt) == [1, 2] and find_latest(ckpt) == 2, sorted(p.name for p in ckpt.iterdir())
    done()


if __name__ == "__main__":
    main()
    shutdown()
