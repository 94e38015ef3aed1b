#!/usr/bin/env bash
# BERT pretraining (masked-LM + sentence order) end to end: corpus, WordPiece vocabulary,
# sentence-split preprocessing, then training with tensor parallelism (TP=2) over 2 processes.
#
#   bash examples/pretrain_bert.sh [OUT_DIR]          # default OUT_DIR: runs/bert/
#
# The defaults are a small model that trains on 2 CPU cores in a few minutes (gloo). Every size
# can be overridden from the environment, e.g. a BERT-base run on GPUs:
#
#   NUM_LAYERS=12 HIDDEN_SIZE=768 NUM_HEADS=12 SEQ_LENGTH=512 MICRO_BATCH=32 GLOBAL_BATCH=256 \
#   VOCAB_SIZE=30522 TRAIN_ITERS=1000000 LR=1e-4 WARMUP_ITERS=10000 MAX_BYTES= DEVICE=cuda \
#   NPROC=8 bash examples/pretrain_bert.sh runs/bert_base
#
# The corpus is this machine's Python standard library as JSONL (tools/build_stdlib_corpus.py);
# point CORPUS at your own JSONL with a "content" key to train on other text. Writes
# OUT_DIR/data/ (vocab.txt, stdlib_content_sentence.{bin,idx}), OUT_DIR/train.log (appended to),
# OUT_DIR/checkpoints/ and OUT_DIR/tensorboard/. Rerunning resumes from the last checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/bert}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
TP="${TP:-2}"
DEVICE="${DEVICE:-cpu}"
MAX_BYTES="${MAX_BYTES-3000000}"    # corpus size cap; empty = the whole standard library
VOCAB_SIZE="${VOCAB_SIZE:-8000}"
NUM_LAYERS="${NUM_LAYERS:-4}"       # BERT-base: 12
HIDDEN_SIZE="${HIDDEN_SIZE:-128}"   # BERT-base: 768
NUM_HEADS="${NUM_HEADS:-4}"         # BERT-base: 12
SEQ_LENGTH="${SEQ_LENGTH:-128}"     # BERT-base: 512
MICRO_BATCH="${MICRO_BATCH:-8}"
GLOBAL_BATCH="${GLOBAL_BATCH:-8}"   # BERT-base: 256
TRAIN_ITERS="${TRAIN_ITERS:-200}"
LR="${LR:-1e-3}"                    # BERT-base: 1e-4
WARMUP_ITERS="${WARMUP_ITERS:-20}"  # BERT-base: 10000
CORPUS="${CORPUS:-$OUT/stdlib.jsonl}"
mkdir -p "$OUT/data"
cd "$ROOT"

echo "== 1/4 corpus -> $CORPUS"
if [ ! -s "$CORPUS" ]; then
  "$PY" tools/build_stdlib_corpus.py --output "$CORPUS" ${MAX_BYTES:+--max-bytes "$MAX_BYTES"}
fi

echo "== 2/4 WordPiece vocabulary -> $OUT/data/vocab.txt"
if [ ! -s "$OUT/data/vocab.txt" ]; then
  "$PY" tools/train_tokenizer.py --input "$CORPUS" --json-keys content \
    --tokenizer-type BertWordPieceLowerCase --vocab-size "$VOCAB_SIZE" \
    --output "$OUT/data/vocab.txt"
fi

echo "== 3/4 sentence-split preprocessing -> $OUT/data/stdlib_content_sentence"
if [ ! -s "$OUT/data/stdlib_content_sentence.idx" ]; then
  "$PY" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$OUT/data/stdlib" \
    --json-keys content --split-sentences --tokenizer-type BertWordPieceLowerCase \
    --vocab-file "$OUT/data/vocab.txt" --workers 2
fi

echo "== 4/4 training"
BERT_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --lr "$LR" --train-iters "$TRAIN_ITERS" --lr-decay-style linear --min-lr 1e-5
  --lr-warmup-iters "$WARMUP_ITERS" --weight-decay 1e-2 --clip-grad 1.0
  --adam-beta1 0.9 --adam-beta2 0.999 --init-method-std 0.02
  --attention-dropout 0.1 --hidden-dropout 0.1 --mask-prob 0.15 --short-seq-prob 0.1
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --device "$DEVICE")
DATA_ARGS=(
  --data-path "$OUT/data/stdlib_content_sentence" --split 949,50,1
  --vocab-file "$OUT/data/vocab.txt" --tokenizer-type BertWordPieceLowerCase --num-workers 1
)
# BERT saves --ckpt-format torch here (torch_dist, the default, holds GPT models only).
OUTPUT_ARGS=(
  --log-interval 10 --eval-interval 100 --eval-iters 5
  --save-interval 100 --save "$OUT/checkpoints" --load "$OUT/checkpoints" --ckpt-format torch
  --tensorboard-dir "$OUT/tensorboard"
)
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node "$NPROC" pretrain_bert.py \
  "${BERT_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
  2>&1 | tee -a "$OUT/train.log"
