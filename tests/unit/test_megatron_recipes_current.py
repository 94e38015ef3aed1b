"""Megatron-LM's current functional-test and example launch configurations parse and validate
here at their world size.

Each recipe is the MODEL_ARGS of one of Megatron-LM's current test cases
(``tests/functional_tests/test_cases/{gpt,moe,moe2.0,mixtral,bert}``) or example scripts, every
flag kept as written (paths replaced by /data/... and /tmp/...; moe2.0 cases are the model config
plus the runtime config their name joins). They cover dense GPT, MoE and BERT over tensor,
sequence, pipeline (plain, interleaved, uneven), context, expert and fully sharded data
parallelism. Validation builds no model and creates no process group, so the sizes are the real
ones. A recipe is either accepted, or refused in one line naming the flag listed first with it,
for a reason the registry gives for what cannot run in this codebase (FP8 without
TransformerEngine, the flex token dispatcher); without its listed flags the rest is accepted.
"""

import pathlib

import pytest
import torch.distributed as dist

import pretrain_bert
from megatron.training import megatron_flags_table as table
from megatron.training.arguments import (UNSUPPORTED_FLAGS, ArgumentsError, build_parser,
                                         parse_args, validate_args, validate_bert_args)

# GPT 15B release run (test_cases/gpt/gpt3_15b_8t_release): TP 8 with sequence
# parallelism, distributed optimizer, sample-based batch-size ramp-up, squared ReLU, 50% rotary.
GPT3_15B_RELEASE = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 8
--pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-mcore-models --sequence-parallel --disable-bias-linear
--micro-batch-size 4 --rampup-batch-size 384 384 97656250 --global-batch-size 1152
--train-samples 19531250 --manual-gc --transformer-impl transformer_engine
--data-cache-path /tmp/cache --tokenizer-type GPTSentencePieceTokenizer
--tokenizer-model /data/nemotron_2_256k.model --data-path /data/blend_text_document
--split 99,1,0 --no-mmap-bin-files --num-workers 6 --apply-layernorm-1p
--untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion
--rotary-percent 0.5 --squared-relu --num-layers 32 --hidden-size 6144 --num-attention-heads 48
--group-query-attention --num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096
--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 4.5e-4 --min-lr 4.5e-5
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --adam-beta1 0.9
--adam-beta2 0.95 --eval-iters 32 --eval-interval 2000 --save /tmp/ckpt --load /tmp/ckpt
--save-interval 5000 --init-method-std 0.0134 --log-timers-to-tensorboard
--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
--log-validation-ppl-to-tensorboard --log-throughput --log-interval 100
--tensorboard-dir /tmp/tb --wandb-project megatron-core-release-runs --wandb-exp-name run
--bf16
"""

# GPT 7B memory/speed run (gpt/gpt3_7b_tp1_pp4_memory_speed): PP 4 interleaved one
# layer per virtual stage, GQA, mock data.
GPT3_7B_PP4_VPP = """
--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --untie-embeddings-and-output-weights --log-throughput --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 1 --global-batch-size 8 --seq-length 8192
--max-position-embeddings 8192 --train-iters 25 --timing-log-level 0 --lr-decay-iters 320000
--save /tmp/ckpt --load /tmp/ckpt --tokenizer-type NullTokenizer --vocab-size 131073
--mock-data --split 949,50,1 --distributed-backend nccl --lr 0.00015 --lr-decay-style cosine
--min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 2
--save-interval 10000 --eval-interval 1000 --eval-iters 5 --transformer-impl transformer_engine
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
--num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --deterministic-mode --no-gradient-accumulation-fusion
--use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all
--data-cache-path /tmp/cache --bf16 --log-memory-to-tensorboard --exit-interval 25 --async-save
--use-persistent-ckpt-worker
"""

# GPT 345M (gpt/gpt3_mcore_te_tp2_pp1_cp2_nondeterministic): TP 2 with sequence
# parallelism and context parallelism 2, flash attention, async torch_dist saves.
GPT_TP2_CP2 = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--save /tmp/ckpt --load /tmp/ckpt --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1
--distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 10
--transformer-impl transformer_engine --tensor-model-parallel-size 2
--pipeline-model-parallel-size 1 --context-parallel-size 2 --sequence-parallel
--hidden-dropout 0.0 --attention-dropout 0.0 --no-gradient-accumulation-fusion
--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist
--dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all --data-cache-path /tmp/cache
--bf16 --attention-backend flash --log-memory-to-tensorboard --async-save
--use-persistent-ckpt-worker
"""

# GPT (gpt/gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split):
# PP 4 x 2 virtual stages with the embedding and the loss counted as layers.
GPT_PP4_VP2_ACCOUNT_SPLIT = """
--num-layers 6 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--save /tmp/ckpt --load /tmp/ckpt --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1
--distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 10
--transformer-impl transformer_engine --tensor-model-parallel-size 1
--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2
--untie-embeddings-and-output-weights --deterministic-mode --no-gradient-accumulation-fusion
--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist
--dist-ckpt-strictness log_all --data-cache-path /tmp/cache --bf16
--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
--attention-backend unfused --log-memory-to-tensorboard
"""

