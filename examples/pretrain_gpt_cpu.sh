#!/usr/bin/env bash
# A small GPT on CPU with tensor parallelism (TP=2) over 2 processes, gloo backend.
#
#   bash examples/pretrain_gpt_cpu.sh OUT_DIR
#
# Expects OUT_DIR/data/stdlib_content_document.{bin,idx} and OUT_DIR/data/{vocab.json,merges.txt}
# (examples/quickstart_cpu.sh makes them). Writes OUT_DIR/train.log (every run appends to it),
# OUT_DIR/checkpoints/, OUT_DIR/tensorboard/ and OUT_DIR/loss.png. Rerunning resumes from the last
# checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: pretrain_gpt_cpu.sh OUT_DIR}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
TRAIN_ITERS="${TRAIN_ITERS:-300}"

GPT_ARGS=(
  --num-layers 4 --hidden-size 128 --num-attention-heads 4
  --seq-length 128 --max-position-embeddings 128
  --micro-batch-size 4 --global-batch-size 8
  --lr 1e-3 --train-iters "$TRAIN_ITERS" --lr-decay-style cosine --lr-warmup-iters 30
  --min-lr 1e-4 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999
  --init-method-std 0.02 --attention-dropout 0.1 --hidden-dropout 0.1
)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --device cpu)
DATA_ARGS=(
  --data-path "$OUT/data/stdlib_content_document" --split 969,30,1
  --vocab-file "$OUT/data/vocab.json" --merge-file "$OUT/data/merges.txt"
  --tokenizer-type GPT2BPETokenizer --num-workers 1
)
OUTPUT_ARGS=(
  --log-interval 10 --eval-interval 100 --eval-iters 5
  --save-interval 100 --save "$OUT/checkpoints" --load "$OUT/checkpoints"
  --tensorboard-dir "$OUT/tensorboard"
)

cd "$ROOT"
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  pretrain_gpt.py "${GPT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
  2>&1 | tee -a "$OUT/train.log"
"$PY" tools/plot_loss.py --log "$OUT/train.log" --output "$OUT/loss.png"
