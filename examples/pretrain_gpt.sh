#!/usr/bin/env bash
# The classic GPT-2 (124M) recipe on code data, as in the CodeParrot example.
# Set the sizes below for your hardware; on GPUs NCCL is used automatically.
#
#   GPUS_PER_NODE=8 DATA=/data/codeparrot_content_document VOCAB=vocab.json MERGES=merges.txt \
#     bash examples/pretrain_gpt.sh
set -euo pipefail
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
DATA="${DATA:?set DATA to the .bin/.idx prefix}"
VOCAB="${VOCAB:?set VOCAB to vocab.json}"
MERGES="${MERGES:?set MERGES to merges.txt}"
CHECKPOINTS="${CHECKPOINTS:-checkpoints/gpt2_124m}"
TP="${TP:-1}"
PP="${PP:-1}"
NUM_LAYERS="${NUM_LAYERS:-12}"
HIDDEN="${HIDDEN:-768}"
HEADS="${HEADS:-12}"
SEQ="${SEQ:-1024}"
MICRO_BATCH="${MICRO_BATCH:-12}"
GLOBAL_BATCH="${GLOBAL_BATCH:-192}"
TRAIN_ITERS="${TRAIN_ITERS:-150000}"

torchrun --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" \
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
  --lr 0.0005 --train-iters "$TRAIN_ITERS" --lr-decay-iters "$TRAIN_ITERS" \
  --lr-decay-style cosine --lr-warmup-iters 2000 --min-lr 0.00005 \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0 --fp16 \
  --data-path "$DATA" --split 969,30,1 \
  --vocab-file "$VOCAB" --merge-file "$MERGES" --tokenizer-type GPT2BPETokenizer \
  --log-interval 10 --save-interval 2000 --eval-interval 200 --eval-iters 10 \
  --save "$CHECKPOINTS" --load "$CHECKPOINTS" --tensorboard-dir "$CHECKPOINTS/tensorboard"
