#!/usr/bin/env bash
# A DeepSeek-V3-style mixture-of-experts GPT end to end on CPU: corpus, GPT-2 vocabulary,
# preprocessing, then training over 2 processes (gloo) with expert parallelism.
#
#   bash examples/pretrain_deepseek_v3_cpu.sh [OUT_DIR]     # default OUT_DIR: runs/deepseek_v3/
#
# The model is DeepSeek-V3's architecture at toy size, with the flags of Megatron-LM's
# DeepSeek-V3 recipe:
#   - multi-latent attention (--multi-latent-attention): queries through a low-rank
#     (--q-lora-rank), keys and values through a shared compressed latent (--kv-lora-rank), a
#     no-position part of each head (--qk-head-dim) beside a rotary part (--qk-pos-emb-head-dim),
#     and YaRN's rope scaling (--rotary-scaling-factor, --mscale, --mscale-all-dim over
#     --yarn-original-max-position-embeddings);
#   - DeepSeek's router: sigmoid scores (--moe-router-score-function sigmoid), a per-expert bias
#     added for choosing only and moved after every step by --moe-router-bias-update-rate
#     towards equal loads (--moe-router-enable-expert-bias), group-limited top-k (the experts in
#     --moe-router-num-groups groups, tokens may use only the best --moe-router-group-topk),
#     weights rescaled by --moe-router-topk-scaling-factor, and a small sequence-level
#     balancing loss (seq_aux_loss, logged as seq_load_balancing_loss);
#   - shared experts every token passes through (--moe-shared-expert-intermediate-size);
#   - dense first layers: --moe-layer-freq "([0]*K+[1]*(N-K))" (DENSE_LAYERS=K) makes the first
#     K layers plain SwiGLU MLPs of --ffn-hidden-size;
#   - multi-token prediction (--mtp-num-layers 1): one extra block predicts the token after the
#     next; its loss enters training times --mtp-loss-scaling-factor and is logged unscaled as
#     "mtp_1 loss";
#   - torch_dist checkpoints. Every size can be overridden from the environment (the comments
#     give DeepSeek-V3's); a tiny smoke run:
#
#   TRAIN_ITERS=10 NUM_LAYERS=2 HIDDEN_SIZE=64 SEQ_LENGTH=64 LOG_INTERVAL=1 \
#     bash examples/pretrain_deepseek_v3_cpu.sh /tmp/dsv3
#
# The world size NPROC (2) must be a multiple of TP x EP; EP=2 (default) deals the experts over
# the 2 ranks, which are also data-parallel 2 for the rest of the model; TP=2 EP=1 splits the
# layers instead (and adds --sequence-parallel, which Megatron requires with MoE); multi-token
# prediction is not built with sequence parallelism here, so TP > 1 needs MTP_NUM_LAYERS=0
# (which drops the MTP flags).
# Left out on CPU: --bf16, fp8 and the fused kernels of the recipe (BF16=1 adds --bf16).
#
# The corpus is this machine's Python standard library as JSONL (tools/build_stdlib_corpus.py);
# point CORPUS at your own JSONL with a "content" key to train on other text. Writes
# OUT_DIR/data/ (vocab.json, merges.txt, stdlib_content_document.{bin,idx}), OUT_DIR/train.log
# (appended to) and OUT_DIR/loss.png, and saves torch_dist checkpoints to OUT_DIR/checkpoints/;
# rerunning resumes from the last one. Extra arguments go to pretrain_gpt.py after the script's
# flags, so they override them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/deepseek_v3}"
[ $# -gt 0 ] && shift
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
TP="${TP:-1}"
EP="${EP:-2}"                             # NUM_EXPERTS % EP == 0
DEVICE="${DEVICE:-cpu}"
MAX_BYTES="${MAX_BYTES-3000000}"          # corpus size cap; empty = the whole standard library
NUM_LAYERS="${NUM_LAYERS:-4}"             # DeepSeek-V3: 61
DENSE_LAYERS="${DENSE_LAYERS:-1}"         # 3
HIDDEN_SIZE="${HIDDEN_SIZE:-128}"         # 7168
FFN_HIDDEN_SIZE="${FFN_HIDDEN_SIZE:-352}" # 18432 (the dense layers)
NUM_HEADS="${NUM_HEADS:-4}"               # 128
Q_LORA_RANK="${Q_LORA_RANK:-96}"          # 1536
KV_LORA_RANK="${KV_LORA_RANK:-64}"        # 512
QK_HEAD_DIM="${QK_HEAD_DIM:-32}"          # 128
QK_POS_EMB_HEAD_DIM="${QK_POS_EMB_HEAD_DIM:-16}"  # 64
V_HEAD_DIM="${V_HEAD_DIM:-32}"            # 128
ROTARY_SCALING_FACTOR="${ROTARY_SCALING_FACTOR:-4}"  # 40
ORIGINAL_MAX_POSITIONS="${ORIGINAL_MAX_POSITIONS:-64}"  # 4096
NUM_EXPERTS="${NUM_EXPERTS:-8}"           # 256
TOPK="${TOPK:-2}"                         # 8
NUM_GROUPS="${NUM_GROUPS:-4}"             # 8
GROUP_TOPK="${GROUP_TOPK:-2}"             # 4
TOPK_SCALING="${TOPK_SCALING:-2.5}"       # 2.5
BIAS_UPDATE_RATE="${BIAS_UPDATE_RATE:-1e-3}"   # 1e-3
AUX_LOSS_COEFF="${AUX_LOSS_COEFF:-1e-4}"  # 1e-4 (sequence-level)
MOE_FFN_HIDDEN_SIZE="${MOE_FFN_HIDDEN_SIZE:-64}"      # 2048
SHARED_EXPERT_SIZE="${SHARED_EXPERT_SIZE:-64}"        # 2048 (one shared expert)
MTP_NUM_LAYERS="${MTP_NUM_LAYERS:-1}"     # 1
MTP_LOSS_SCALING="${MTP_LOSS_SCALING:-0.1}"  # 0.1 (0.3 early in DeepSeek's run)
SEQ_LENGTH="${SEQ_LENGTH:-256}"           # 4096
MICRO_BATCH="${MICRO_BATCH:-2}"
GLOBAL_BATCH="${GLOBAL_BATCH:-8}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
LR="${LR:-1e-3}"                          # 2.2e-4
WARMUP_ITERS="${WARMUP_ITERS:-20}"
LOG_INTERVAL="${LOG_INTERVAL:-10}"
EVAL_INTERVAL="${EVAL_INTERVAL:-100}"
SAVE_INTERVAL="${SAVE_INTERVAL:-100}"
CORPUS="${CORPUS:-$OUT/stdlib.jsonl}"
if [ "$DENSE_LAYERS" -ge "$NUM_LAYERS" ]; then
  echo "DENSE_LAYERS=$DENSE_LAYERS must be below NUM_LAYERS=$NUM_LAYERS" >&2; exit 2
fi
if [ "$TP" -gt 1 ] && [ "$MTP_NUM_LAYERS" -gt 0 ]; then
  echo "TP=$TP needs MTP_NUM_LAYERS=0: multi-token prediction (--mtp-num-layers) is not built" \
    "with --sequence-parallel, which MoE needs at TP > 1" >&2; exit 2
fi
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
  --num-attention-heads "$NUM_HEADS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --untie-embeddings-and-output-weights --init-method-std 0.02
  --attention-dropout 0.0 --hidden-dropout 0.0
)
MLA_ARGS=(
  --multi-latent-attention --q-lora-rank "$Q_LORA_RANK" --kv-lora-rank "$KV_LORA_RANK"
  --qk-head-dim "$QK_HEAD_DIM" --qk-pos-emb-head-dim "$QK_POS_EMB_HEAD_DIM"
  --v-head-dim "$V_HEAD_DIM" --qk-layernorm
  --position-embedding-type rope --rotary-base 10000
  --rotary-scaling-factor "$ROTARY_SCALING_FACTOR" --mscale 1.0 --mscale-all-dim 1.0
  --yarn-original-max-position-embeddings "$ORIGINAL_MAX_POSITIONS"
)
MOE_ARGS=(
  --num-experts "$NUM_EXPERTS" --moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE"
  --moe-layer-freq "([0]*$DENSE_LAYERS+[1]*$((NUM_LAYERS - DENSE_LAYERS)))"
  --moe-shared-expert-intermediate-size "$SHARED_EXPERT_SIZE"
  --moe-router-topk "$TOPK" --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias --moe-router-bias-update-rate "$BIAS_UPDATE_RATE"
  --moe-router-num-groups "$NUM_GROUPS" --moe-router-group-topk "$GROUP_TOPK"
  --moe-router-topk-scaling-factor "$TOPK_SCALING" --moe-router-dtype fp32
  --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff "$AUX_LOSS_COEFF"
  --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
[ "$MTP_NUM_LAYERS" -gt 0 ] && MOE_ARGS+=(
  --mtp-num-layers "$MTP_NUM_LAYERS" --mtp-loss-scaling-factor "$MTP_LOSS_SCALING"
)
TRAIN_ARGS=(
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr "$LR" --min-lr 1e-5 --lr-decay-style cosine
  --lr-warmup-iters "$WARMUP_ITERS" --clip-grad 1.0 --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95
)
[ "${BF16:-0}" = 1 ] && TRAIN_ARGS+=(--bf16)
PARALLEL_ARGS=(
  --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP" --device "$DEVICE"
)
[ "$TP" -gt 1 ] && PARALLEL_ARGS+=(--sequence-parallel)   # Megatron requires it for MoE + TP
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
  "${MODEL_ARGS[@]}" "${MLA_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAIN_ARGS[@]}" \
  "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@" 2>&1 | tee -a "$OUT/train.log"
"$PY" tools/plot_loss.py --log "$OUT/train.log" --output "$OUT/loss.png"
