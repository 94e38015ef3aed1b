#!/usr/bin/env bash
# Run the test suite (sets up .venv first). Extra arguments go to pytest, e.g. --runslow.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/setup_env.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest -q "$@"