# Dense GPT with multi-latent attention (gpt/gpt3_mcore_te_tp2_pp2_mla): TP 2, PP 2.
GPT_TP2_PP2_MLA = """
--num-layers 4 --hidden-size 512 --num-attention-heads 8 --multi-latent-attention
--q-lora-rank 192 --kv-lora-rank 64 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
--log-params-norm --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard
--log-timers-to-tensorboard --tensorboard-dir /tmp/tb --micro-batch-size 4
--global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters 50
--timing-log-level 0 --lr-decay-iters 320000 --save /tmp/ckpt --load /tmp/ckpt
--data-path /data/my-gpt3_00_text_document --vocab-file /data/vocab.json
--merge-file /data/merges.txt --split 949,50,1 --distributed-backend nccl --lr 0.00015
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --log-interval 1 --save-interval 25 --eval-interval 1000
--eval-iters 10 --transformer-impl transformer_engine --tensor-model-parallel-size 2
--pipeline-model-parallel-size 2 --sequence-parallel --untie-embeddings-and-output-weights
--deterministic-mode --no-gradient-accumulation-fusion --attention-softmax-in-fp32
--use-mcore-models --ckpt-format torch_dist --data-cache-path /tmp/cache --bf16
--attention-backend unfused --log-memory-to-tensorboard
"""

# GPT with muP (gpt/gpt3_mcore_te_tp1_pp1_mup): DP 8, distributed optimizer.
GPT_MUP = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--save /tmp/ckpt --load /tmp/ckpt --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1
--distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 10
--transformer-impl transformer_engine --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --use-distributed-optimizer --no-mmap-bin-files
--deterministic-mode --no-gradient-accumulation-fusion --attention-softmax-in-fp32
--use-mcore-models --ckpt-format torch_dist --dist-ckpt-strictness log_all
--data-cache-path /tmp/cache --bf16 --attention-backend unfused --log-memory-to-tensorboard
--use-mup --mup-base-hidden-size 256 --async-save --use-persistent-ckpt-worker
"""

# GPT on a fill-in-the-middle dataset (gpt/gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset).
GPT_FIM_DATASET = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--save /tmp/ckpt --load /tmp/ckpt --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1
--distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 10
--transformer-impl transformer_engine --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --use-distributed-optimizer --deterministic-mode
--no-gradient-accumulation-fusion --attention-softmax-in-fp32 --use-mcore-models
--ckpt-format torch_dist --dist-ckpt-strictness log_all --data-cache-path /tmp/cache --bf16
--attention-backend unfused --log-memory-to-tensorboard --fim-data --fim-rate 0.5
--fim-spm-rate 0.5 --async-save --use-persistent-ckpt-worker
"""

# GPT with uniform full recompute (gpt/gpt3_mcore_te_tp1_pp1_uniform_full_recompute).
GPT_FULL_RECOMPUTE = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--save /tmp/ckpt --load /tmp/ckpt --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1
--distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 10
--transformer-impl transformer_engine --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --recompute-granularity full --recompute-method uniform
--recompute-num-layers 1 --deterministic-mode --no-gradient-accumulation-fusion
--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist
--dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all --data-cache-path /tmp/cache
--bf16 --attention-backend unfused --log-memory-to-tensorboard --async-save
--use-persistent-ckpt-worker
"""

# GPT on PyTorch FSDP2 in fp16 (gpt/gpt3_345m_..._tp1_pp1_fsdp2_resume_torch_dist_te), without
# its --no-async-tensor-model-parallel-allreduce, which Megatron's parser no longer has.
GPT_TORCH_FSDP2_FP16 = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 100 --timing-log-level 2 --lr-decay-iters 320000
--save /tmp/ckpt --load /tmp/ckpt --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1
--distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
--save-interval 50 --eval-interval 1000 --eval-iters 10 --transformer-impl transformer_engine
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --use-torch-fsdp2
--deterministic-mode --no-gradient-accumulation-fusion --use-checkpoint-opt_param-scheduler
--use-mcore-models --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable
--dist-ckpt-strictness log_all --data-cache-path /tmp/cache --fp16
--apply-query-key-layer-scaling --log-memory-to-tensorboard
"""

