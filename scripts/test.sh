#!/usr/bin/env bash
# The README's test command: sets up .venv (idempotent) and runs the default test suite.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m slow` or `scripts/test.sh tests/unit`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
if [ $# -eq 0 ]; then set -- -m "not slow and not sglang and not gpu"; fi
exec "$root/.venv/bin/python" -m pytest "$@"
