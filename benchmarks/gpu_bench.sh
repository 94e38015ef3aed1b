#!/usr/bin/env bash
# End-to-end GPU training speed, under 8 minutes on one H200:
#   1. build the fused kernels' CUDA bodies (setup.py, this GPU's architecture only), unless
#      they are already built;
#   2. benchmarks/gpu_bench_models.py: pretrain_gpt.py at GPT-2 124M (s 1024) and 1.3B
#      (24 layers, h 2048, 16 heads, s 2048), bf16, --use-flash-attn, every fusion, --mock-data,
#      beside transformers' GPT-2 124M trained by a plain loop under torch.compile; tokens/s and
#      MFU against 989 TFLOP/s (dense bf16) with Megatron's FLOP count.
# Needs a CUDA build of torch (and nvcc for the kernels; without them the run goes on with the
# pure-torch references and the table says so).
#
#   benchmarks/gpu_bench.sh [--dry-run] [more gpu_bench_models.py flags]
#
# --dry-run: no GPU, no build; every contender runs 2 iterations on the CPU with tiny shapes.
# Output: a markdown table on stdout; results.md, results.json, build.log and one log per
# contender in $OUT (default ./gpu_bench_out).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OUT="${OUT:-$ROOT/gpu_bench_out}"
mkdir -p "$OUT"
export OUT

DRY=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && DRY=1; done

if [ "$DRY" = 0 ]; then
  "$PY" - <<'PYEOF'
import sys
import torch
if not (torch.cuda.is_available() and torch.version.cuda):
    sys.exit(f"gpu_bench: needs a CUDA build of torch and a visible GPU (torch {torch.__version__}, "
             f"CUDA {torch.version.cuda}); run 'benchmarks/gpu_bench.sh --dry-run' for the CPU check")
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
PYEOF

  if "$PY" -c "from megatron.fused_kernels import ops; import sys; sys.exit(0 if ops.kernels_available('cuda') else 1)" 2>/dev/null; then
    echo "[gpu_bench] 1/2 CUDA kernel bodies already built"
  else
    if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
      TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
      export TORCH_CUDA_ARCH_LIST
    fi
    export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
    echo "[gpu_bench] 1/2 build (arch $TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
    start=$(date +%s)
    if timeout 240 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
        && "$PY" -c "from megatron.fused_kernels import ops; import sys; sys.exit(0 if ops.kernels_available('cuda') else 1)"; then
      echo "[gpu_bench] built in $(( $(date +%s) - start )) s"
    else
      tail -20 "$OUT/build.log"
      echo "[gpu_bench] WARNING: no CUDA kernel bodies; the runs use the pure-torch references"
      # No just-in-time build inside each timed run either.
      export MEGATRON_FUSED_JIT=0
    fi
  fi
  BUDGET=$(( 450 - SECONDS ))
else
  echo "[gpu_bench] dry run on the CPU (tiny shapes, 2 iterations each)"
  BUDGET=900
fi

echo "[gpu_bench] 2/2 contenders (budget ${BUDGET} s)"
PYTHONUNBUFFERED=1 "$PY" benchmarks/gpu_bench_models.py --out "$OUT" --budget-s "$BUDGET" "$@"
