#!/usr/bin/env bash
# The one prepared GPU check (issue 13, part 3): on a fresh CUDA machine, a fresh virtual environment made
# from the project's own files, then every test of tests/gpu/ (marker `gpu`), one pytest run per file, in
# about 10 minutes; a summary (pass / fail / skip per test, with timings and the reason of each skip) goes
# to stdout and to $OUT/gpu_check_summary.md when OUT is set.
#
#   scripts/gpu_check.sh                    run the check (needs an NVIDIA GPU)
#   scripts/gpu_check.sh --dry-run          print the plan, touch nothing (works on CPU)
#   scripts/gpu_check.sh --setup-only       make and check the venv, run no test (works on CPU: no GPU
#                                           preflight; tests/unit/test_gpu_check_script.py runs it)
#   scripts/gpu_check.sh --fetch-wheels DIR download the wheels the check needs beyond the GPU image's own
#                                           packages (run on a machine with pip and internet access)
#   scripts/gpu_check.sh --summarize DIR    rebuild the summary from a results folder of an earlier run
#
# With the workplace's `device` tool (one H200, no internet): here, once, `echo /.whl/ >> .git/info/exclude;
# scripts/gpu_check.sh --fetch-wheels .whl` (~3 MB), then run `bash scripts/gpu_check.sh` with carry [".whl"]
# and timeout_s 600; the summary and the logs come back through $OUT. Each test file is its own pytest
# run (`pytest -m gpu FILE -x`), not one `pytest -m gpu tests/gpu -x`: a failure or a hang in one check
# then neither hides nor starves the others.
#
# The environment. The GPU machine is assumed to have no internet: everything comes from this checkout and
# from $GPU_CHECK_WHEELS. The venv is made from $GPU_CHECK_PYTHON, whose torch must see the GPU (on the
# `device` tool's H200 that is the image's python3, torch 2.11 + CUDA 13, itself a venv under /opt/torch).
# A venv made from a venv's interpreter does not see that venv's packages, even with
# --system-site-packages (it sees the base interpreter's), so a .pth file puts the interpreter's own
# site-packages behind the new venv's: the image's torch, transformers, pytest ... are used as they are,
# and only what is missing is installed into the venv, from the wheels folder, without an index. The
# project itself is this checkout, put on the venv's path by another .pth (what `pip install -e` does,
# without a build step, an index or files written into the checkout); the tests run it as
# `python -m megatron_gspo.cli`.
# Needed beyond such an image (pyproject.toml's dependencies; --fetch-wheels downloads exactly these):
# megatron-core 0.16.1, math-verify 0.9.0 (+ latex2sympy2_extended 1.11.0, antlr4-python3-runtime 4.13.2).
# Optional, each enabling its tests (they skip with the reason otherwise):
#   Transformer Engine (pyproject's `gpu` extra): wheels built for the image's torch in the same folder
#     (its CUDA library alone is larger than the device tool's 64 MiB carry; clusters use the NGC
#     container, which has it).
#   SGLang's CUDA build: MEGATRON_GSPO_SGLANG_PYTHON=an interpreter with sglang + sgl_kernel whose torch
#     sees the GPU (its pins differ from the trainer's: a separate environment, as on CPU), or sglang
#     installed into this venv from the wheels folder.
#
# Settings (environment variables): GPU_CHECK_PYTHON (python3), GPU_CHECK_VENV (${TMPDIR:-/tmp}/
# megatron_gspo_gpu_venv, made afresh every run), GPU_CHECK_WHEELS (<repo>/.whl), GPU_CHECK_BUDGET_S (540:
# no check starts after it, each runs under the time left; with the set-up, inside the device tool's 600 s), MEGATRON_GSPO_SGLANG_PYTHON, OUT.
# Exit status: 0 all ran tests passed (skips allowed), 1 a test failed or a check ran out of time, 2 the
# machine or environment is not usable (the message says what is missing).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

python=${GPU_CHECK_PYTHON:-python3}
venv=${GPU_CHECK_VENV:-${TMPDIR:-/tmp}/megatron_gspo_gpu_venv}
wheels=${GPU_CHECK_WHEELS:-$root/.whl}
budget_s=${GPU_CHECK_BUDGET_S:-540}
results=${GPU_CHECK_RESULTS:-${TMPDIR:-/tmp}/megatron_gspo_gpu_check}

# What the image lacks (see above), pinned; --fetch-wheels downloads them for CPython 3.12 x86-64.
wheel_reqs=("megatron-core==0.16.1" "math-verify==0.9.0" "latex2sympy2_extended==1.11.0"
            "antlr4-python3-runtime==4.13.2")
