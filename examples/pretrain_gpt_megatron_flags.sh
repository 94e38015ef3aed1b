#!/usr/bin/env bash
# A small GPT on CPU (TP=2 over 2 processes, gloo) with Megatron's numerics flags:
# zero-centred LayerNorm weights (--apply-layernorm-1p), squared-ReLU MLP, interleaved rotary
# embeddings with a custom base and position interpolation, xavier-uniform initialisation,
# query/key layer norms, query-key layer scaling and an own learning rate for the embedding and
# output layer (--decoupled-lr).
#
#   bash examples/pretrain_gpt_megatron_flags.sh OUT_DIR
#
# Data: OUT_DIR/data/stdlib_content_document.{bin,idx} with OUT_DIR/data/{vocab.json,merges.txt}
# when present (examples/quickstart_cpu.sh makes them); else DATA_PREFIX (a .bin/.idx prefix of
# token ids below VOCAB_SIZE, read with the NullTokenizer) when set; else --mock-data.
# Writes OUT_DIR/train.log (every run appends to it) and OUT_DIR/checkpoints/; rerunning resumes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:?usage: pretrain_gpt_megatron_flags.sh OUT_DIR}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NPROC="${NPROC:-2}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
VOCAB_SIZE="${VOCAB_SIZE:-1024}"

GPT_ARGS=(
  --num-layers 2 --hidden-size 64 --num-attention-heads 4
  --seq-length 64 --max-position-embeddings 64
  --micro-batch-size 4 --global-batch-size 8
  --lr 1e-3 --min-lr 1e-4 --decoupled-lr 3e-3 --decoupled-min-lr 3e-4
  --train-iters "$TRAIN_ITERS" --lr-decay-style cosine --lr-warmup-iters 5
  --weight-decay 0.1 --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
  --untie-embeddings-and-output-weights
)
NUMERICS_ARGS=(
  --apply-layernorm-1p --squared-relu --init-method-xavier-uniform --qk-layernorm
  --position-embedding-type rope --rotary-interleaved --rotary-base 500
  --rotary-seq-len-interpolation-factor 2
  --apply-query-key-layer-scaling --attention-softmax-in-fp32
)
PARALLEL_ARGS=(--tensor-model-parallel-size "$NPROC" --device cpu)
if [[ -f "$OUT/data/stdlib_content_document.bin" ]]; then
  DATA_ARGS=(
    --data-path "$OUT/data/stdlib_content_document" --split 969,30,1
    --vocab-file "$OUT/data/vocab.json" --merge-file "$OUT/data/merges.txt"
    --tokenizer-type GPT2BPETokenizer --num-workers 1
  )
elif [[ -n "${DATA_PREFIX:-}" ]]; then
  DATA_ARGS=(--data-path "$DATA_PREFIX" --split 90,8,2 --tokenizer-type NullTokenizer
             --vocab-size "$VOCAB_SIZE" --num-workers 0)
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE"
             --num-workers 0)
fi
OUTPUT_ARGS=(
  --log-interval 5 --eval-interval 100 --eval-iters 2
  --save-interval 100 --save "$OUT/checkpoints" --load "$OUT/checkpoints"
)

mkdir -p "$OUT"
cd "$ROOT"
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  pretrain_gpt.py "${GPT_ARGS[@]}" "${NUMERICS_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
  "${OUTPUT_ARGS[@]}" 2>&1 | tee -a "$OUT/train.log"
