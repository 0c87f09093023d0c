#!/usr/bin/env bash
# Creates (or refreshes) .venv-sglang/: SGLang 0.5.23 for CPU rollout servers (tests, demo, CI).
# A separate environment keeps SGLang's pins (and its ~2.9 GB) away from the trainer's .venv; the
# trainer talks to these servers over HTTP only, so it never imports SGLang.
# Idempotent: a stamp file records what was installed, so a second run costs about a second.
# GPU clusters do not use this script: they run stock SGLang (its CUDA build, real sgl_kernel).
set -euo pipefail
# pip, quiet, without the "Location '...' is ignored" lines a machine's pip config with missing find-links
# directories prints for every package (they are not about this project); its real warnings and errors pass.
pip_install() { "$venv/bin/python" -m pip install -q "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2); }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=${SGLANG_VENV:-$root/.venv-sglang}
python=${PYTHON:-python3}

# 1. torch first, pinned: 2.13.0 is the CPU wheel on local disk (a loose pin pulls a CUDA build).
torch_req="torch==2.13.0"
# 2. SGLang itself without its dependencies: `pip install sglang` is the full 11 GB CUDA stack.
sglang_req="sglang==0.5.23"
# 3. The pure-Python/CPU part of its dependencies that the server needs on CPU (the set measured by
#    starting a real server on CPU; tests/sglang/ do so). Never add `cutlass`: an unrelated PyPI package
#    that breaks start-up.
deps=(
  "transformers==5.19.0" "tokenizers==0.23.2" safetensors fastapi "uvicorn>=0.51" uvloop pyzmq
  msgspec orjson pybase64 psutil requests aiohttp setproctitle prometheus-client numpy pydantic
  python-multipart regex scipy pillow sentencepiece tiktoken partial_json_parser interegular einops
  packaging watchfiles xxhash zstandard "xgrammar==0.2.7" "llguidance>=1.7.6,<2" "openai==2.8.0"
  "openai-harmony==0.0.4" "anthropic>=0.20.0" "python-dateutil<3" distro easydict gguf
  "blobfile==3.0.0" triton IPython dill compressed-tensors jsonschema soundfile
)
stamp_text="$(printf '%s\n' "$torch_req" "$sglang_req" "${deps[@]}")"
stamp=$venv/.megatron_gspo_sglang_setup

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ] && "$venv/bin/python" -c "import importlib.metadata as m; m.version('sglang'); m.version('torch')" 2>/dev/null; then
  exit 0
fi
start=$SECONDS
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip_install --upgrade pip
pip_install "$torch_req"
pip_install --no-deps "$sglang_req"
pip_install "$torch_req" "${deps[@]}"
printf '%s' "$stamp_text" > "$stamp"
echo "setup_sglang: $venv ready in $((SECONDS - start)) s ($("$venv/bin/python" -c 'import importlib.metadata as m; print("sglang", m.version("sglang"), "torch", m.version("torch"))'))"
