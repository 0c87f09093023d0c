#!/usr/bin/env bash
# The README's test command: sets up .venv (idempotent) and runs the default test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m slow` or `scripts/test.sh tests/unit`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
# Default selection: everything but the slow, GPU and e2e tiers (.ci/run runs e2e after it).
# The sglang tier (real SGLang servers on CPU) needs .venv-sglang: set it up (idempotent; ~2.8 GB and
# ~80 s the first time) whenever the selection can include it.
if [ $# -eq 0 ]; then set -- -m "not slow and not gpu and not e2e" --durations=15; fi
case " $* " in
  *"not sglang"*) ;;
  *) "$root/scripts/setup_sglang.sh" ;;
esac
exec "$root/.venv/bin/python" -m pytest "$@"
