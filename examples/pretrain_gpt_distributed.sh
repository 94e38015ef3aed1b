#!/usr/bin/env bash
# The GPT-2 recipe across several nodes. Run this on every node with its own NODE_RANK;
# MASTER_ADDR is a host all nodes reach. torchrun does the rendezvous.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 DATA=... VOCAB=... MERGES=... \
#     bash examples/pretrain_gpt_distributed.sh
set -euo pipefail
NNODES="${NNODES:?set NNODES}"
NODE_RANK="${NODE_RANK:?set NODE_RANK}"
MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR}"
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
DATA="${DATA:?set DATA}"; VOCAB="${VOCAB:?set VOCAB}"; MERGES="${MERGES:?set MERGES}"
CHECKPOINTS="${CHECKPOINTS:-checkpoints/gpt2_distributed}"

torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" pretrain_gpt.py \
  --tensor-model-parallel-size "${TP:-2}" --sequence-parallel \
  --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
  --seq-length 1024 --max-position-embeddings 1024 \
  --micro-batch-size 4 --global-batch-size 256 \
  --lr 0.0003 --train-iters 300000 --lr-decay-style cosine --lr-warmup-fraction 0.01 \
  --min-lr 0.00003 --weight-decay 0.1 --clip-grad 1.0 --bf16 \
  --data-path "$DATA" --split 969,30,1 \
  --vocab-file "$VOCAB" --merge-file "$MERGES" --tokenizer-type GPT2BPETokenizer \
  --log-interval 10 --save-interval 2000 --eval-interval 1000 --eval-iters 10 \
  --save "$CHECKPOINTS" --load "$CHECKPOINTS" --tensorboard-dir "$CHECKPOINTS/tensorboard"
