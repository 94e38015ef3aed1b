#!/usr/bin/env bash
# Run the test suite (sets up .venv first). Extra arguments go to pytest, e.g. --runslow.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/tools/setup_env.sh"
cd "$ROOT"
# The suite starts a few thousand Python processes (ranks, tools, converters). With bytecode
# caching off in the environment, each one compiled every module it imported and pytest
# rewrote every test module's asserts again on each run: caches go to __pycache__ (git-ignored).
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest -q "$@"