# Llama-style 4B with result validation (gpt/gpt3_mcore_reruns_resume_check_grads,
# its context-parallel variant): CP 2 on 2 ranks, finetuning from a checkpoint.
GPT_RERUNS_CP2 = """
--rotary-base 500 --finetune --seed 1 --override-opt_param-scheduler --no-load-optim
--recompute-num-layers 1 --deterministic-mode --bf16 --train-iters 1 --eval-iters 0 --manual-gc
--use-mcore-models --distributed-backend nccl --sequence-parallel
--untie-embeddings-and-output-weights --position-embedding-type rope --rotary-percent 1.0
--max-position-embeddings 4096 --num-layers 32 --hidden-size 3072 --ffn-hidden-size 8192
--num-attention-heads 32 --num-query-groups 8 --seq-length 512 --kv-channels 128
--group-query-attention --normalization RMSNorm --swiglu --attention-dropout 0.0
--hidden-dropout 0.0 --no-create-attention-mask-in-dataloader
--transformer-impl transformer_engine --disable-bias-linear --clip-grad 1.0
--overlap-grad-reduce --overlap-param-gather --lr 3e-4 --lr-warmup-samples 0 --adam-beta1 0.0
--adam-beta2 0.0 --adam-eps 1e-8 --use-distributed-optimizer --split 949,50,1
--no-gradient-accumulation-fusion --save-interval 1 --eval-interval 1000
--ckpt-format torch_dist --dist-ckpt-strictness log_all --dist-ckpt-optim-fully-reshardable
--save /tmp/ckpt --load /tmp/ckpt --data-cache-path /tmp/cache
--data-path /data/my-gpt3_00_text_document --vocab-file /data/vocab.json
--merge-file /data/merges.txt --tensorboard-dir /tmp/tb --timing-log-level 0 --log-interval 1
--log-params-norm --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard
--log-timers-to-tensorboard --log-memory-to-tensorboard --rerun-mode validate_results
--micro-batch-size 2 --global-batch-size 2 --tensor-model-parallel-size 1
--context-parallel-size 2 --pipeline-model-parallel-size 1
"""

# The same run's tensor-parallel variant: TP 2 with sequence parallelism.
GPT_RERUNS_TP2 = """
--rotary-base 500 --finetune --seed 1 --override-opt_param-scheduler --no-load-optim
--recompute-num-layers 1 --deterministic-mode --bf16 --train-iters 1 --eval-iters 0 --manual-gc
--use-mcore-models --distributed-backend nccl --sequence-parallel
--untie-embeddings-and-output-weights --position-embedding-type rope --rotary-percent 1.0
--max-position-embeddings 4096 --num-layers 32 --hidden-size 3072 --ffn-hidden-size 8192
--num-attention-heads 32 --num-query-groups 8 --seq-length 512 --kv-channels 128
--group-query-attention --normalization RMSNorm --swiglu --attention-dropout 0.0
--hidden-dropout 0.0 --no-create-attention-mask-in-dataloader
--transformer-impl transformer_engine --disable-bias-linear --clip-grad 1.0
--overlap-grad-reduce --overlap-param-gather --lr 3e-4 --lr-warmup-samples 0 --adam-beta1 0.0
--adam-beta2 0.0 --adam-eps 1e-8 --use-distributed-optimizer --split 949,50,1
--no-gradient-accumulation-fusion --save-interval 1 --eval-interval 1000
--ckpt-format torch_dist --dist-ckpt-strictness log_all --dist-ckpt-optim-fully-reshardable
--save /tmp/ckpt --load /tmp/ckpt --data-cache-path /tmp/cache
--data-path /data/my-gpt3_00_text_document --vocab-file /data/vocab.json
--merge-file /data/merges.txt --tensorboard-dir /tmp/tb --timing-log-level 0 --log-interval 1
--log-params-norm --log-num-zeros-in-grad --log-validation-ppl-to-tensorboard
--log-timers-to-tensorboard --log-memory-to-tensorboard --rerun-mode validate_results
--micro-batch-size 2 --global-batch-size 2 --tensor-model-parallel-size 2
--context-parallel-size 1 --pipeline-model-parallel-size 1
"""

# gpt-oss 120B (examples/post_training/modelopt/conf/openai/gpt-oss-120b.sh MODEL_ARGS,
# without that tool's own --enable-gpt-oss / --export-force-local-attention): learnable
# softmax offset, sliding window on every other layer, quick GeGLU with clamp, 128 experts;
# with a training schedule, mock data and EP 8 added (the conf leaves them to the caller).
GPT_OSS_120B = """
--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion
--untie-embeddings-and-output-weights --no-rope-fusion --normalization RMSNorm --num-layers 36
--hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 --group-query-attention
--num-query-groups 8 --kv-channels 64 --num-experts 128 --moe-ffn-hidden-size 2880
--moe-router-dtype fp32 --moe-router-topk 4 --moe-aux-loss-coeff 0.0
--moe-token-dispatcher-type alltoall --moe-router-score-function softmax
--moe-router-load-balancing-type aux_loss --seq-length 4096 --max-position-embeddings 40960
--tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 128 --use-mcore-models
--rotary-percent 1.0 --rotary-base 150000 --no-bias-gelu-fusion --sequence-parallel
--no-bias-dropout-fusion --padded-vocab-size 201088 --quick-geglu --glu-linear-offset 1.0
--softmax-type learnable --window-attn-skip-freq 2 --activation-func-clamp-value 7.0
--window-size 128,0 --tokenizer-model /data/gpt-oss-120b --tensor-model-parallel-size 1
--expert-model-parallel-size 8 --global-batch-size 64 --train-iters 1000 --lr 1.0e-5
--mock-data
"""

