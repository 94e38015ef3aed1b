#!/usr/bin/env bash
# Create or refresh the project's virtual environment at .venv and build the C++ extensions.
# Idempotent: when requirements, setup.py and csrc/ are unchanged since the last run, it only
# checks that the environment imports. Used by the README's commands, CI and the benchmarks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3.12 python3.10 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
stamp_now="$(cat requirements.txt requirements-dev.txt setup.py $(find csrc -type f | sort) \
  | sha256sum | cut -c1-16)"
stamp_old="$(cat .venv/.megatron_stamp 2>/dev/null || true)"
if [ "$stamp_now" != "$stamp_old" ]; then
  echo "[setup] installing requirements into .venv (torch CPU wheel unless a CUDA torch is present)"
  # pip warns once per package about index folders this machine's config names but lacks;
  # those lines are noise, anything else (and the exit status) is kept.
  set +e
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt 2>&1 \
    | grep -v "^WARNING: Location '.*' is ignored"
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    echo "[setup] pip install -r requirements-dev.txt failed (exit $status)" >&2
    exit "$status"
  fi
  # nvidia-resiliency-ext pulls in the deprecated 'pynvml' shim, whose import hook makes every
  # 'import torch' print a FutureWarning; the pynvml module it needs comes from nvidia-ml-py.
  if .venv/bin/python -m pip show -q pynvml >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall -y -q pynvml 2>&1 | grep -v "^WARNING: Location '.*' is ignored" || true
  fi
  echo "[setup] building C++ extensions (ninja)"
  .venv/bin/python setup.py -q build_ext --inplace >/dev/null
  echo "$stamp_now" > .venv/.megatron_stamp
fi
# Make the checkout importable from anywhere in the environment (what an editable install does),
# so tools/ and examples/ run from any working directory.
site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT" > "$site/megatron_checkout.pth"
.venv/bin/python -c "import torch, megatron.data._index_helpers" \
  || { echo "[setup] the environment does not import; remove .venv and rerun" >&2; exit 1; }
