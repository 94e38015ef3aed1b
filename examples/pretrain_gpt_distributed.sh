#!/usr/bin/env bash
# The GPT-2 (124M) recipe of examples/pretrain_gpt.sh on one or many nodes. Run the same command
# on every node, changing only NODE_RANK. Every node must see DATA, VOCAB, MERGES and CHECKPOINTS
# at the same paths (a shared file system): global rank 0 builds the data index cache beside DATA
# and the others read it; each checkpoint file is written by the rank that owns it.
#
# Two nodes with 8 GPUs each, node0 reachable from node1 as "node0":
#   export NNODES=2 MASTER_ADDR=node0 GPUS_PER_NODE=8 DATA=/shared/codeparrot_content_document \
#          VOCAB=/shared/vocab.json MERGES=/shared/merges.txt CHECKPOINTS=/shared/ckpt/gpt2_124m
#   node0$ NODE_RANK=0 bash examples/pretrain_gpt_distributed.sh
#   node1$ NODE_RANK=1 bash examples/pretrain_gpt_distributed.sh
#
# Host variables (Megatron's names):
#   NNODES         number of nodes (default 1)
#   NODE_RANK      this node's index, 0 .. NNODES-1 (default 0)
#   MASTER_ADDR    address of node 0 that every node reaches (default localhost: one node only)
#   MASTER_PORT    a free TCP port on node 0 (default 6000)
#   GPUS_PER_NODE  processes per node: one per GPU, or CPU processes without GPUs (default 8)
#   RDZV=c10d      use torchrun's c10d rendezvous (--rdzv_backend c10d --rdzv_endpoint
#                  MASTER_ADDR:MASTER_PORT, job name RDZV_ID) instead of the static
#                  --master_addr/--node_rank form; torchrun then numbers the nodes itself, and
#                  NODE_RANK, when given, only marks node 0 as the one hosting the rendezvous
#   SOCKET_IFNAME  the network interface that joins the nodes (eth0, ib0, ...): exported as
#                  GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME unless those are already set
#   LOCAL_ADDR     this node's own address on that network, for hosts whose name does not resolve
#                  to it (torchrun --local_addr; with RDZV=c10d node 0 announces it to every node)
#
# Recipe variables as in pretrain_gpt.sh (TP, PP, NUM_LAYERS, HIDDEN, HEADS, SEQ, MICRO_BATCH,
# GLOBAL_BATCH, TRAIN_ITERS), plus PRECISION (fp16, bf16 or fp32), TOKENIZER (GPT2BPETokenizer
# needs VOCAB and MERGES) and TENSORBOARD_DIR (empty: none). The global batch is fixed, so the
# same recipe trains the same model on any number of nodes. Extra arguments go to pretrain_gpt.py
# after the recipe's flags, so they override them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

NNODES="${NNODES:-1}"
NODE_RANK_GIVEN="${NODE_RANK:+yes}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-6000}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
RDZV="${RDZV:-static}"
RDZV_ID="${RDZV_ID:-megatron_gpt}"
if [[ "$NNODES" -gt 1 && ( "$MASTER_ADDR" == localhost || "$MASTER_ADDR" == 127.* ) ]]; then
  echo "NNODES=$NNODES but MASTER_ADDR=$MASTER_ADDR: set MASTER_ADDR to node 0's address," \
       "reachable from every node" >&2
  exit 2
fi
if [[ -n "${SOCKET_IFNAME:-}" ]]; then
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME}"
  export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}"
fi

case "$RDZV" in
  static)
    LAUNCH_ARGS=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE"
                 --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT") ;;
  c10d)
    LAUNCH_ARGS=(--nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --rdzv_backend c10d
                 --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID")
    if [[ -n "$NODE_RANK_GIVEN" ]]; then
      # Node 0 hosts the rendezvous store; saying so spares torchrun guessing it from host names.
      LAUNCH_ARGS+=(--rdzv_conf "is_host=$([[ "$NODE_RANK" == 0 ]] && echo 1 || echo 0)")
    fi ;;
  *)
    echo "RDZV must be static or c10d, got $RDZV" >&2
    exit 2 ;;
esac
if [[ -n "${LOCAL_ADDR:-}" ]]; then
  LAUNCH_ARGS+=(--local_addr "$LOCAL_ADDR")
fi

DATA="${DATA:?set DATA to the .bin/.idx prefix, on a file system every node sees}"
CHECKPOINTS="${CHECKPOINTS:-checkpoints/gpt2_124m}"
TENSORBOARD_DIR="${TENSORBOARD_DIR-$CHECKPOINTS/tensorboard}"
TOKENIZER="${TOKENIZER:-GPT2BPETokenizer}"
PRECISION="${PRECISION:-fp16}"
TP="${TP:-1}"
PP="${PP:-1}"
NUM_LAYERS="${NUM_LAYERS:-12}"
HIDDEN="${HIDDEN:-768}"
HEADS="${HEADS:-12}"
SEQ="${SEQ:-1024}"
MICRO_BATCH="${MICRO_BATCH:-12}"
GLOBAL_BATCH="${GLOBAL_BATCH:-192}"
TRAIN_ITERS="${TRAIN_ITERS:-150000}"

TOKENIZER_ARGS=(--tokenizer-type "$TOKENIZER")
if [[ "$TOKENIZER" == GPT2BPETokenizer ]]; then
  TOKENIZER_ARGS+=(--vocab-file "${VOCAB:?set VOCAB to vocab.json}"
                   --merge-file "${MERGES:?set MERGES to merges.txt}")
fi
case "$PRECISION" in
  fp16|bf16) PRECISION_ARGS=(--"$PRECISION") ;;
  fp32) PRECISION_ARGS=() ;;
  *) echo "PRECISION must be fp16, bf16 or fp32, got $PRECISION" >&2; exit 2 ;;
esac
OUTPUT_ARGS=(--save "$CHECKPOINTS" --load "$CHECKPOINTS")
if [[ -n "$TENSORBOARD_DIR" ]]; then
  OUTPUT_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
fi

exec torchrun "${LAUNCH_ARGS[@]}" "$ROOT/pretrain_gpt.py" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" \
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" \
  --lr 0.0005 --train-iters "$TRAIN_ITERS" --lr-decay-iters "$TRAIN_ITERS" \
  --lr-decay-style cosine --lr-warmup-iters 2000 --min-lr 0.00005 \
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.999 --clip-grad 1.0 "${PRECISION_ARGS[@]}" \
  --data-path "$DATA" --split 969,30,1 "${TOKENIZER_ARGS[@]}" \
  --log-interval 10 --save-interval 2000 --eval-interval 200 --eval-iters 10 \
  "${OUTPUT_ARGS[@]}" "$@"