# MoE with the distributed Muon optimizer (moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon):
# EP 8, allgather dispatcher.
MOE_EP8_DIST_MUON = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --disable-bias-linear --train-iters 100 --timing-log-level 0
--lr-decay-iters 320000 --save /tmp/ckpt --load /tmp/ckpt
--data-path /data/my-gpt3_00_text_document --vocab-file /data/vocab.json
--merge-file /data/merges.txt --split 949,50,1 --distributed-backend nccl --lr 0.00015
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --log-interval 1 --save-interval 50 --eval-interval 1000
--eval-iters 10 --transformer-impl transformer_engine --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --expert-model-parallel-size 8 --num-experts 8
--moe-token-dispatcher-type allgather --moe-router-load-balancing-type aux_loss
--moe-router-topk 2 --moe-router-dtype fp32 --moe-ffn-hidden-size 1024 --moe-grouped-gemm
--ckpt-fully-parallel-load --deterministic-mode --no-gradient-accumulation-fusion
--attention-softmax-in-fp32 --use-checkpoint-opt_param-scheduler --use-mcore-models
--ckpt-format torch_dist --ckpt-assume-constant-structure --data-cache-path /tmp/cache --bf16
--no-bias-gelu-fusion --log-memory-to-tensorboard --optimizer dist_muon --muon-momentum 0.9
--muon-extra-scale-factor 0.2 --muon-scale-mode spectral
"""

# MoE with a shared expert
# (moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_resume_torch_dist_dist_optimizer):
# TP 4, PP 2, EP 2, expert TP 2.
MOE_TP4_EP2_ETP2_PP2 = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --disable-bias-linear --train-iters 100 --timing-log-level 0
--lr-decay-iters 320000 --save /tmp/ckpt --load /tmp/ckpt
--data-path /data/my-gpt3_00_text_document --vocab-file /data/vocab.json
--merge-file /data/merges.txt --split 949,50,1 --distributed-backend nccl --lr 0.00015
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --log-interval 1 --save-interval 50 --eval-interval 1000
--eval-iters 10 --transformer-impl transformer_engine --tensor-model-parallel-size 4
--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --expert-tensor-parallel-size 2
--sequence-parallel --num-experts 8 --use-distributed-optimizer
--moe-token-dispatcher-type alltoall --moe-router-load-balancing-type aux_loss
--moe-router-topk 2 --moe-router-dtype fp32 --moe-ffn-hidden-size 1024
--moe-shared-expert-intermediate-size 512 --moe-grouped-gemm --ckpt-fully-parallel-load
--deterministic-mode --no-gradient-accumulation-fusion --attention-softmax-in-fp32
--use-checkpoint-opt_param-scheduler --use-mcore-models --ckpt-format torch_dist
--ckpt-assume-constant-structure --data-cache-path /tmp/cache --bf16 --no-bias-gelu-fusion
--log-memory-to-tensorboard --async-save --use-persistent-ckpt-worker
"""

# MoE with EP communication overlap (moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4;
# upstream's --distributed-backend nccl2 is a value Megatron's parser itself rejects: nccl here).
MOE_TP2_EP4_A2A_OVERLAP = """
--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--tensorboard-dir /tmp/tb --micro-batch-size 4 --global-batch-size 32 --seq-length 1024
--max-position-embeddings 1024 --train-iters 50 --timing-log-level 0 --lr-decay-iters 320000
--save /tmp/ckpt --load /tmp/ckpt --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1
--distributed-backend nccl --lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 --log-interval 1
--save-interval 10000 --eval-interval 1000 --eval-iters 10
--transformer-impl transformer_engine --tensor-model-parallel-size 2
--pipeline-model-parallel-size 1 --expert-model-parallel-size 4 --expert-tensor-parallel-size 1
--disable-bias-linear --sequence-parallel --num-experts 8
--moe-router-load-balancing-type aux_loss --moe-router-topk 2 --moe-aux-loss-coeff 1e-2
--deterministic-mode --no-gradient-accumulation-fusion --moe-grouped-gemm
--moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm
--attention-softmax-in-fp32 --use-mcore-models --ckpt-format torch_dist
--dist-ckpt-strictness log_all --data-cache-path /tmp/cache --bf16 --attention-backend unfused
--no-bias-gelu-fusion --log-memory-to-tensorboard --exit-interval 50 --async-save
--use-persistent-ckpt-worker
"""

