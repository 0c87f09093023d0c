"""benchmarks/packing.py on a small long-tailed mini-batch: both layouts print their rows, packing
removes padding and rows, and the packed passes compute what the unpacked ones do (lr 0: same weights)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "packing.py"
N = r"(-?[0-9.]+)"
A = r"\s*->\s*"
ROW = re.compile(rf"^(tp1|tp2)\s+(train|recompute)\s+{N}{A}{N}\s+{N}{A}{N}\s+{N}{A}{N}\s+{N}\s+{N}\s+{N}\s+{N}"
                 rf"\s+{N}\s+{N}\s+(.*)$")


@pytest.mark.distributed
@pytest.mark.slow  # a benchmark smoke run: ~45-55 CPU-s
def test_small_run_packs_and_agrees():
    args = ["--layouts", "tp1,tp2", "--reps", "1", "--responses", "16", "--group-size", "4", "--median-len", "6",
            "--sigma", "1.5", "--max-len", "96", "--max-tokens", "512"]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = {}
    for line in proc.stdout.splitlines():
        if m := ROW.match(line):
            layout, what, *numbers, value = m.groups()
            rows[layout, what] = ([float(x) for x in numbers], value)
    for layout in ("tp1", "tp2"):
        for what in ("train", "recompute"):
            assert (layout, what) in rows, f"no {layout} {what} row in:\n{proc.stdout[-3000:]}"
            (pad_u, pad_p, _, _, rows_u, rows_p, *times), value = rows[layout, what]
            assert pad_p < pad_u and rows_p < rows_u, (layout, what, pad_u, pad_p, rows_u, rows_p)
            assert all(t > 0 for t in times), (layout, what, times)
        _, value = rows[layout, "recompute"]
        unpacked, packed = re.findall(r"-?\d+\.\d+", value)
        assert unpacked == packed, value            # the mean recomputed log-prob, to 6 decimals
