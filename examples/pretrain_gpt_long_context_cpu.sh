#!/usr/bin/env bash
# A long-context GPT on CPU with context parallelism (CP=2) over 2 processes, gloo backend:
# corpus, GPT-2 vocabulary, preprocessing, then training on sequences of SEQ_LENGTH tokens with
# each rank holding half of every sequence.
#
#   bash examples/pretrain_gpt_long_context_cpu.sh [OUT_DIR]   # default OUT_DIR: runs/long_context/
#
# --context-parallel-size 2 cuts each sequence into 4 chunks; rank r keeps chunks r and 3 - r,
# so both ranks do the same share of the causal attention work, and --cp-comm-type p2p passes
# the key/value blocks around the ring of CP ranks so that attention still sees the whole
# sequence. Activation memory per rank is about 1/CP of one rank's (benchmarks/RESULTS.md,
# "Context parallelism"); the losses equal a CP=1 run's. Every size can be overridden from the
# environment, e.g. a tiny smoke run:
#
#   TRAIN_ITERS=10 SEQ_LENGTH=512 NUM_LAYERS=2 HIDDEN_SIZE=64 LOG_INTERVAL=1 \
#     bash examples/pretrain_gpt_long_context_cpu.sh /tmp/long_context
#
# or CP=4 over 8 GPUs with CP_COMM_TYPE=a2a (heads per TP rank divisible by CP) or all_gather.
# SEQ_LENGTH must be divisible by 2 x CP, and NPROC by TP x CP. The corpus is this machine's
# Python standard library as JSONL (tools/build_stdlib_corpus.py); point CORPUS at your own JSONL
# with a "content" key. Writes OUT_DIR/data/, OUT_DIR/train.log (appended to),
# OUT_DIR/checkpoints/ and OUT_DIR/loss.png; rerunning resumes from the last checkpoint (also at
# another CP: checkpoints do not depend on it). Extra arguments go to pretrain_gpt.py after the
# script's flags, so they override them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/long_context}"
[ $# -gt 0 ] && shift
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
TP="${TP:-1}"
CP="${CP:-2}"
CP_COMM_TYPE="${CP_COMM_TYPE:-p2p}"       # p2p (ring), all_gather or a2a
DEVICE="${DEVICE:-cpu}"
MAX_BYTES="${MAX_BYTES-3000000}"          # corpus size cap; empty = the whole standard library
NUM_LAYERS="${NUM_LAYERS:-4}"
HIDDEN_SIZE="${HIDDEN_SIZE:-128}"
NUM_HEADS="${NUM_HEADS:-4}"
NUM_QUERY_GROUPS="${NUM_QUERY_GROUPS:-2}"
SEQ_LENGTH="${SEQ_LENGTH:-2048}"
ROTARY_BASE="${ROTARY_BASE:-500000}"      # a large rope base, as long-context models use
MICRO_BATCH="${MICRO_BATCH:-1}"
GLOBAL_BATCH="${GLOBAL_BATCH:-2}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
LR="${LR:-1e-3}"
WARMUP_ITERS="${WARMUP_ITERS:-10}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
EVAL_INTERVAL="${EVAL_INTERVAL:-50}"
SAVE_INTERVAL="${SAVE_INTERVAL:-50}"
CORPUS="${CORPUS:-$OUT/stdlib.jsonl}"
mkdir -p "$OUT/data"
cd "$ROOT"

echo "== 1/3 corpus -> $CORPUS"
if [ ! -s "$CORPUS" ]; then
  "$PY" tools/build_stdlib_corpus.py --output "$CORPUS" ${MAX_BYTES:+--max-bytes "$MAX_BYTES"}
fi

echo "== 2/3 GPT-2 vocabulary and preprocessing -> $OUT/data/"
"$PY" - "$OUT/data" <<'PYEOF'
import shutil, sys
from megatron.tokenizer import gpt2_vocab_files
vocab, merges = gpt2_vocab_files()
shutil.copy(vocab, f"{sys.argv[1]}/vocab.json")
shutil.copy(merges, f"{sys.argv[1]}/merges.txt")
PYEOF
if [ ! -s "$OUT/data/stdlib_content_document.idx" ]; then
  "$PY" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$OUT/data/stdlib" \
    --json-keys content --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/data/vocab.json" \
    --merge-file "$OUT/data/merges.txt" --append-eod --workers 2
fi

echo "== 3/3 training"
MODEL_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
  --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --position-embedding-type rope --rotary-base "$ROTARY_BASE" --normalization RMSNorm
  --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
  --init-method-std 0.02 --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAIN_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --lr "$LR" --train-iters "$TRAIN_ITERS" --lr-decay-style cosine
  --lr-warmup-iters "$WARMUP_ITERS" --min-lr 1e-4 --weight-decay 0.1 --clip-grad 1.0
  --adam-beta1 0.9 --adam-beta2 0.95
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --context-parallel-size "$CP"
  --cp-comm-type "$CP_COMM_TYPE" --device "$DEVICE"
)
[ "$TP" -gt 1 ] && PARALLEL_ARGS+=(--sequence-parallel)
DATA_ARGS=(
  --data-path "$OUT/data/stdlib_content_document" --split 969,30,1
  --vocab-file "$OUT/data/vocab.json" --merge-file "$OUT/data/merges.txt"
  --tokenizer-type GPT2BPETokenizer --num-workers 1
)
OUTPUT_ARGS=(
  --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters 2
  --save-interval "$SAVE_INTERVAL" --save "$OUT/checkpoints" --load "$OUT/checkpoints"
)
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node "$NPROC" pretrain_gpt.py \
  "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
  "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -a "$OUT/train.log"
"$PY" tools/plot_loss.py --log "$OUT/train.log" --output "$OUT/loss.png"
