#!/usr/bin/env bash
# A Mixtral-style mixture-of-experts GPT end to end on CPU: corpus, GPT-2 vocabulary,
# preprocessing, then training over 2 processes with expert parallelism (EP=2: each rank holds
# half the experts, tokens travel to them by all-to-all), gloo backend.
#
#   bash examples/pretrain_mixtral_cpu.sh [OUT_DIR]        # default OUT_DIR: runs/mixtral/
#
# The model is Mixtral's architecture at toy size: rope, RMSNorm, grouped-query attention, no
# biases, untied output layer, and in every layer a router choosing the top 2 of NUM_EXPERTS
# SwiGLU experts, with the load-balancing loss. Every size can be overridden from the
# environment (the comments give Mixtral 8x7B's); a tiny smoke run:
#
#   TRAIN_ITERS=10 NUM_LAYERS=2 HIDDEN_SIZE=64 SEQ_LENGTH=64 LOG_INTERVAL=1 \
#     bash examples/pretrain_mixtral_cpu.sh /tmp/mixtral
#
# With TP > 1 the script adds --sequence-parallel (Megatron requires it with MoE); the world
# size NPROC must be a multiple of TP x EP (the experts are dealt over the data-parallel ranks).
#
# The corpus is this machine's Python standard library as JSONL (tools/build_stdlib_corpus.py);
# point CORPUS at your own JSONL with a "content" key to train on other text. Writes
# OUT_DIR/data/ (vocab.json, merges.txt, stdlib_content_document.{bin,idx}), OUT_DIR/train.log
# (appended to) and OUT_DIR/loss.png, and saves torch_dist checkpoints (the --ckpt-format
# default) to OUT_DIR/checkpoints/; rerunning resumes from the last one, at any EP, and
# tools/checkpoint/convert.py --saver hf turns it into a MixtralForCausalLM folder. Extra
# arguments go to pretrain_gpt.py after the script's flags, so they override them (e.g.
# --moe-token-dispatcher-type allgather); GROUPED_GEMM=0 runs the experts one by one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/mixtral}"
[ $# -gt 0 ] && shift
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
TP="${TP:-1}"
EP="${EP:-2}"                             # experts split over EP ranks; NUM_EXPERTS % EP == 0
DISPATCHER="${DISPATCHER:-alltoall}"      # or allgather
GROUPED_GEMM="${GROUPED_GEMM:-1}"
DEVICE="${DEVICE:-cpu}"
MAX_BYTES="${MAX_BYTES-3000000}"          # corpus size cap; empty = the whole standard library
NUM_LAYERS="${NUM_LAYERS:-4}"             # Mixtral 8x7B: 32
HIDDEN_SIZE="${HIDDEN_SIZE:-128}"         # 4096
NUM_HEADS="${NUM_HEADS:-4}"               # 32
NUM_QUERY_GROUPS="${NUM_QUERY_GROUPS:-2}" # 8
NUM_EXPERTS="${NUM_EXPERTS:-4}"           # 8
TOPK="${TOPK:-2}"                         # 2
MOE_FFN_HIDDEN_SIZE="${MOE_FFN_HIDDEN_SIZE:-256}"  # 14336
AUX_LOSS_COEFF="${AUX_LOSS_COEFF:-0.02}"  # Mixtral's router_aux_loss_coef
ROTARY_BASE="${ROTARY_BASE:-1000000}"     # Mixtral's rope_theta
SEQ_LENGTH="${SEQ_LENGTH:-256}"           # 4096 (32768 for v0.1)
MICRO_BATCH="${MICRO_BATCH:-4}"
GLOBAL_BATCH="${GLOBAL_BATCH:-8}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
LR="${LR:-1e-3}"
WARMUP_ITERS="${WARMUP_ITERS:-20}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
EVAL_INTERVAL="${EVAL_INTERVAL:-100}"
SAVE_INTERVAL="${SAVE_INTERVAL:-100}"
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
MOE_ARGS=(
  --num-experts "$NUM_EXPERTS" --moe-router-topk "$TOPK"
  --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE" --ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE"
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff "$AUX_LOSS_COEFF"
  --moe-token-dispatcher-type "$DISPATCHER"
)
[ "$GROUPED_GEMM" = 1 ] && MOE_ARGS+=(--moe-grouped-gemm)
TRAIN_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --lr "$LR" --train-iters "$TRAIN_ITERS" --lr-decay-style cosine
  --lr-warmup-iters "$WARMUP_ITERS" --min-lr 1e-4 --weight-decay 0.1 --clip-grad 1.0
  --adam-beta1 0.9 --adam-beta2 0.95
)
PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP" --device "$DEVICE"
)
[ "$TP" -gt 1 ] && PARALLEL_ARGS+=(--sequence-parallel)   # Megatron requires it for MoE + TP
DATA_ARGS=(
  --data-path "$OUT/data/stdlib_content_document" --split 969,30,1
  --vocab-file "$OUT/data/vocab.json" --merge-file "$OUT/data/merges.txt"
  --tokenizer-type GPT2BPETokenizer --num-workers 1
)
OUTPUT_ARGS=(--log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters 5)
OUTPUT_ARGS+=(--save-interval "$SAVE_INTERVAL" --save "$OUT/checkpoints" --load "$OUT/checkpoints")
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node "$NPROC" pretrain_gpt.py \
  "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -a "$OUT/train.log"
"$PY" tools/plot_loss.py --log "$OUT/train.log" --output "$OUT/loss.png"
