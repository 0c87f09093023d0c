#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment at .venv/ for CPU development and CI.
# Idempotent: a stamp file records what was installed, so a second run costs about a second.
# GPU clusters do not use this script: see README.md ("On GPU clusters").
set -euo pipefail
# pip, quiet, without the "Location '...' is ignored" lines a machine's pip config with missing find-links
# directories prints for every package (they are not about this project); its real warnings and errors pass.
pip_install() { "$venv/bin/python" -m pip install -q "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2); }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=$root/.venv
python=${PYTHON:-python3}

# Pinned CPU stack. torch 2.13.0 is the CPU wheel on local disk; a looser pin can pull a multi-GB
# CUDA build. megatron-core 0.16.1 is the newest release for Python 3.11 (0.17 needs 3.12).
# psutil is an undeclared megatron-core dependency (dist-checkpoint saves hang without it).
requirements=(
  "torch==2.13.0"
  "megatron-core==0.16.1"
  "psutil" "tqdm" "pyyaml" "numpy" "pytest>=8"
  # Hugging Face side of checkpoint conversion and the parity tool; the version SGLang 0.5.23 wants.
  "transformers==5.19.0" "tokenizers==0.23.2" "safetensors"
  "matplotlib"  # the reward / clip-fraction / length plot of a run
  "httpx"       # the async rollout client (SGLang HTTP API)
  "sniffio"     # without it httpcore retries a failing `import sniffio` on every request (~100 a rollout step)
  "datasets==5.2.0" "pyarrow"  # prompt files: jsonl, parquet, save_to_disk directories (megatron_gspo/data)
  "math-verify==0.9.0"         # the `math` reward: LaTeX / \boxed{} / fractions / sets equivalence
)
stamp_text="$(printf '%s\n' "${requirements[@]}"; cat pyproject.toml)"
stamp=$venv/.megatron_gspo_setup

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ] && "$venv/bin/python" -c "import importlib.metadata as m; m.version('megatron-core'); m.version('torch'); import megatron_gspo" 2>/dev/null; then
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip_install --upgrade pip
pip_install "${requirements[@]}"
pip_install --no-deps --no-build-isolation -e .
printf '%s' "$stamp_text" > "$stamp"
echo "setup: .venv ready ($("$venv/bin/python" -c 'import megatron_gspo, torch, megatron.core as m; print("torch", torch.__version__, "megatron-core", m.__version__)'))"
