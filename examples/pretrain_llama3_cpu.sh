#!/usr/bin/env bash
# A Llama-3-style dense GPT with today's Megatron-LM flags, end to end on CPU: corpus, a tiktoken
# vocabulary built here, preprocessing, then training over 2 processes (gloo).
#
#   bash examples/pretrain_llama3_cpu.sh [OUT_DIR]          # default OUT_DIR: runs/llama3/
#
# The model is Llama 3's architecture at toy size: rope with Llama 3.1's frequency scaling
# (--use-rope-scaling), RMSNorm, SwiGLU, grouped-query attention, no biases, untied output layer;
# the flags are those of Megatron-LM's Llama 3 recipes (examples/llama/train_llama3_8b_*.sh):
# Megatron-Core models with --transformer-impl transformer_engine and --attention-backend auto
# (here both run this project's own layers: one note says so), the distributed optimizer with
# overlapped gradient reduction, per-token loss, torch_dist checkpoints, --log-progress and
# --save-retain-interval. Every size can be overridden from the environment (the comments give
# Llama 3 8B's); a tiny smoke run:
#
#   TRAIN_ITERS=20 NUM_LAYERS=2 HIDDEN_SIZE=64 SEQ_LENGTH=64 LOG_INTERVAL=1 \
#     bash examples/pretrain_llama3_cpu.sh /tmp/llama3
#
# The world size NPROC (2) is TP x data-parallel: TP=1 (default) trains data-parallel 2, which
# is where the distributed optimizer shards its state; TP=2 splits the layers instead and adds
# --sequence-parallel, as the recipes do.
#
# Tokenizer: TikTokenizer (Llama 3's kind: a byte-level BPE in tiktoken's format, pattern v2)
# on a vocabulary made here from GPT-2's merges (shipped offline with the project), in the JSON
# layout Megatron-LM's TikTokenizer reads: 1000 special-token ids, then the bytes, then the
# merges, VOCAB_SIZE ids in all. Point TOKENIZER_MODEL at a real tiktoken JSON to use your own.
# Left out on CPU: --bf16 and the fp8 flags of the recipes (BF16=1 adds --bf16).
#
# The corpus is this machine's Python standard library as JSONL (tools/build_stdlib_corpus.py);
# point CORPUS at your own JSONL with a "content" key to train on other text. Writes OUT_DIR/data/
# (tiktoken.json, stdlib_content_document.{bin,idx}), OUT_DIR/train.log (appended to),
# OUT_DIR/loss.png, and saves torch_dist checkpoints to OUT_DIR/checkpoints/ (progress.txt beside
# them); rerunning resumes from the last one. Extra arguments go to pretrain_gpt.py after the
# script's flags, so they override them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/llama3}"
[ $# -gt 0 ] && shift
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
TP="${TP:-1}"
DEVICE="${DEVICE:-cpu}"
MAX_BYTES="${MAX_BYTES-3000000}"          # corpus size cap; empty = the whole standard library
VOCAB_SIZE="${VOCAB_SIZE:-8192}"          # Llama 3: 128256
NUM_LAYERS="${NUM_LAYERS:-4}"             # 32
HIDDEN_SIZE="${HIDDEN_SIZE:-128}"         # 4096
FFN_HIDDEN_SIZE="${FFN_HIDDEN_SIZE:-352}" # 14336
NUM_HEADS="${NUM_HEADS:-4}"               # 32
NUM_QUERY_GROUPS="${NUM_QUERY_GROUPS:-2}" # 8
ROTARY_BASE="${ROTARY_BASE:-500000}"      # Llama 3's rope_theta
SEQ_LENGTH="${SEQ_LENGTH:-256}"           # 8192
MICRO_BATCH="${MICRO_BATCH:-2}"
GLOBAL_BATCH="${GLOBAL_BATCH:-8}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
LR="${LR:-1e-3}"                          # 1.5e-4 at 8B
WARMUP_ITERS="${WARMUP_ITERS:-20}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
EVAL_INTERVAL="${EVAL_INTERVAL:-100}"
SAVE_INTERVAL="${SAVE_INTERVAL:-100}"
SAVE_RETAIN_INTERVAL="${SAVE_RETAIN_INTERVAL:-$((2 * SAVE_INTERVAL))}"
CORPUS="${CORPUS:-$OUT/stdlib.jsonl}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-$OUT/data/tiktoken.json}"
mkdir -p "$OUT/data"
cd "$ROOT"

echo "== 1/3 corpus -> $CORPUS"
if [ ! -s "$CORPUS" ]; then
  "$PY" tools/build_stdlib_corpus.py --output "$CORPUS" ${MAX_BYTES:+--max-bytes "$MAX_BYTES"}
fi

echo "== 2/3 tiktoken vocabulary ($VOCAB_SIZE ids) and preprocessing -> $OUT/data/"
if [ ! -s "$TOKENIZER_MODEL" ]; then
  TIKTOKEN_CACHE_DIR="" "$PY" - "$TOKENIZER_MODEL" "$VOCAB_SIZE" <<'PYEOF'
import base64, json, sys
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from megatron.tokenizer import gpt2_vocab_files
path, vocab_size = sys.argv[1], int(sys.argv[2])
vocab, merges = gpt2_vocab_files()
ranks = data_gym_to_mergeable_bpe_ranks(merges, vocab)
merged = [t for t, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(t) > 1]
tokens = [bytes([b]) for b in range(256)] + merged[:vocab_size - 1000 - 256]
entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
            "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(tokens)]
with open(path, "w", encoding="utf-8") as f:
    json.dump(entries, f)
PYEOF
fi
TOKENIZER_ARGS=(
  --tokenizer-type TikTokenizer --tokenizer-model "$TOKENIZER_MODEL" --tiktoken-pattern v2
  --vocab-size "$VOCAB_SIZE"
)
if [ ! -s "$OUT/data/stdlib_content_document.idx" ]; then
  "$PY" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$OUT/data/stdlib" \
    --json-keys content "${TOKENIZER_ARGS[@]}" --append-eod --workers 2
fi

echo "== 3/3 training"
MODEL_ARGS=(
  --use-mcore-models --transformer-impl transformer_engine --attention-backend auto
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
  --num-attention-heads "$NUM_HEADS" --group-query-attention
  --num-query-groups "$NUM_QUERY_GROUPS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --position-embedding-type rope --rotary-base "$ROTARY_BASE" --rotary-percent 1.0
  --use-rope-scaling --rope-scaling-factor 8.0 --no-rope-fusion
  --normalization RMSNorm --norm-epsilon 1e-5 --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear
  --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
)
TRAIN_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 1e-5 --lr-decay-style cosine
  --lr-warmup-iters "$WARMUP_ITERS" --clip-grad 1.0 --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95 --calculate-per-token-loss
)
[ "${BF16:-0}" = 1 ] && TRAIN_ARGS+=(--bf16)
PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --use-distributed-optimizer --overlap-grad-reduce
  --device "$DEVICE"
)
[ "$TP" -gt 1 ] && PARALLEL_ARGS+=(--sequence-parallel)
DATA_ARGS=(
  --data-path "$OUT/data/stdlib_content_document" --split 99,1,0
  --data-cache-path "$OUT/data/cache" --num-workers 1
  --no-create-attention-mask-in-dataloader "${TOKENIZER_ARGS[@]}"
)
OUTPUT_ARGS=(
  --log-interval "$LOG_INTERVAL" --log-throughput --log-progress
  --eval-interval "$EVAL_INTERVAL" --eval-iters 2
  --save "$OUT/checkpoints" --load "$OUT/checkpoints" --ckpt-format torch_dist
  --save-interval "$SAVE_INTERVAL" --save-retain-interval "$SAVE_RETAIN_INTERVAL"
  --distributed-timeout-minutes 10
)
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node "$NPROC" pretrain_gpt.py \
  "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
  "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -a "$OUT/train.log"
"$PY" tools/plot_loss.py --log "$OUT/train.log" --output "$OUT/loss.png"
