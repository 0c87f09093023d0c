#!/usr/bin/env bash
# The README's main command: sets up both environments (idempotent), makes the demo's tiny Qwen3 once
# (random init + format warm-start), then runs the GSPO demo on CPU (TP2 + one SGLang server).
# Arguments are config overrides, e.g. `scripts/demo.sh num_steps=20 seed=7`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
"$root/scripts/setup_sglang.sh"
cd "$root"
# (made again when it predates the chat template that renders the demo's message prompts)
if [ ! -f runs/tiny_cpu/hf/config.json ] || [ ! -f runs/tiny_cpu/hf/chat_template.jinja ]; then
  [ -e runs/tiny_cpu ] && mv runs/tiny_cpu "runs/tiny_cpu.old-$(date +%s)" && echo "moved the old run aside"
  .venv/bin/megatron-gspo tiny-model runs/tiny_cpu/hf --warm-start arithmetic
fi
exec .venv/bin/megatron-gspo train examples/tiny_cpu.yaml "$@"