# Modules the project and its tests import (pyproject.toml's dependencies and `test` extra, and the
# Hugging Face side of tests/gpu/); `datasets` only reads save_to_disk folders, which no GPU test uses.
required_modules=(torch megatron.core yaml tqdm numpy psutil math_verify transformers tokenizers safetensors
                  httpx pytest matplotlib)
# The checks, cheapest first, each with the most seconds it may take (the budget left caps it further).
checks=(
  "tests/gpu/test_logprobs_bench.py:180"
  "tests/gpu/test_te_parity.py:150"
  "tests/gpu/test_train_gpu.py:240"
  "tests/gpu/test_sglang_cuda.py:300"
  "tests/gpu/test_routed_experts_sglang.py:180"
)

die() { echo "gpu_check: $*" >&2; exit 2; }

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

fetch_wheels() {
  local dir=$1
  mkdir -p "$dir"
  "$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" "${wheel_reqs[@]}"
  echo "gpu_check: wheels in $dir ($(du -sh "$dir" | cut -f1)). With the device tool: add /$(basename "$dir")/" \
       "to .git/info/exclude and name it in carry."
}

# The summary: one row per test from the JUnit files of the runs, one per check from its status file.
summarize() {
  local dir=$1
  "${summary_python:-$python}" - "$dir" <<'PY'
import sys, xml.etree.ElementTree as ET
from pathlib import Path

d = Path(sys.argv[1])
lines = ["# GPU check summary", ""]
env = d / "environment.txt"
if env.exists():
    lines += ["## Environment", "", "```", env.read_text().strip(), "```", ""]
lines += ["## Checks", "", "| check | status | wall s |", "| --- | --- | --- |"]
counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
rows = []
for status_file in sorted(d.glob("*.status")):
    name = status_file.stem
    rc, wall = status_file.read_text().split()[:2]
    # pytest: 0 all passed or skipped, 1 a test failed, 5 nothing collected; timeout(1): 124 / 137.
    status = {"0": "ok", "5": "FAILED (nothing collected)", "124": "TIMED OUT", "137": "TIMED OUT",
              "not-run": "NOT RUN (budget spent)"}.get(rc, f"FAILED (exit {rc})")
    lines.append(f"| {name} | {status} | {wall} |")
    xml = d / f"{name}.xml"
    if not xml.exists():
        continue
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                detail = (node.get("message") or "").replace("\n", " ")[:300]
        counts[outcome] += 1
        rows.append(f"| {case.get('name')} | {outcome} | {float(case.get('time', 0)):.1f} | {detail} |")
lines += ["", "## Tests", "", "| test | outcome | s | detail |", "| --- | --- | --- | --- |", *rows, "",
          "Totals: " + ", ".join(f"{v} {k}" for k, v in counts.items())]
text = "\n".join(lines) + "\n"
(d / "gpu_check_summary.md").write_text(text)
print(text)
PY
}

mode=run
case "${1:-}" in
  --dry-run) mode=dry-run ;;
  --setup-only) mode=setup-only ;;
  --fetch-wheels) [ $# -eq 2 ] || die "--fetch-wheels needs a folder"; fetch_wheels "$2"; exit 0 ;;
  --summarize) [ $# -eq 2 ] || die "--summarize needs a results folder"; summarize "$2"; exit 0 ;;
  -h|--help) usage; exit 0 ;;
  "") ;;
  *) die "unknown argument $1 (see --help)" ;;
esac

if [ $mode = dry-run ]; then
  echo "gpu_check plan (dry run: nothing is executed)"
  echo "  1. preflight: nvidia-smi lists a GPU; $python imports torch and torch.cuda.is_available()"
  echo "  2. fresh venv $venv from $python (--without-pip), + a .pth with $python's site-packages"
  echo "  3. pip install --no-index --no-deps --no-cache-dir $wheels/*.whl (needed: ${wheel_reqs[*]})"
  echo "  4. the project: a .pth with $root"
  echo "  5. require modules: ${required_modules[*]}"
  echo "  6. optional: transformer_engine.pytorch; SGLang CUDA at \${MEGATRON_GSPO_SGLANG_PYTHON:-venv}"
  echo "  7. checks (budget ${budget_s} s in all; results in $results):"
  for entry in "${checks[@]}"; do
    echo "     $venv/bin/python -m pytest -m gpu ${entry%%:*} -x -q -rA  (at most ${entry##*:} s)"
  done
  echo "  8. summary -> stdout${OUT:+ and $OUT/gpu_check_summary.md}"
  exit 0
fi

start=$SECONDS