# DeepSeek-style MoE (moe/gpt3_mcore_te_tp1_pp1_ep8_etp1_cp_memory_speed): MLA, MTP, 72
# experts with grouped top-k sigmoid routing and a capacity factor, EP 8.
MOE_EP8_MLA_MTP = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --expert-model-parallel-size 8 --context-parallel-size 1
--expert-tensor-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn
--disable-bias-linear --micro-batch-size 1 --global-batch-size 128 --train-iters 25
--exit-duration-in-mins 230 --no-save-optim --no-check-for-nan-in-loss-and-grad
--no-rope-fusion --cross-entropy-loss-fusion --cross-entropy-fusion-impl te --manual-gc
--manual-gc-interval 5 --transformer-impl transformer_engine --seq-length 4096
--data-cache-path /tmp/cache --tokenizer-type NullTokenizer --mock-data --split 99,1,0
--num-layers 16 --hidden-size 2560 --ffn-hidden-size 12288 --num-attention-heads 32
--kv-channels 128 --max-position-embeddings 4096 --position-embedding-type rope
--rotary-base 10000 --make-vocab-size-divisible-by 3232 --vocab-size 131072
--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
--multi-latent-attention --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm
--lr-decay-iters 584765624 --lr-warmup-iters 1536000 --lr-warmup-init 6.1e-9 --lr 6.1e-8
--min-lr 6.1e-9 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 72
--moe-layer-freq ([0]*1+[1]*15) --moe-ffn-hidden-size 1536
--moe-shared-expert-intermediate-size 3072 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk 8 --moe-token-dispatcher-type alltoall --moe-router-pre-softmax
--moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4
--moe-router-num-groups 8 --moe-router-topk-scaling-factor 2.0
--moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
--moe-expert-capacity-factor 1.0 --overlap-moe-expert-parallel-comm --q-lora-rank 1536
--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --eval-iters 32
--eval-interval 200 --save /tmp/ckpt --load /tmp/ckpt --save-interval 500
--dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard
--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
--log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40
--tensorboard-dir /tmp/tb --bf16
"""

# DeepSeek proxy on Megatron-FSDP (moe/deepseek_proxy_fsdp_ep2_fsdp2): 3 dense + 5 MoE layers,
# MLA, EP 2, optim_grads_params sharding, fsdp_dtensor checkpoints, FP8 (4 ranks).
MOE_MFSDP_EP2 = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --expert-model-parallel-size 2 --context-parallel-size 1
--expert-tensor-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --attention-backend unfused --num-distributed-optimizer-instances 1
--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params
--outer-dp-sharding-strategy no_shard --deterministic-mode --ckpt-format fsdp_dtensor
--no-gradient-accumulation-fusion
--fp8-format e4m3
--fp8-recipe tensorwise
--fp8-param-gather
--use-mcore-models --sequence-parallel --disable-bias-linear --micro-batch-size 32
--global-batch-size 128 --train-iters 50 --exit-duration-in-mins 60
--no-check-for-nan-in-loss-and-grad --no-rope-fusion --manual-gc --manual-gc-interval 100
--transformer-impl transformer_engine --seq-length 1024 --data-cache-path /tmp/cache
--data-path /data/my-gpt3_00_text_document --vocab-file /data/vocab.json
--merge-file /data/merges.txt --split 949,50,1 --num-layers 8 --hidden-size 512
--ffn-hidden-size 2048 --num-attention-heads 8 --kv-channels 128 --max-position-embeddings 1024
--position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 64
--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights
--multi-latent-attention --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0
--weight-decay 0.1 --qk-layernorm --lr-warmup-fraction .01 --lr 0.00015 --min-lr 1.0e-5
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 8
--moe-layer-freq ([0]*3+[1]*5) --moe-ffn-hidden-size 1024
--moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk 4 --moe-token-dispatcher-type alltoall --moe-router-pre-softmax
--moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2
--moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.0
--moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion
--q-lora-rank 256 --kv-lora-rank 128 --qk-head-dim 128 --qk-pos-emb-head-dim 64
--v-head-dim 128 --rotary-scaling-factor 1.0 --mscale 1.0 --mscale-all-dim 1.0 --eval-iters 10
--eval-interval 200 --save-interval 25 --init-method-std 0.02 --log-timers-to-tensorboard
--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
--log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 10
--tensorboard-dir /tmp/tb --exit-interval 50
"""

