"""benchmarks/train_overhead.py --quick: every layout prints its four passes with positive, finite
ratios, and the passes computed what they claim on the same model and micro-batches (the learning
rate is 0, so the weights are the same for all of them)."""
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "train_overhead.py"
PASSES = ("gspo train", "megatron train", "gspo recompute", "megatron forward")
NUMBER = r"(-?[0-9.]+|nan|inf)"
ROW = re.compile(rf"^(tp1|tp2|ep2)\s+({'|'.join(PASSES)})\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}"
                 rf"(?:\s+{NUMBER}\s+{NUMBER})?\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+(.*)$")
SUMMARY = re.compile(r"^(tp1|tp2|ep2): .* padding_fraction ([0-9.]+),")


def parse(output: str):
    rows, padding = {}, {}
    for line in output.splitlines():
        if m := ROW.match(line):
            layout, name, *numbers, value = m.groups()
            numbers = [float(x) for x in numbers if x is not None]
            ratios = numbers[4:6] if len(numbers) == 9 else []
            values = dict(zip(value.split()[::2], map(float, value.split()[1::2])))
            rows[layout, name] = {"wall": numbers[0], "cpu": numbers[1], "ratios": ratios,
                                  "peak": numbers[-3], "values": values}
        elif m := SUMMARY.match(line):
            padding[m.group(1)] = float(m.group(2))
    return rows, padding


@pytest.mark.distributed
@pytest.mark.slow  # a benchmark smoke run: ~45-55 CPU-s
def test_quick_run_prints_the_overhead_table():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick"], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows, padding = parse(proc.stdout)
    for layout in ("tp1", "tp2", "ep2"):
        for name in PASSES:
            row = rows.get((layout, name))
            assert row is not None, f"no {layout} / {name} row in:\n{proc.stdout[-3000:]}"
            assert row["wall"] > 0 and row["cpu"] > 0 and row["peak"] > 0, (layout, name, row)
            # the ratio columns stand on the gspo rows (a/b, c/d) only
            assert len(row["ratios"]) == (2 if name.startswith("gspo") else 0), (layout, name, row)
            assert all(math.isfinite(x) and x > 0 for x in row["ratios"]), (layout, name, row)
        assert 0.0 <= padding[layout] < 1.0, (layout, padding)
        values = {name: rows[layout, name]["values"] for name in PASSES}
        # lr 0: Megatron's training and forward-only passes see the same weights and data, the same CE
        assert values["megatron train"]["loss"] == values["megatron forward"]["loss"], values
        # CE of an untrained model is about log(vocab): log 512 (padded rows in Megatron's softmax)
        # = 6.238 vs log 500 = 6.215 in ours, so -mean log-prob and the CE agree to well within 0.1
        assert abs(values["gspo recompute"]["loss"] - values["megatron forward"]["loss"]) < 0.1, values
        assert 5.5 < values["megatron forward"]["loss"] < 7.0, values
        # on-policy GSPO step: -J = -mean advantage, 0 for group-normalised advantages
        assert abs(values["gspo train"]["loss"]) < 1e-3, values
        assert 0.0 < values["gspo recompute"]["entropy"] <= math.log(500) + 1e-3, values
