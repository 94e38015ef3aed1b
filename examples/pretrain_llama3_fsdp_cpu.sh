#!/usr/bin/env bash
# Fully sharded data parallelism on a Llama-3-style GPT, end to end on CPU: corpus, a tiktoken
# vocabulary built here, preprocessing, then training over NPROC processes (gloo) with every
# parameter, gradient and optimizer state split over the data-parallel ranks.
#
#   bash examples/pretrain_llama3_fsdp_cpu.sh [OUT_DIR]     # default OUT_DIR: runs/llama3_fsdp/
#
# The model and data are those of examples/pretrain_llama3_cpu.sh; the sharding flags are those
# of Megatron-LM's Megatron-FSDP Llama 3 8B recipe (examples/megatron_fsdp/): --use-megatron-fsdp
# --data-parallel-sharding-strategy optim_grads_params (parameters, gradients and optimizer
# state sharded: ZeRO-3, run here on PyTorch's FSDP2), --init-model-with-meta-device (each rank
# materialises only its own shards), --no-gradient-accumulation-fusion, --overlap-grad-reduce
# and --overlap-param-gather (what FSDP2 always does: a note says so), --ckpt-format
# fsdp_dtensor (each rank saves its shards) and --bf16 (bf16 compute on fp32 main weights).
# FSDP=torch2 trains with --use-torch-fsdp2 instead (the same sharding, PyTorch's own flag);
# SHARDING_STRATEGY=optim_grads keeps each layer's parameters gathered between forward and
# backward (ZeRO-2), optim shards only the optimizer state (the distributed optimizer).
# --calculate-per-token-loss as in the recipe: the gradients are summed over the ranks and
# divided by the global batch's token count. Left out of the recipe: --use-nccl-ub
# and --fsdp-double-buffer (CUDA buffers), fp8. BF16=0 trains in fp32. Every size can be
# overridden from the environment (the comments give Llama 3 8B's); a tiny smoke run:
#
#   TRAIN_ITERS=20 NUM_LAYERS=2 HIDDEN_SIZE=64 SEQ_LENGTH=64 LOG_INTERVAL=1 \
#     bash examples/pretrain_llama3_fsdp_cpu.sh /tmp/llama3_fsdp
#
# The world size NPROC (2) is the data-parallel size: the sharding degree (NPROC=4 shards in
# four). SHARDING_STRATEGY=optim needs CKPT_FORMAT=torch_dist (fsdp_dtensor is for fully
# sharded runs). Tokenizer (TikTokenizer on a vocabulary made here from GPT-2's merges) and
# corpus (this machine's Python standard library as JSONL; CORPUS points at your own) as in
# examples/pretrain_llama3_cpu.sh. Writes OUT_DIR/data/ (tiktoken.json, stdlib_content_document.{bin,idx}),
# OUT_DIR/train.log (appended to), OUT_DIR/loss.png, and saves fsdp_dtensor checkpoints to
# OUT_DIR/checkpoints/; rerunning resumes from the last one (raise TRAIN_ITERS to go on).
# Extra arguments go to pretrain_gpt.py after the script's flags, so they override them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/llama3_fsdp}"
[ $# -gt 0 ] && shift
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
FSDP="${FSDP:-megatron}"                  # megatron | torch2
SHARDING_STRATEGY="${SHARDING_STRATEGY:-optim_grads_params}"
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
[ "${BF16:-1}" = 1 ] && TRAIN_ARGS+=(--bf16)
case "$FSDP" in
  megatron) FSDP_ARGS=(--use-megatron-fsdp --use-distributed-optimizer
                       --data-parallel-sharding-strategy "$SHARDING_STRATEGY") ;;
  torch2) FSDP_ARGS=(--use-torch-fsdp2) ;;
  *) echo "FSDP must be megatron or torch2, got '$FSDP'" >&2; exit 2 ;;
esac
if [ "$FSDP" = torch2 ] || [ "$SHARDING_STRATEGY" != optim ]; then
  FSDP_ARGS+=(--init-model-with-meta-device)
fi
PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 "${FSDP_ARGS[@]}" --no-gradient-accumulation-fusion
  --overlap-grad-reduce --overlap-param-gather --device "$DEVICE"
)
DATA_ARGS=(
  --data-path "$OUT/data/stdlib_content_document" --split 99,1,0
  --data-cache-path "$OUT/data/cache" --num-workers 1
  --no-create-attention-mask-in-dataloader "${TOKENIZER_ARGS[@]}"
)
OUTPUT_ARGS=(
  --log-interval "$LOG_INTERVAL" --log-throughput --log-progress
  --eval-interval "$EVAL_INTERVAL" --eval-iters 2
  --save "$OUT/checkpoints" --load "$OUT/checkpoints"
  --ckpt-format "${CKPT_FORMAT:-fsdp_dtensor}"
  --save-interval "$SAVE_INTERVAL"
  --distributed-timeout-minutes 10
)
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PY" -m torch.distributed.run --standalone \
  --nproc_per_node "$NPROC" pretrain_gpt.py \
  "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
  "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -a "$OUT/train.log"
"$PY" tools/plot_loss.py --log "$OUT/train.log" --output "$OUT/loss.png"
