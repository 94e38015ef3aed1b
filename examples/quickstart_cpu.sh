#!/usr/bin/env bash
# The main job, end to end on CPU: environment, corpus, GPT-2 vocabulary, preprocessing, training,
# then a sample from the generation server and the same model as a Hugging Face folder.
#
#   bash examples/quickstart_cpu.sh            # outputs under runs/quickstart/
#
# Everything it needs is installed into .venv by tools/setup_env.sh; nothing is downloaded
# except Python packages. The corpus is this machine's Python standard library, as JSONL with a
# "content" key, like the CodeParrot data the classic GPT-2 recipe trains on.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/runs/quickstart}"
mkdir -p "$OUT"
PY="$ROOT/.venv/bin/python"

echo "== 1/5 environment (.venv)"
bash tools/setup_env.sh

echo "== 2/5 corpus: Python standard library -> $OUT/stdlib.jsonl"
if [ ! -s "$OUT/stdlib.jsonl" ]; then
  "$PY" tools/build_stdlib_corpus.py --output "$OUT/stdlib.jsonl"
fi

echo "== 3/5 GPT-2 vocabulary and preprocessing -> $OUT/data/"
mkdir -p "$OUT/data"
"$PY" - "$OUT/data" <<'PYEOF'
import shutil, sys
from megatron.tokenizer import gpt2_vocab_files
vocab, merges = gpt2_vocab_files()
shutil.copy(vocab, f"{sys.argv[1]}/vocab.json")
shutil.copy(merges, f"{sys.argv[1]}/merges.txt")
PYEOF
if [ ! -s "$OUT/data/stdlib_content_document.idx" ]; then
  "$PY" tools/preprocess_data.py --input "$OUT/stdlib.jsonl" \
    --output-prefix "$OUT/data/stdlib" --json-keys content \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/data/vocab.json" \
    --merge-file "$OUT/data/merges.txt" --append-eod --workers 2
fi

echo "== 4/5 training"
bash examples/pretrain_gpt_cpu.sh "$OUT"

echo "== 5/5 generation (PUT /api) and Hugging Face export -> $OUT/hf"
bash examples/generate_cpu.sh "$OUT"
echo "Outputs are under $OUT"
