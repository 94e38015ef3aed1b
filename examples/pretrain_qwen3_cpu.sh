#!/usr/bin/env bash
# A Qwen3-style GPT end to end on CPU: corpus, GPT-2 vocabulary, preprocessing, then training
# over 2 processes (gloo); MOE=1 trains the Qwen3-MoE variant instead.
#
#   bash examples/pretrain_qwen3_cpu.sh [OUT_DIR]           # default OUT_DIR: runs/qwen3/
#   MOE=1 bash examples/pretrain_qwen3_cpu.sh [OUT_DIR]     # default OUT_DIR: runs/qwen3_moe/
#
# The model is Qwen3's architecture at toy size, with the flags of Megatron-LM's Qwen3 recipes:
# RMSNorm on the queries and keys of every head before rotary (--qk-layernorm), grouped-query
# attention with a head size of its own (--kv-channels), rope with Qwen3's base 1000000, SwiGLU,
# RMSNorm, no biases, an output layer untied from the embedding. With MOE=1 every layer's MLP is
# Qwen3-MoE's: softmax top-k over NUM_EXPERTS small SwiGLU experts, the probabilities of the
# chosen ones renormalised (Qwen3-MoE's norm_topk_prob, i.e. no --moe-router-pre-softmax), the
# global load-balancing loss, and no shared expert; the experts are dealt over EP ranks. Every
# size can be overridden from the environment (the comments give Qwen3-8B's and
# Qwen3-30B-A3B's); a tiny smoke run:
#
#   TRAIN_ITERS=10 NUM_LAYERS=2 HIDDEN_SIZE=64 SEQ_LENGTH=64 LOG_INTERVAL=1 \
#     bash examples/pretrain_qwen3_cpu.sh /tmp/qwen3
#
# The world size NPROC (2) must be a multiple of TP (x EP with MOE=1): TP=1 (default) trains
# data-parallel 2 with the distributed optimizer; TP=2 splits the layers and adds
# --sequence-parallel. MOE=1 defaults to EP=2. Left out on CPU: --bf16 (BF16=1 adds it).
#
# The corpus is this machine's Python standard library as JSONL (tools/build_stdlib_corpus.py);
# point CORPUS at your own JSONL with a "content" key to train on other text. Writes OUT_DIR/data/
# (vocab.json, merges.txt, stdlib_content_document.{bin,idx}), OUT_DIR/train.log (appended to),
# OUT_DIR/loss.png, and saves torch_dist checkpoints to OUT_DIR/checkpoints/; rerunning resumes
# from the last one, and tools/checkpoint/convert.py --saver hf turns one into a
# Qwen3ForCausalLM (Qwen3MoeForCausalLM) folder. Extra arguments go to pretrain_gpt.py after the
# script's flags, so they override them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MOE="${MOE:-0}"
if [ "$MOE" = 1 ]; then DEFAULT_OUT="$ROOT/runs/qwen3_moe"; else DEFAULT_OUT="$ROOT/runs/qwen3"; fi
OUT="${1:-$DEFAULT_OUT}"
[ $# -gt 0 ] && shift
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
TP="${TP:-1}"
if [ "$MOE" = 1 ]; then EP="${EP:-2}"; else EP="${EP:-1}"; fi
DEVICE="${DEVICE:-cpu}"
MAX_BYTES="${MAX_BYTES-3000000}"          # corpus size cap; empty = the whole standard library
NUM_LAYERS="${NUM_LAYERS:-4}"             # Qwen3-8B: 36; Qwen3-30B-A3B: 48
HIDDEN_SIZE="${HIDDEN_SIZE:-128}"         # 4096; 2048
FFN_HIDDEN_SIZE="${FFN_HIDDEN_SIZE:-384}" # 12288 (dense only)
NUM_HEADS="${NUM_HEADS:-4}"               # 32
NUM_QUERY_GROUPS="${NUM_QUERY_GROUPS:-2}" # 8; 4
KV_CHANNELS="${KV_CHANNELS:-32}"          # 128 (head size; not hidden / heads in every size)
NUM_EXPERTS="${NUM_EXPERTS:-8}"           # MoE: 128
TOPK="${TOPK:-2}"                         # MoE: 8
MOE_FFN_HIDDEN_SIZE="${MOE_FFN_HIDDEN_SIZE:-64}"  # MoE: 768
AUX_LOSS_COEFF="${AUX_LOSS_COEFF:-1e-3}"  # MoE: router_aux_loss_coef 0.001
ROTARY_BASE="${ROTARY_BASE:-1000000}"     # rope_theta
SEQ_LENGTH="${SEQ_LENGTH:-256}"           # 4096 pretraining (40960 positions)
MICRO_BATCH="${MICRO_BATCH:-2}"
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
TOKENIZER_ARGS=(
  --tokenizer-type GPT2BPETokenizer --vocab-file "$OUT/data/vocab.json"
  --merge-file "$OUT/data/merges.txt"
)
if [ ! -s "$OUT/data/stdlib_content_document.idx" ]; then
  "$PY" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$OUT/data/stdlib" \
    --json-keys content "${TOKENIZER_ARGS[@]}" --append-eod --workers 2
fi

echo "== 3/3 training"
MODEL_ARGS=(
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
  --num-attention-heads "$NUM_HEADS" --group-query-attention
  --num-query-groups "$NUM_QUERY_GROUPS" --kv-channels "$KV_CHANNELS" --qk-layernorm
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --position-embedding-type rope --rotary-base "$ROTARY_BASE" --rotary-percent 1.0
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --untie-embeddings-and-output-weights --init-method-std 0.02
  --attention-dropout 0.0 --hidden-dropout 0.0
)
MOE_ARGS=()
[ "$MOE" = 1 ] && MOE_ARGS=(
  --num-experts "$NUM_EXPERTS" --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE"
  --moe-router-topk "$TOPK" --moe-router-load-balancing-type aux_loss
  --moe-aux-loss-coeff "$AUX_LOSS_COEFF" --moe-token-dispatcher-type alltoall
  --moe-grouped-gemm
)
TRAIN_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 1e-5 --lr-decay-style cosine
  --lr-warmup-iters "$WARMUP_ITERS" --clip-grad 1.0 --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95
)
[ "${BF16:-0}" = 1 ] && TRAIN_ARGS+=(--bf16)
PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP"
  --use-distributed-optimizer --device "$DEVICE"
)
[ "$TP" -gt 1 ] && PARALLEL_ARGS+=(--sequence-parallel)
DATA_ARGS=(
  --data-path "$OUT/data/stdlib_content_document" --split 99,1,0 --num-workers 1
  "${TOKENIZER_ARGS[@]}"
)
OUTPUT_ARGS=(
  --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters 2
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --ckpt-format torch_dist
  --save-interval "$SAVE_INTERVAL" --distributed-timeout-minutes 10
)
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node "$NPROC" pretrain_gpt.py \
  "${MODEL_ARGS[@]}" ${MOE_ARGS[@]+"${MOE_ARGS[@]}"} "${TRAIN_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
  "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -a "$OUT/train.log"
"$PY" tools/plot_loss.py --log "$OUT/train.log" --output "$OUT/loss.png"
