"""Current Megatron-LM launch configurations parse and validate here at their world size.

The configurations follow Megatron-LM's published recipes (examples/llama, examples/mixtral,
examples/gpt3, examples/bert and the DeepSeek-V3 MoE recipe), every flag kept, with parallel
layouts varied between them. Validation builds no model, so the sizes are the real ones. Each
recipe is either accepted, or refused in one line naming one of the flags listed with it,
all of which are refused for a documented reason (FP8, features not built yet); without those
flags the rest of the recipe is accepted.
"""

import pytest
import torch.distributed as dist

import pretrain_bert
from megatron.training.arguments import (UNSUPPORTED_FLAGS, ArgumentsError, build_parser,
                                         parse_args, validate_args, validate_bert_args)

# Llama-3 8B (examples/llama/train_llama3_8b_h100_fp8.sh) with mock data: TP 1, DP 8.
LLAMA3_8B = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
--rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
--grad-reduce-in-bf16
--cross-entropy-loss-fusion
--calculate-per-token-loss
--manual-gc --empty-unused-memory-level 1 --exit-duration-in-mins 235
--fp8-format hybrid
--fp8-amax-history-len 1024
--fp8-amax-compute-algo max
--fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path /tmp/cache
--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader
--no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
--profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist
--distributed-timeout-minutes 60 --save /tmp/ckpt --load /tmp/ckpt --tensorboard-dir /tmp/tb
"""

# Llama-3 70B: TP 8 with sequence parallelism, PP 4 interleaved, CP 2, distributed optimizer.
LLAMA3_70B = """
--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
--group-query-attention --num-query-groups 8 --seq-length 8192
--max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000
--normalization RMSNorm --norm-epsilon 1e-5 --swiglu --untie-embeddings-and-output-weights
--disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.008
--transformer-impl transformer_engine --no-rope-fusion --attention-backend flash
--micro-batch-size 1 --global-batch-size 32 --train-iters 1000 --lr 1.5e-4 --min-lr 1.5e-5
--lr-warmup-iters 100 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 4
--num-layers-per-virtual-pipeline-stage 5 --context-parallel-size 2 --cp-comm-type p2p
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--recompute-granularity selective --recompute-modules core_attn
--tokenizer-type HuggingFaceTokenizer --tokenizer-model meta-llama/Meta-Llama-3-70B
--data-path 1.0 /data/llama_text_document --split 99,1,0 --data-cache-path /tmp/cache
--log-interval 10 --log-throughput --log-progress --wandb-project llama --wandb-entity team
--save /tmp/ckpt --save-interval 500 --save-retain-interval 1000 --ckpt-format torch_dist
--ckpt-assume-constant-structure --use-persistent-ckpt-worker --async-save
--eval-iters 10 --eval-interval 500 --logging-level 20
"""

# Mixtral 8x7B (examples/mixtral): EP 8, PP 4, TP 2 with sequence parallelism.
MIXTRAL_8X7B = """
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
--position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--moe-router-dtype fp32
--moe-permute-fusion --overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model /models/tokenizer.model --mock-data
--split 99990,8,2
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
--lr-warmup-iters 500 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4
--expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10
--no-load-optim --no-load-rng --wandb-project Mixtral --wandb-exp-name Mixtral_8x7B
"""

# DeepSeek-V3 (Megatron's MoE recipe): MLA, MTP, 256 experts with DeepSeek's router, DeepEP;
# TP 2, uneven PP 8, EP 32.
DEEPSEEK_V3 = """
--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
--kv-channels 128 --seq-length 4096 --max-position-embeddings 4096
--position-embedding-type rope --rotary-base 10000 --normalization RMSNorm --norm-epsilon 1e-6
--swiglu --untie-embeddings-and-output-weights --disable-bias-linear
--attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.006
--multi-latent-attention
--q-lora-rank 1536
--kv-lora-rank 512
--qk-head-dim 128
--qk-pos-emb-head-dim 64
--v-head-dim 128
--rotary-scaling-factor 40
--mscale 1.0
--mscale-all-dim 1.0
--num-experts 256 --moe-layer-freq ([0]*3+[1]*58) --moe-ffn-hidden-size 2048
--moe-shared-expert-intermediate-size 2048 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk 8
--moe-token-dispatcher-type flex
--moe-enable-deepep
--moe-router-pre-softmax --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
--moe-router-group-topk 4
--moe-router-num-groups 8
--moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid
--moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3
--moe-router-dtype fp32
--moe-permute-fusion
--mtp-num-layers 1
--mtp-loss-scaling-factor 0.1
--micro-batch-size 1 --global-batch-size 8192 --train-iters 10000 --lr 2.2e-4
--min-lr 2.2e-5 --lr-warmup-iters 200 --lr-decay-style cosine --weight-decay 0.1
--clip-grad 1.0 --bf16 --no-bias-gelu-fusion
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 8
--decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 8
--expert-model-parallel-size 32 --expert-tensor-parallel-size 1
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
--tokenizer-type HuggingFaceTokenizer --tokenizer-model deepseek-ai/DeepSeek-V3 --mock-data
--log-interval 1 --ckpt-format torch_dist --no-save-optim --eval-iters 0
"""

# GPT-3 175B (examples/gpt3): TP 8, PP 16 interleaved, fp16, batch-size ramp-up. Megatron
# ramps up sample-based runs only, so the schedule is given in samples.
GPT3_175B = """
--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
--max-position-embeddings 2048 --attention-backend auto
--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
--train-samples 146484375 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
--min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-samples 126953125
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--num-layers-per-virtual-pipeline-stage 3
--data-path /data/gpt_text_document --vocab-file /data/gpt2-vocab.json
--merge-file /data/gpt2-merges.txt --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save /tmp/ckpt
--load /tmp/ckpt --eval-iters 10 --tensorboard-dir /tmp/tb
"""

# BERT 340M (examples/bert): TP 2, PP 2 (24 layers), fp16.
BERT_340M = """
--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 512
--max-position-embeddings 512 --attention-backend auto
--micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --weight-decay 1e-2
--clip-grad 1.0 --fp16 --lr 0.0001 --lr-decay-iters 990000 --lr-decay-style linear
--min-lr 1.0e-5 --lr-warmup-fraction .01
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
--data-path /data/bert_text_sentence --vocab-file /data/bert-vocab.txt --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save /tmp/ckpt
--load /tmp/ckpt --eval-iters 10 --tensorboard-dir /tmp/tb
"""

FP8 = {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"}
# Flags that work here but whose combination with the recipe's layout is refused by validation
# (one line naming the flag): flag -> what it cannot be combined with yet.
REFUSED_IN_COMBINATION = {}

# name -> (recipe, world size, the flags it may be refused on, pretrain_bert's flags?)
RECIPES = {
    "llama3_8b": (LLAMA3_8B, 8, FP8, False),
    "llama3_70b": (LLAMA3_70B, 64, set(), False),
    "mixtral_8x7b": (MIXTRAL_8X7B, 64, set(), False),
    "deepseek_v3": (DEEPSEEK_V3, 256, {
        "--moe-token-dispatcher-type", "--moe-enable-deepep"}, False),
    "gpt3_175b": (GPT3_175B, 256, set(), False),
    "bert_340m": (BERT_340M, 8, set(), True),
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


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_accepted_or_refused_in_one_line_for_a_listed_flag(name):
    recipe, world_size, refusable, bert = RECIPES[name]
    words = [w for line in _lines(recipe) for w in line]
    if not refusable:
        args = _validate(words, world_size, bert)
        assert args.data_parallel_size * args.tensor_model_parallel_size * (
            args.pipeline_model_parallel_size * args.context_parallel_size) == world_size
        return
    with pytest.raises(ArgumentsError) as err:
        _validate(words, world_size, bert)
    message = str(err.value)
    assert "\n" not in message and message.split()[0] in refusable, message
    assert "not supported" in message
    assert not dist.is_initialized()


@pytest.mark.parametrize("name", sorted(name for name, r in RECIPES.items() if r[2]))
def test_recipe_without_its_refused_flags_is_accepted(name):
    recipe, world_size, refusable, bert = RECIPES[name]
    kept = [line for line in _lines(recipe) if line[0] not in refusable]
    args = _validate([w for line in kept for w in line], world_size, bert)
    assert args.num_layers > 0


def test_refusable_flags_are_refused_for_a_documented_reason():
    """Every flag a recipe may be refused on is in the registry (or a refused value)."""
    names = {}
    for action in build_parser()._actions:
        for option in action.option_strings:
            names[option] = action
    for _, _, refusable, _ in RECIPES.values():
        for flag in refusable:
            if flag in REFUSED_IN_COMBINATION:
                continue
            action = names[flag]
            assert action.dest in UNSUPPORTED_FLAGS or getattr(action, "refused_choices", None), \
                flag
