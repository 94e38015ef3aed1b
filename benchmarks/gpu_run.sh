#!/usr/bin/env bash
# The one GPU run, about 8 minutes on one H100 / H200 with the build (benchmarks/gpu_run.py
# lists its stages): build the CUDA bodies, kernel tests, GPU-vs-CPU parity (and activation
# offloading there, which must keep the losses), a bf16 run that
# trains, MFU at 124M and 1.3B beside transformers, then selective recompute and a profile if
# time remains. Needs Python with a CUDA torch, nvcc and ninja; nothing is fetched.
#
#   bash benchmarks/gpu_run.sh              # on the GPU machine; results in $OUT (./gpu_run_out)
#   bash benchmarks/gpu_run.sh --dry-run    # every stage on the CPU, tiny shapes (a slow test)
#
# Output: summary.md, summary.json and logs.tar.gz in $OUT; the table is printed last.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi
exec "$PY" benchmarks/gpu_run.py "$@"
