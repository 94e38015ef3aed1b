#!/usr/bin/env bash
# One-shot GPU check of the fused kernels (under 8 minutes on one H200):
#   1. build the CUDA bodies (setup.py, only this GPU's architecture);
#   2. run the kernel tests on the GPU (the `gpu`-marked cases of tests/unit/test_fused_kernels.py:
#      every op against float64, the Philox dropout mask, AdamW against torch, determinism);
#   3. time each op against its unfused composition and torch.compile of it (bf16 and fp32),
#      AdamW against torch's foreach/fused AdamW, and cross-entropy peak memory.
# Needs a CUDA build of torch and nvcc. Output: stdout, plus logs in $OUT (default: a temp dir).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"

"$PY" - <<'PYEOF'
import sys
import torch
if not (torch.cuda.is_available() and torch.version.cuda):
    sys.exit("gpu_check: needs a CUDA build of torch and a visible GPU")
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
PYEOF

if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')"
  export TORCH_CUDA_ARCH_LIST
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

echo "[gpu_check] 1/3 build (arch $TORCH_CUDA_ARCH_LIST, $MAX_JOBS jobs)"
start=$(date +%s)
timeout 300 "$PY" setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; echo "[gpu_check] build failed"; exit 1; }
echo "[gpu_check] built in $(( $(date +%s) - start )) s"
"$PY" -c "from megatron.fused_kernels import loader, ops
assert ops.kernels_available('cuda'), loader.load_error() or 'no CUDA bodies registered'
print('[gpu_check] CUDA bodies registered')"

echo "[gpu_check] 2/3 kernel tests on the GPU"
set +e
timeout 240 "$PY" -m pytest -q -m gpu tests/unit/test_fused_kernels.py -p no:cacheprovider \
  2>&1 | tee "$OUT/tests.log" | tail -25
status=${PIPESTATUS[0]}
set -e

echo "[gpu_check] 3/3 timings (fastest of 20; speedup = other / fused)"
for dtype in bfloat16 float32; do
  timeout 200 "$PY" benchmarks/bench_fused_kernels.py --device cuda --dtype "$dtype" \
    --repeats 20 --compile $([ "$dtype" = float32 ] || echo --skip-adam) \
    --json "$OUT/bench_$dtype.json" 2>&1 | tee "$OUT/bench_$dtype.log" \
    || echo "[gpu_check] benchmark ($dtype) failed or timed out"
done
exit "$status"
