"""benchmarks/moe_stability.py --preset smoke end to end: two arms (GSPO, GRPO + R3) on a tiny Qwen3-MoE with
one shared SGLang server reset between runs; every reported number comes back from the runs' records."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.dev.tiny_model import TinyQwen3Spec, make_tiny_qwen3
from megatron_gspo.dev.warm_start import warm_start_long_addition

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def test_smoke_preset(tmp_path):
    hf = make_tiny_qwen3(tmp_path / "hf", TinyQwen3Spec(num_experts=4, num_experts_per_tok=2))
    warm_start_long_addition(hf, steps=150)  # the worked format, so responses are long
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_stability.py"), "--preset", "smoke",
                           "--out", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    arms = results["arms"]
    assert list(arms) == ["gspo", "grpo_r3"]
    for name, arm in arms.items():
        run = arm["runs"]["1"]
        assert run["steps"] == 2 and len(run["rewards"]) == 2, name
        assert run["eval_first"] is not None and run["eval_last"] is not None, name
        assert run["response_length"] > 16, name              # the warm start's long format
        assert 0.0 <= run["clipped_token"] <= 1.0, name
        assert run["routing_changed"] is not None, name
        # pi_old recomputed at the weights that sampled, float32 both sides: the gap is rounding
        assert math.isfinite(run["gap_token"]) and run["gap_token"] < 1e-3, (name, run["gap_token"])
        assert run["by_length"], name
        assert all(0.0 <= c["clipped_token"] <= 1.0 for c in run["by_length"].values()), name   # per-length clipping
    # the shared server is reset to the initial weights (version "0") before each run: the second run's first
    # batch was sampled by them, not by the first run's last weights (version "2")
    for name in ("gspo", "grpo_r3"):
        first = next(json.loads(line) for line in (tmp_path / "runs" / name / "seed1" / "metrics.jsonl").open()
                     if '"loss/value"' in line)
        assert first["rollout/weight_version"] == "0", (name, first["rollout/weight_version"])
    text = (tmp_path / "results" / "results.md").read_text()
    assert "| gspo | 1 |" in text and "| grpo_r3 | 1 |" in text
    assert (tmp_path / "results" / "moe_stability.png").stat().st_size > 10_000
