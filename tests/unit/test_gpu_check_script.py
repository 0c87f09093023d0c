"""scripts/gpu_check.sh, the parts that run without a GPU: its syntax, the plan (--dry-run), the venv it
makes (--setup-only, over this machine's interpreter: a venv's, as on the GPU image), its early failures,
and the summary it writes from pytest's JUnit files (--summarize)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash")


def run(*args, env=None, timeout=120):
    return subprocess.run([BASH, str(SCRIPT), *args], cwd=REPO, env={**os.environ, **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


def test_bash_syntax():
    proc = subprocess.run([BASH, "-n", str(SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout


def test_dry_run_plans_every_gpu_test_file_and_touches_nothing(tmp_path):
    venv = tmp_path / "venv"
    proc = run("--dry-run", env={"GPU_CHECK_VENV": str(venv), "GPU_CHECK_RESULTS": str(tmp_path / "res")})
    assert proc.returncode == 0, proc.stdout
    planned = {line.split(" -m gpu ")[1].split()[0] for line in proc.stdout.splitlines() if " -m gpu " in line}
    # A new tests/gpu file that the script does not run would never run on a GPU.
    assert planned == {str(p.relative_to(REPO)) for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    assert not venv.exists() and not (tmp_path / "res").exists()


def test_setup_only_makes_a_venv_over_the_interpreters_packages(tmp_path):
    venv = tmp_path / "venv"
    proc = run("--setup-only", env={"GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_VENV": str(venv),
                                    "GPU_CHECK_RESULTS": str(tmp_path / "res"), "GPU_CHECK_WHEELS": str(tmp_path / "none")})
    assert proc.returncode == 0, proc.stdout
    assert "megatron-core 0.16.1" in (tmp_path / "res" / "environment.txt").read_text()
    # The new venv's own interpreter sees this interpreter's packages and the checkout, from any directory.
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import sys, megatron.core, megatron_gspo; print(sys.prefix); print(megatron_gspo.__file__)"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=120)
    assert probe.returncode == 0
    prefix, package = probe.stdout.split()[-2:]
    assert Path(prefix) == venv and Path(package).is_relative_to(REPO)


def test_setup_names_the_missing_modules(tmp_path):
    sglang_python = REPO / ".venv-sglang" / "bin" / "python"  # torch without megatron-core
    if not sglang_python.exists():
        pytest.skip("no .venv-sglang (scripts/setup_sglang.sh): no interpreter with torch and without megatron-core")
    proc = run("--setup-only", env={"GPU_CHECK_PYTHON": str(sglang_python), "GPU_CHECK_VENV": str(tmp_path / "venv"),
                                    "GPU_CHECK_RESULTS": str(tmp_path / "res"), "GPU_CHECK_WHEELS": str(tmp_path / "none")})
    assert proc.returncode == 2, proc.stdout
    assert "megatron.core (ModuleNotFoundError" in proc.stdout and "--fetch-wheels" in proc.stdout


def test_run_without_a_gpu_stops_early(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH without nvidia-smi, whatever this machine has
    bin_dir.mkdir()
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    proc = run(env={"PATH": str(bin_dir), "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_VENV": str(tmp_path / "venv"),
                    "GPU_CHECK_RESULTS": str(tmp_path / "res")})
    assert proc.returncode == 2 and "no nvidia-smi" in proc.stdout, proc.stdout
    assert not (tmp_path / "venv").exists()


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu.test_x" name="test_ok" time="1.25"/>
<testcase classname="tests.gpu.test_x" name="test_bad" time="2.5"><failure message="assert 0.2 &lt; 0.05">trace</failure></testcase>
<testcase classname="tests.gpu.test_x" name="test_skip" time="0"><skipped message="needs 2 GPUs, 1 visible"/></testcase>
</testsuite></testsuites>"""


def test_summary_rows_per_check_and_per_test(tmp_path):
    (tmp_path / "test_x.xml").write_text(JUNIT)
    (tmp_path / "test_x.status").write_text("1 42\n")
    (tmp_path / "test_y.status").write_text("124 300\n")  # timed out: no JUnit file
    (tmp_path / "test_z.status").write_text("not-run 0\n")
    (tmp_path / "environment.txt").write_text("NVIDIA H200, 143771 MiB\n")
    proc = run("--summarize", str(tmp_path), env={"GPU_CHECK_PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout
    summary = (tmp_path / "gpu_check_summary.md").read_text()
    assert summary in proc.stdout
    assert "| test_x | FAILED (exit 1) | 42 |" in summary
    assert "| test_y | TIMED OUT | 300 |" in summary and "| test_z | NOT RUN (budget spent) | 0 |" in summary
    assert "| test_ok | passed | 1.2 |" in summary or "| test_ok | passed | 1.3 |" in summary
    assert "| test_bad | failed | 2.5 | assert 0.2 < 0.05 |" in summary
    assert "| test_skip | skipped | 0.0 | needs 2 GPUs, 1 visible |" in summary
    assert "Totals: 1 passed, 1 failed, 0 error, 1 skipped" in summary
    assert "NVIDIA H200" in summary
