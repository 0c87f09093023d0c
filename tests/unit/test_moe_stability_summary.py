"""benchmarks/moe_stability.py's numbers from a run's metrics.jsonl: which mini-batches each is read over,
length buckets weighted by their sequences, the collapse rule, and the mean/spread over seeds."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("moe_stability", REPO / "benchmarks" / "moe_stability.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def write_run(run_dir: Path, rewards, *, k=2, clipped=(0.5, 0.1), routing=(0.0, 0.2), w_std=(0.0, 0.3),
              s_std=(0.0, 0.05), gap=1e-6):
    """A metrics.jsonl of len(rewards) rollout steps x k mini-batches, an eval at step 0 and at the end."""
    run_dir.mkdir(parents=True)
    records = [{"step": 0, "rollout_step": 0, "eval/held_out/mean@4": 0.01}]
    step = 0
    for s, reward in enumerate(rewards, start=1):
        for m in range(k):
            step += 1
            r = {"step": step, "rollout_step": s, "loss/value": 0.0, "reward/mean": reward,
                 "loss/clipped_fraction_token": clipped[m], "moe/routing_changed_fraction": routing[m],
                 "loss/log_ratio_token_std": w_std[m], "loss/log_ratio_seq_std": s_std[m],
                 # two buckets: the long one holds 3x the sequences and a larger spread
                 "loss/log_ratio_token_std/len_16-63": w_std[m] / 2, "loss/log_ratio_seq_std/len_16-63": s_std[m] / 2,
                 "loss/sequences/len_16-63": 1.0,
                 "loss/log_ratio_token_std/len_64-255": w_std[m], "loss/log_ratio_seq_std/len_64-255": s_std[m],
                 "loss/sequences/len_64-255": 3.0,
                 "rollout/response_length_mean": 70.0, "time/step_s": 10.0 + s}
            if m == 0:
                r["train/rollout_abs_delta_token"] = gap
            records.append(r)
    records.append({"step": step, "rollout_step": len(rewards), "eval/held_out/mean@4": 0.25})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_one_run_reads_later_minibatches_and_weights_buckets(tmp_path):
    write_run(tmp_path / "r", [0.0, 0.1, 0.2, 0.3], routing=(0.9, 0.2))
    run = bench.summarize_run(tmp_path / "r")
    assert run["steps"] == 4 and run["rewards"] == [0.0, 0.1, 0.2, 0.3]
    assert run["reward_final"] == pytest.approx(0.2)                  # the last 3 steps
    assert (run["eval_first"], run["eval_last"], run["eval_k"]) == (0.01, 0.25, 4)
    assert run["clipped_token"] == pytest.approx(0.3)                 # all mini-batches
    assert run["clipped_token_later"] == pytest.approx(0.1)           # mini-batch 2 only
    assert run["routing_changed"] == pytest.approx(0.2)               # not mini-batch 1's 0.9
    assert run["log_w_std"] == pytest.approx(0.3) and run["log_s_std"] == pytest.approx(0.05)
    assert list(run["by_length"]) == ["len_16-63", "len_64-255"]      # ordered by length, not by name
    assert run["by_length"]["len_64-255"]["log_w_std"] == pytest.approx(0.3)
    assert run["by_length"]["len_64-255"]["sequences"] == 12.0        # 3 per mini-batch 2 x 4 steps
    assert run["gap_token"] == pytest.approx(1e-6)
    assert not run["collapsed"]


def test_length_table_shows_buckets_with_enough_sequences_and_their_clipping(tmp_path):
    write_run(tmp_path / "r", [0.0, 0.1, 0.2, 0.3])
    run = bench.summarize_run(tmp_path / "r")
    assert run["by_length"]["len_16-63"]["sequences"] == 4.0          # < MIN_BUCKET_SEQUENCES: not in the table
    text = bench.length_table({"gspo": bench.summarize_arm("gspo", {1: run})})
    rows = [line for line in text.splitlines() if line.startswith("| gspo |")]
    assert len(rows) == 1 and rows[0].startswith("| gspo | 64-255 | 12 | 0.3000 ")
    assert rows[0].endswith("| 6.0 | - |")                             # 0.3 / 0.05; no bucket-wise clipping logged


@pytest.mark.parametrize("rewards, expected", [
    ([0.1, 0.5, 0.6, 0.6, 0.1, 0.0, 0.0, 0.0], True),     # peak 0.6, then down and staying down
    ([0.1, 0.5, 0.6, 0.6, 0.1, 0.0, 0.6, 0.7, 0.7], False),  # dips, then recovers
    ([0.5, 0.45, 0.4, 0.38, 0.36], False),                  # drifts down less than 0.2
    ([0.0, 0.01, 0.0, 0.02], False),                        # at chance: cannot fall 0.2
])
def test_collapse_rule(rewards, expected):
    assert bench.collapsed(rewards) is expected


def test_arm_mean_and_spread_over_seeds(tmp_path):
    write_run(tmp_path / "a", [0.0, 0.0, 0.3], clipped=(0.1, 0.1))
    write_run(tmp_path / "b", [0.0, 0.0, 0.6], clipped=(0.3, 0.3))
    arm = bench.summarize_arm("gspo", {1: bench.summarize_run(tmp_path / "a"), 2: bench.summarize_run(tmp_path / "b")})
    assert arm["seeds"] == [1, 2] and arm["collapses"] == 0
    assert arm["clipped_token"]["mean"] == pytest.approx(0.2)
    assert arm["clipped_token"]["std"] == pytest.approx(math.sqrt(0.02))
    assert arm["reward_curve"][2]["min"] == 0.3 and arm["reward_curve"][2]["max"] == 0.6
    assert "| gspo | 2 |" in bench.table({"gspo": arm})
    assert bench.ratios({"gspo": arm, "grpo": {**arm, "clipped_token": {"mean": 0.002}}}) == [
        "- clipped tokens gspo / grpo: 100x"]


def test_mixed_task_overrides_point_the_comparison_at_its_files_with_room_for_its_responses():
    from megatron_gspo.config import load_config

    config = load_config(bench.CONFIG, bench.TASKS["long_addition_mixed"]["overrides"])
    mixed = REPO / "examples" / "data" / "long_addition_mixed"
    assert [REPO / p for p in config.data.train] == [mixed / "train.jsonl"]
    assert REPO / config.eval.datasets["held_out"] == mixed / "test.jsonl"
    assert config.sampling.max_new_tokens > 149             # the longest right response (4 columns): 149 tokens
    assert load_config(bench.CONFIG, bench.TASKS["long_addition"]["overrides"]).data.train != config.data.train