# Mixtral 8x22B release run (mixtral/mixtral_8x22b_tp2pp8ep8vpp1_release): TP 2, PP 8, EP 8.
MIXTRAL_8X22B = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 2
--pipeline-model-parallel-size 8 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn
--disable-bias-linear --micro-batch-size 1 --global-batch-size 256 --train-samples 38400
--exit-duration-in-mins 230 --transformer-impl transformer_engine --data-cache-path /tmp/cache
--tokenizer-type Llama2Tokenizer --tokenizer-model /data/tokenizer.model
--data-path /data/blend_text_document --split 99,1,0 --no-mmap-bin-files --num-workers 6
--untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion
--rotary-percent 1.0 --normalization RMSNorm --swiglu --num-layers 56 --hidden-size 6144
--ffn-hidden-size 16384 --num-attention-heads 48 --group-query-attention --num-query-groups 8
--seq-length 4096 --max-position-embeddings 4096 --make-vocab-size-divisible-by 128
--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1
--lr-decay-samples 255126953 --lr-warmup-samples 162761 --lr 1.2e-5 --min-lr 1.2e-6
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --expert-model-parallel-size 8
--num-experts 8 --moe-router-load-balancing-type aux_loss --moe-router-topk 2
--moe-grouped-gemm --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall
--eval-iters 32 --eval-interval 500 --finetune --auto-detect-ckpt-format --load /tmp/ckpt
--save /tmp/ckpt --no-ckpt-fully-parallel-save --save-interval 500 --init-method-std 0.008
--log-timers-to-tensorboard --log-memory-to-tensorboard --log-num-zeros-in-grad
--log-params-norm --log-validation-ppl-to-tensorboard --log-throughput --log-interval 1
--tensorboard-dir /tmp/tb --wandb-project megatron-core-release-runs --wandb-exp-name run
--bf16
"""

# Qwen3-style MoE (moe2.0: model_configs/qwen3_proxy + runtime_configs/tp2pp2ep4_cp2): QK norm,
# global aux loss, shared expert; TP 2, PP 2, CP 2, EP 2.
QWEN3_MOE_CP2 = """
--seq-length 4096 --data-cache-path /tmp/cache --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1 --num-layers 16
--hidden-size 1024 --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear
--max-position-embeddings 4096 --make-vocab-size-divisible-by 3232
--untie-embeddings-and-output-weights --num-attention-heads 16 --group-query-attention
--num-query-groups 4 --kv-channels 128 --qk-layernorm --position-embedding-type rope
--rotary-percent 1.0 --rotary-base 1000000 --swiglu --ffn-hidden-size 4096 --num-experts 32
--moe-ffn-hidden-size 1024 --moe-shared-expert-intermediate-size 1024
--moe-router-load-balancing-type global_aux_loss --moe-router-topk 4 --moe-aux-loss-coeff 1e-4
--moe-router-score-function softmax --moe-router-dtype fp32 --attention-dropout 0.0
--hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --lr-warmup-fraction .01 --lr 0.00015
--min-lr 1.0e-5 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --eval-iters 32
--eval-interval 200 --init-method-std 0.02 --global-batch-size 32 --train-iters 100
--save-interval 50 --no-check-for-nan-in-loss-and-grad --deterministic-mode
--transformer-impl transformer_engine --distributed-timeout-minutes 60
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2
--context-parallel-size 2 --expert-tensor-parallel-size 1 --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --use-mcore-models --sequence-parallel
--micro-batch-size 4 --moe-grouped-gemm --moe-token-dispatcher-type alltoall --bf16
--moe-permute-fusion --moe-router-fusion --manual-gc --manual-gc-interval 100
"""

# Qwen3-style MoE with Muon (moe2.0: qwen3_proxy + tp2pp1ep8_muon): TP 2, EP 8.
QWEN3_MOE_MUON = """
--seq-length 4096 --data-cache-path /tmp/cache --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1 --num-layers 16
--hidden-size 1024 --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear
--max-position-embeddings 4096 --make-vocab-size-divisible-by 3232
--untie-embeddings-and-output-weights --num-attention-heads 16 --group-query-attention
--num-query-groups 4 --kv-channels 128 --qk-layernorm --position-embedding-type rope
--rotary-percent 1.0 --rotary-base 1000000 --swiglu --ffn-hidden-size 4096 --num-experts 32
--moe-ffn-hidden-size 1024 --moe-shared-expert-intermediate-size 1024
--moe-router-load-balancing-type global_aux_loss --moe-router-topk 4 --moe-aux-loss-coeff 1e-4
--moe-router-score-function softmax --moe-router-dtype fp32 --attention-dropout 0.0
--hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --lr-warmup-fraction .01 --lr 0.00015
--min-lr 1.0e-5 --lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --eval-iters 32
--eval-interval 200 --init-method-std 0.02 --global-batch-size 32 --train-iters 100
--save-interval 50 --no-check-for-nan-in-loss-and-grad --deterministic-mode
--transformer-impl transformer_engine --distributed-timeout-minutes 60
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
--context-parallel-size 1 --expert-tensor-parallel-size 1 --use-mcore-models
--sequence-parallel --micro-batch-size 4 --moe-grouped-gemm
--moe-token-dispatcher-type allgather --optimizer muon --muon-momentum 0.9
--muon-extra-scale-factor 0.2 --muon-scale-mode spectral --use-checkpoint-opt_param-scheduler
--bf16 --manual-gc --manual-gc-interval 100
"""

# Qwen3-Next-style MoE (moe2.0: qwen3next_proxy + tp2pp2ep4): gated delta net every third
# layer; TP 2, PP 2 x 4 virtual stages, EP 4, DeepEP dispatcher.
QWEN3_NEXT_FLEX = """
--seq-length 4096 --data-cache-path /tmp/cache --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1 --num-layers 16
--hidden-size 1024 --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear
--max-position-embeddings 4096 --make-vocab-size-divisible-by 3232
--untie-embeddings-and-output-weights --num-attention-heads 16 --group-query-attention
--num-query-groups 4 --kv-channels 128 --qk-layernorm --position-embedding-type rope
--rotary-percent 1.0 --rotary-base 1000000 --experimental-attention-variant gated_delta_net
--linear-attention-freq 3 --linear-conv-kernel-dim 4 --linear-key-head-dim 128
--linear-value-head-dim 128 --linear-num-key-heads 16 --linear-num-value-heads 32 --swiglu
--ffn-hidden-size 4096 --num-experts 32 --moe-ffn-hidden-size 1024
--moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type global_aux_loss
--moe-router-topk 4 --moe-aux-loss-coeff 1e-4 --moe-router-score-function softmax
--moe-router-dtype fp32 --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0
--weight-decay 0.1 --lr-warmup-fraction .01 --lr 0.00015 --min-lr 1.0e-5
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --eval-iters 32 --eval-interval 200
--init-method-std 0.02 --global-batch-size 32 --train-iters 100 --save-interval 50
--no-check-for-nan-in-loss-and-grad --deterministic-mode --transformer-impl transformer_engine
--distributed-timeout-minutes 60 --tensor-model-parallel-size 2
--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 4
--expert-model-parallel-size 4 --context-parallel-size 1 --expert-tensor-parallel-size 1
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --use-mcore-models
--sequence-parallel --micro-batch-size 4 --moe-grouped-gemm
--moe-token-dispatcher-type flex
--moe-flex-dispatcher-backend deepep
--bf16 --moe-permute-fusion --moe-router-fusion --manual-gc --manual-gc-interval 100
"""

# DeepSeek-V3 proxy (moe2.0: dsv3_proxy + tp1pp1ep8): MLA, MTP, one dense layer, EP 8.
DSV3_PROXY_EP8 = """
--seq-length 4096 --data-cache-path /tmp/cache --data-path /data/my-gpt3_00_text_document
--vocab-file /data/vocab.json --merge-file /data/merges.txt --split 949,50,1 --num-layers 16
--hidden-size 1024 --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear
--max-position-embeddings 4096 --make-vocab-size-divisible-by 3232
--untie-embeddings-and-output-weights --multi-latent-attention --num-attention-heads 32
--kv-channels 128 --position-embedding-type rope --rotary-base 10000 --q-lora-rank 1536
--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --swiglu --ffn-hidden-size 4096
--num-experts 32 --moe-layer-freq ([0]*1+[1]*15) --moe-ffn-hidden-size 1024
--moe-shared-expert-intermediate-size 1024 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk 4 --moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
--moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.0
--moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --mtp-num-layers 1
--mtp-loss-scaling-factor 0.1 --attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0
--weight-decay 0.1 --qk-layernorm --lr-warmup-fraction .01 --lr 0.00015 --min-lr 1.0e-5
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --eval-iters 32 --eval-interval 200
--init-method-std 0.02 --global-batch-size 32 --train-iters 50 --exit-duration-in-mins 230
--no-check-for-nan-in-loss-and-grad --transformer-impl transformer_engine
--distributed-timeout-minutes 60 --tensor-model-parallel-size 1
--pipeline-model-parallel-size 1 --expert-model-parallel-size 8 --context-parallel-size 1
--expert-tensor-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-mcore-models --sequence-parallel --micro-batch-size 4
--moe-token-dispatcher-type alltoall --bf16 --manual-gc --manual-gc-interval 100
"""

# BERT 340M release run (bert/bert_release): TP 8, PP 8, fp16, no binary head.
BERT_RELEASE = """
--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
--max-position-embeddings 512 --micro-batch-size 4 --global-batch-size 32 --train-iters 20000
--weight-decay 1e-2 --clip-grad 1.0 --fp16 --lr 0.0001 --lr-decay-style linear --min-lr 1.0e-5
--lr-warmup-fraction .01 --bert-no-binary-head --tensor-model-parallel-size 8
--pipeline-model-parallel-size 8 --data-path /data/blend_text_document
--vocab-file /data/vocab.txt --split 949,50,1 --data-cache-path /tmp/cache --log-interval 100
--save-interval 2000 --save-retain-interval 10000 --eval-interval 1000 --save /tmp/ckpt
--load /tmp/ckpt --eval-iters 10 --tensorboard-dir /tmp/tb --log-timers-to-tensorboard
--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm
--log-validation-ppl-to-tensorboard --wandb-project megatron-core-release-runs
--wandb-entity adlr --wandb-exp-name run --attention-backend unfused --exit-interval 20000
--wandb-save-dir /tmp/wandb
"""

# BERT (bert/bert_mcore_tp1_pp4_vp2): PP 4 x 2 virtual stages, bf16, torch checkpoints.
BERT_PP4_VP2 = """
--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --log-params-norm
--log-num-zeros-in-grad --log-validation-ppl-to-tensorboard --log-timers-to-tensorboard
--log-memory-to-tensorboard --tensorboard-dir /tmp/tb --micro-batch-size 4
--global-batch-size 128 --seq-length 512 --max-position-embeddings 512 --train-iters 50
--timing-log-level 0 --lr-decay-iters 990000 --save /tmp/ckpt --load /tmp/ckpt
--data-path /data/my-bert_00_text_sentence --vocab-file /data/vocab.txt --split 949,50,1
--distributed-backend nccl --lr 0.0001 --min-lr 0.00001 --lr-warmup-fraction 0.01
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
--num-layers-per-virtual-pipeline-stage 2 --deterministic-mode
--no-gradient-accumulation-fusion --data-cache-path /tmp/cache --bf16 --ckpt-format torch
--attention-backend unfused
"""

# Reasons a current Megatron recipe may be refused for: what cannot run in this codebase.
ALLOWED_REASONS = (table.FP8, table.FLEX)

# name -> (recipe, world size, the flags it is refused on (the first one names the refusal),
#          pretrain_bert's flags?)
RECIPES = {
    "gpt3_15b_release": (GPT3_15B_RELEASE, 64, (), False),
    "gpt3_7b_pp4_vpp": (GPT3_7B_PP4_VPP, 8, (), False),
    "gpt_tp2_cp2": (GPT_TP2_CP2, 8, (), False),
    "gpt_pp4_vp2_account_split": (GPT_PP4_VP2_ACCOUNT_SPLIT, 8, (), False),
    "gpt_tp2_pp2_mla": (GPT_TP2_PP2_MLA, 8, (), False),
    "gpt_mup": (GPT_MUP, 8, (), False),
    "gpt_fim_dataset": (GPT_FIM_DATASET, 8, (), False),
    "gpt_full_recompute": (GPT_FULL_RECOMPUTE, 8, (), False),
    "gpt_torch_fsdp2_fp16": (GPT_TORCH_FSDP2_FP16, 8, (), False),
    "gpt_reruns_cp2": (GPT_RERUNS_CP2, 2, (), False),
    "gpt_reruns_tp2": (GPT_RERUNS_TP2, 2, (), False),
    "gpt_oss_120b": (GPT_OSS_120B, 8, (), False),
    "moe_ep8_dist_muon": (MOE_EP8_DIST_MUON, 8, (), False),
    "moe_tp4_ep2_etp2_pp2": (MOE_TP4_EP2_ETP2_PP2, 8, (), False),
    "moe_tp2_ep4_a2a_overlap": (MOE_TP2_EP4_A2A_OVERLAP, 8, (), False),
    "moe_ep8_mla_mtp": (MOE_EP8_MLA_MTP, 8, (), False),
    "moe_mfsdp_ep2": (MOE_MFSDP_EP2, 4, ("--fp8-format", "--fp8-recipe", "--fp8-param-gather"),
                      False),
    "mixtral_8x22b": (MIXTRAL_8X22B, 128, (), False),
    "qwen3_moe_cp2": (QWEN3_MOE_CP2, 8, (), False),
    "qwen3_moe_muon": (QWEN3_MOE_MUON, 8, (), False),
    "qwen3_next_flex": (QWEN3_NEXT_FLEX, 8,
                        ("--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend"), False),
    "dsv3_proxy_ep8": (DSV3_PROXY_EP8, 8, (), False),
    "bert_release": (BERT_RELEASE, 64, (), True),
    "bert_pp4_vp2": (BERT_PP4_VP2, 8, (), True),
}


def _lines(recipe):
    return [line.split() for line in recipe.strip().splitlines()]


def _validate(words, world_size, bert):
    args = parse_args(pretrain_bert.extra_args_provider if bert else None, argv=words)
    args.world_size = world_size
    args = validate_args(args)
    if bert:
        validate_bert_args(args)
    return args


def _check_layout(args, world_size):
    assert args.data_parallel_size * args.tensor_model_parallel_size * (
        args.pipeline_model_parallel_size * args.context_parallel_size) == world_size


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_current_recipe_is_accepted_or_refused_in_one_line_for_its_flag(name):
    recipe, world_size, refused, bert = RECIPES[name]
    words = [w for line in _lines(recipe) for w in line]
    if not refused:
        _check_layout(_validate(words, world_size, bert), world_size)
        return
    with pytest.raises(ArgumentsError) as err:
        _validate(words, world_size, bert)
    message = str(err.value)
    assert "\n" not in message and message.split()[0] == refused[0], message
    assert "not supported" in message
    assert any(message.endswith(reason) for reason in ALLOWED_REASONS), message
    assert not dist.is_initialized()


@pytest.mark.parametrize("name", sorted(name for name, r in RECIPES.items() if r[2]))
def test_current_recipe_without_its_refused_flags_is_accepted(name):
    recipe, world_size, refused, bert = RECIPES[name]
    kept = [line for line in _lines(recipe) if line[0] not in refused]
    assert len(kept) == len(_lines(recipe)) - len(refused)
    _check_layout(_validate([w for line in kept for w in line], world_size, bert), world_size)


def test_refused_flags_are_refused_for_an_allowed_reason_in_the_registry():
    """Each flag a recipe is refused on is a registry row (or a refused choice) whose reason
    is one of ALLOWED_REASONS."""
    names = {s: a for a in build_parser()._actions for s in a.option_strings}
    for recipe, _, refused, _ in RECIPES.values():
        for line in _lines(recipe):
            if line[0] not in refused:
                continue
            action = names[line[0]]
            choice_reasons = getattr(action, "refused_choices", {})
            reason = UNSUPPORTED_FLAGS.get(action.dest) or choice_reasons.get(line[1])
            assert reason in ALLOWED_REASONS, line


def test_every_recipe_flag_is_one_of_megatrons():
    """The recipes use only option strings of Megatron-LM's current parser (the record in
    tests/data/megatron_lm_flags.tsv): no stale or misspelt flag."""
    record = pathlib.Path(__file__).resolve().parents[1] / "data" / "megatron_lm_flags.tsv"
    megatron = {option for row in record.read_text().splitlines()
                if row and not row.startswith("#") for option in row.split("\t")[0].split()}
    for recipe, _, _, _ in RECIPES.values():
        for line in _lines(recipe):
            assert line[0] in megatron, line[0]
            assert all(w in megatron for w in line[1:] if w.startswith("--")), line