# 1. preflight: a GPU, and an interpreter whose torch sees it.
command -v "$python" >/dev/null || die "no interpreter $python (set GPU_CHECK_PYTHON)"
"$python" -c "import torch" 2>/dev/null || die "$python cannot import torch (set GPU_CHECK_PYTHON)"
if [ $mode = run ]; then
  command -v nvidia-smi >/dev/null || die "no nvidia-smi: this is not a CUDA machine (--dry-run prints the plan)"
  nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi lists no GPU: $(nvidia-smi -L 2>&1 | head -3)"
  "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || die "$python's torch does not see a GPU: set GPU_CHECK_PYTHON to an interpreter with a CUDA build of torch"
fi
rm -rf "$results"
mkdir -p "$results"

# 2. a fresh venv over the interpreter's own packages.
rm -rf "$venv"
"$python" -m venv --without-pip "$venv"
site_dir=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$python" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site_dir/_gpu_check_base_site.pth"
vpy=$venv/bin/python

# 3-4. the wheels (offline), then the project.
if compgen -G "$wheels/*.whl" >/dev/null; then
  "$vpy" -m pip --version >/dev/null 2>&1 || die "$python has no pip: the venv needs it to install $wheels/*.whl"
  "$vpy" -m pip install -q --no-index --no-deps --no-cache-dir --no-compile "$wheels"/*.whl
fi
echo "$root" > "$site_dir/_gpu_check_project.pth"

# 5. what every check needs: stop here, naming what is missing and where to get it.
missing=$("$vpy" - "${required_modules[@]}" <<'PY'
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:  # an ImportError, or a broken install failing at import
        print(f"{name} ({type(e).__name__}: {str(e)[:120]})")
PY
)
if [ -n "$missing" ]; then
  echo "gpu_check: missing Python modules in $venv:" >&2
  echo "$missing" | sed 's/^/  /' >&2
  die "put wheels providing them in $wheels (on a machine with internet, scripts/gpu_check.sh --fetch-wheels" \
      "$wheels downloads the ones the GPU image lacks: ${wheel_reqs[*]}; others: pip download --no-deps)"
fi

# 6. the optional parts, and the environment for the summary.
if [ -z "${MEGATRON_GSPO_SGLANG_PYTHON:-}" ] && "$vpy" -c "import sglang, sgl_kernel" 2>/dev/null; then
  export MEGATRON_GSPO_SGLANG_PYTHON=$vpy
fi
{
  if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  else echo "no nvidia-smi"; fi
  "$vpy" - <<'PY'
import importlib.metadata as m, sys
print("python", sys.version.split()[0])
for name in ("torch", "megatron-core", "transformers", "transformer-engine", "transformer_engine_torch",
             "triton", "pytest"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "not installed")
import torch
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print("cuda", torch.version.cuda, "| devices", torch.cuda.device_count(), "| nccl", nccl)
PY
  sglang_py=${MEGATRON_GSPO_SGLANG_PYTHON:-}
  if [ -n "$sglang_py" ]; then
    echo "sglang python $sglang_py: $("$sglang_py" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)' 2>&1 | tail -1)"
  else
    echo "sglang: no CUDA environment (set MEGATRON_GSPO_SGLANG_PYTHON); its tests skip"
  fi
} > "$results/environment.txt" 2>&1
cat "$results/environment.txt"
if [ $mode = setup-only ]; then
  echo "gpu_check: venv ready at $venv (setup only: no checks run)"
  exit 0
fi

# 7. the checks: one pytest per file, so a failure or a hang in one does not hide the others.
failed=0 n=0
for entry in "${checks[@]}"; do
  file=${entry%%:*} cap=${entry##*:}
  n=$((n + 1))
  name=$n-$(basename "$file" .py)  # the summary lists the checks in this order
  left=$((budget_s - (SECONDS - start)))
  if [ $left -lt 20 ]; then
    echo "not-run 0" > "$results/$name.status"; failed=1; continue
  fi
  limit=$((cap < left ? cap : left))
  echo "== $file (at most $limit s)"
  t0=$SECONDS
  set +e
  PYTHONUNBUFFERED=1 timeout -k 10 "$limit" "$vpy" -m pytest -m gpu "$file" -x -q -rA -p no:cacheprovider \
    --junitxml="$results/$name.xml" -o junit_family=xunit1 > "$results/$name.log" 2>&1
  rc=$?
  set -e
  tail -n 25 "$results/$name.log"
  echo "$rc $((SECONDS - t0))" > "$results/$name.status"
  [ $rc -eq 0 ] || failed=1
done

# 8. the summary, and what travels back ($OUT: at most 8 files; the logs as one).
summary_python=$vpy summarize "$results"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$results/gpu_check_summary.md" "$OUT/"
  for log in "$results"/*.log; do echo "===== $(basename "$log")"; tail -c 2000000 "$log"; done > "$OUT/gpu_check_logs.txt"
fi
echo "gpu_check: done in $((SECONDS - start)) s"
exit $failed
