"""`megatron-gspo train examples/tiny_moe_cpu.yaml` end to end with rollout.backend=megatron: the tiny
Qwen3-MoE (4 experts top-2) samples its own rollouts, 2 steps, under EP2 (x DP2), PP2 and, on one
process, each policy loss (gspo, gspo_token, grpo).

Checks the run's products: one metrics record per optimizer step, step 2 sampled by the weights
after step 1 (version "1"), rollout log-probs equal to the trainer's recompute (the gap metric ~0),
nothing clipped in an on-policy first mini-batch, a complete checkpoint of the last step (EP2: written in
the background, checkpoint.async_save).
"""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"ep2": ["parallel.dp=2", "parallel.ep=2"], "pp2": ["parallel.dp=1", "parallel.ep=1", "parallel.pp=2"],
           "one_process": ["parallel.dp=1", "parallel.ep=1"]}


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_moe") / "hf", TinyQwen3Spec(num_experts=4))


def common_overrides(hf_dir, run_dir) -> list[str]:
    return ["rollout.backend=megatron", f"model.hf_path={hf_dir}", f"logging.run_dir={run_dir}",
            f"checkpoint.dir={run_dir / 'ckpt'}",
            "checkpoint.interval=2", "num_steps=2", "gspo.prompts_per_step=4", "gspo.group_size=4",
            "gspo.num_minibatches=2", "eval.samples_per_prompt=4"]


def train(hf_dir, run_dir, *overrides) -> list[dict]:
    args = [*common_overrides(hf_dir, run_dir), *overrides]
    proc = subprocess.run([sys.executable, "-m", "megatron_gspo.cli", "train", str(REPO / "examples/tiny_moe_cpu.yaml"),
                           *args], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return training_records(run_dir)


def all_records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training_records(run_dir) -> list[dict]:
    """The optimizer steps' records (eval records hold eval/* metrics only)."""
    return [r for r in all_records(run_dir) if "loss/value" in r]


def check_eval(run_dir: Path, last_step: int) -> None:
    """The held-out eval of examples/tiny_moe_cpu.yaml (10 prompts, k=4 here) before training and at the end."""
    evals = [r for r in all_records(run_dir) if "eval/held_out/mean@4" in r]
    assert [(r["step"], r["rollout_step"]) for r in evals] == [(0, 0), (last_step, last_step // 2)]
    for r in evals:
        assert 0.0 <= r["eval/held_out/mean@4"] <= r["eval/held_out/pass@4"] <= 1.0
        assert r["eval/held_out/prompts"] == 10 and r["eval/held_out/response_length"] >= 1


def check_run(records: list[dict], run_dir: Path) -> None:
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # 2 rollout steps x 2 mini-batches
    assert [r["rollout/weight_version"] for r in records] == ["0", "0", "1", "1"]
    # Every metric docs/gspo.md lists, every step.
    expected = {"reward/mean", "reward/std", "reward/zero_signal_group_fraction", "rollout/response_length_mean",
                "rollout/response_length_max", "loss/ratio_mean", "loss/ratio_min", "loss/ratio_max", "loss/clipped_fraction_seq",
                "loss/clipped_fraction_token", "train/rollout_abs_delta_token", "train/entropy", "train/grad_norm", "train/lr",
                "rollout/tokens_per_s", "train/tokens_per_s", "time/rollout_s", "time/recompute_s",
                "time/train_s", "time/sync_s"}
    for r in records:
        assert expected <= r.keys(), sorted(expected - r.keys())
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["rollout/tokens_per_s"] > 0 and r["train/tokens_per_s"] > 0
        assert 0.0 <= r["reward/std"] <= 0.5 and r["rollout/response_length_max"] >= r["rollout/response_length_mean"]
        assert r["rollout/response_length_mean"] >= 1
        # The sampler's log-probs are the trainer's, up to float rounding of different batch shapes.
        assert r["train/rollout_abs_delta_token"] < 1e-5 and r["train/rollout_abs_delta_seq"] < 1e-5
    assert records[0]["loss/clipped_fraction_seq"] == records[2]["loss/clipped_fraction_seq"] == 0.0
    assert (run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (run_dir / "ckpt" / "iter_0000002" / "trainer.pt").is_file()


@pytest.mark.distributed
@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["ep2", pytest.param("pp2", marks=pytest.mark.slow)])  # PP2 trains in test_layouts
def test_two_steps_with_in_process_rollouts(tiny_moe_dir, tmp_path, layout):
    # ep2 writes its checkpoints in the background: the last one is complete when the run ends.
    extra = ["checkpoint.async_save=true", "checkpoint.interval=1"] if layout == "ep2" else []
    records = train(tiny_moe_dir, tmp_path / "run", *LAYOUTS[layout], *extra)
    check_run(records, tmp_path / "run")
    check_eval(tmp_path / "run", last_step=4)


@pytest.mark.distributed
@pytest.mark.e2e
@pytest.mark.parametrize("algorithm", [pytest.param("gspo", marks=pytest.mark.slow),  # the runs above are gspo
                                       pytest.param("gspo_token", marks=pytest.mark.slow), "grpo"])
def test_two_steps_per_algorithm(tiny_moe_dir, tmp_path, algorithm):
    records = train(tiny_moe_dir, tmp_path / "run", *LAYOUTS["one_process"], f"gspo.algorithm={algorithm}")
    check_run(records, tmp_path / "run")
    assert all(math.isfinite(r["loss/value"]) for r in records)


def checkpoint_tensors(directory: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, directory.parent / "flat.pt")
    flat = torch.load(directory.parent / "flat.pt", weights_only=False)
    return {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}


@pytest.mark.distributed
@pytest.mark.e2e
@pytest.mark.slow
def test_killed_run_resumes_exactly(tiny_moe_dir, tmp_path):
    """4 steps at EP2: uninterrupted, and killed (SIGKILL) after step 2's checkpoint then resumed:
    the same samples (rewards, losses of steps 3-4) and bitwise the same final weights and Adam state."""
    steps = ["num_steps=4", "checkpoint.interval=2", *LAYOUTS["ep2"]]
    whole = train(tiny_moe_dir, tmp_path / "whole", *steps)

    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "megatron_gspo.cli", "train", str(REPO / "examples/tiny_moe_cpu.yaml"),
           *common_overrides(tiny_moe_dir, run_dir), *steps]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    latest = run_dir / "ckpt" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 240
    while not (latest.is_file() and latest.read_text().strip() == "2"):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its step-2 checkpoint"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: no handler, no final checkpoint
    proc.wait()
    assert latest.read_text().strip() == "2", "the run got past step 4's checkpoint before the kill"

    resumed = train(tiny_moe_dir, run_dir, *steps)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(whole[4:], resumed[4:]):  # steps 3-4: the same samples, the same updates
        assert (a["reward/mean"], a["loss/value"], a["train/grad_norm"]) == (b["reward/mean"], b["loss/value"], b["train/grad_norm"])
    ref = checkpoint_tensors(tmp_path / "whole" / "ckpt" / "iter_0000004")
    got = checkpoint_tensors(run_dir / "ckpt" / "iter_0000004")
    assert ref.keys() == got.keys() and len(ref) > 10
    assert all(torch.equal(ref[k], got[k]) for k in ref), [k for k in ref if not torch.equal(ref[k], got[k])]
