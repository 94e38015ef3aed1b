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
# Most tests run one thread (or a few ranks of one thread each), so the suite spreads its files
# over one pytest worker per core (pytest-xdist; up to 4, one file per worker at a time so a
# file's shared fixtures are built once): on 2 cores it takes about 0.6 of the time of one
# process. MEGATRON_TEST_WORKERS=N sets the number; 1 runs everything in this process (for -s,
# --pdb or a single test).
workers="${MEGATRON_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}"
case "$workers" in
  ''|*[!0-9]*) echo "MEGATRON_TEST_WORKERS must be a whole number, got '$workers'" >&2; exit 2 ;;
esac
parallel=()
if [ "$workers" -gt 1 ]; then parallel=(-n "$workers" --dist loadfile); fi
exec .venv/bin/python -m pytest -q "${parallel[@]}" "$@"
