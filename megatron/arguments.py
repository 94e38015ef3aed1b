"""Megatron's command-line surface for GPT and BERT pretraining.

The flag names, defaults and groups follow Megatron-LM, so launch scripts written for it parse
unchanged. :func:`validate_args` derives every size (data-parallel size, micro-batches, ffn size,
kv channels, ...) and rejects impossible combinations before any process group exists;
:func:`build_configs` then turns the namespace into the typed configs each component takes.
"""

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from megatron.checkpoint_config import CheckpointConfig
from megatron.core.config import (ConfigError, ParallelConfig, TransformerConfig,
                                  numerics_flag_conflict, pipeline_layer_counts)
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig)
from megatron.data.config import DataConfig
from megatron.flag_registry import NO_EFFECT_FLAGS, UNSUPPORTED_FLAGS
from megatron.model.moe.config import (DISPATCHER_TYPES, DROP_POLICIES, LOAD_BALANCING_TYPES,
                                       SCORE_FUNCTIONS, MoEConfig, parse_moe_layer_freq)
from megatron.optimizer.config import OptimizerConfig, SchedulerConfig

TOKENIZER_TYPES = [
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer", "NullTokenizer",
]


class ArgumentsError(ValueError):
    """Flags that cannot work together; the message names the flags and values."""


def _add_network_size_args(parser):
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--encoder-num-layers", type=int, default=None)
    g.add_argument("--decoder-num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                   choices=["learned_absolute", "rope", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="older spelling of --position-embedding-type rope")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="rotate neighbouring channel pairs (2i, 2i+1) instead of the two halves")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="divide positions by this factor before taking the rotary angles")
    g.add_argument("--no-position-embedding", action="store_false",
                   dest="add_position_embedding")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--layernorm-epsilon", type=float, default=None,
                   help="older spelling of --norm-epsilon")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="LayerNorm weights hold gamma - 1 (start at zero): y = x_hat (1 + w) + b")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="a --normalization norm over head_dim on query and key, before rotary")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true")
    g.add_argument("--openai-gelu", action="store_true")
    g.add_argument("--squared-relu", action="store_true", help="MLP activation relu(x)^2")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--onnx-safe", type=bool, required=False)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="BERT without the sentence-order (binary) head and its loss")


def _add_regularization_args(parser):
    g = parser.add_argument_group(title="regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", type=str, default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-08)
    g.add_argument("--sgd-momentum", type=float, default=0.9)


def _add_training_args(parser):
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--batch-size", type=int, default=None,
                   help="old alias of --micro-batch-size")
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs="*", default=None,
                   help="start increment samples, e.g. 16 16 5000000")
    g.add_argument("--recompute-activations", action="store_true",
                   help="shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-granularity", type=str, default=None,
                   choices=["full", "selective"])
    g.add_argument("--distribute-saved-activations", action="store_true")
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="old spelling of --recompute-granularity full --recompute-method uniform")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGINT, save a checkpoint at the end of the iteration "
                   "on every rank and exit with status 0")
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--no-masked-softmax-fusion", action="store_false",
                   dest="masked_softmax_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    # Megatron spells the opt-in; here the fusion is on by default, so both spellings exist.
    g.add_argument("--cross-entropy-loss-fusion", action="store_true", default=True)
    g.add_argument("--no-cross-entropy-loss-fusion", action="store_false",
                   dest="cross_entropy_loss_fusion")
    g.add_argument("--no-persist-layer-norm", action="store_true")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--optimizer", type=str, default="adam", choices=["adam", "sgd"])
    g.add_argument("--dataloader-type", type=str, default=None,
                   choices=["single", "cyclic", "external"])
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_false",
                   dest="async_tensor_model_parallel_allreduce")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion")
    g.add_argument("--use-mcore-models", action="store_true")
    g.add_argument("--use-legacy-models", action="store_true")
    g.add_argument("--transformer-impl", default="local",
                   choices=["local", "transformer_engine"],
                   help="local: this project's own layers (the only ones wired in); "
                   "transformer_engine is refused with a message")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collector off during training and "
                   "collect every --manual-gc-interval iterations, at the same point on every rank")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: iterations between collections (0: only at the start)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="stop every rank before the optimizer step when a loss or (without "
                   "--fp16) a gradient holds an inf or nan, naming the iteration, rank and tensor")
    g.add_argument("--skip-iterations-with-loss-spike", action="store_true",
                   help="skip the optimizer step of an iteration whose loss is not finite or "
                   "exceeds --loss-spike-factor x the mean loss of the last --loss-spike-window "
                   "steps taken; counted as a skipped iteration in the log line")
    g.add_argument("--loss-spike-factor", type=float, default=2.0)
    g.add_argument("--loss-spike-window", type=int, default=20)
    g.add_argument("--skip-train", action="store_true")


def _add_initialization_args(parser):
    g = parser.add_argument_group(title="initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-parallel-random-init", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--init-method-xavier-uniform", action="store_true")


def _add_learning_rate_args(parser):
    g = parser.add_argument_group(title="learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-wsd-decay-style", type=str, default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--warmup", type=int, default=None, help="old alias of --lr-warmup-iters")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true", dest="override_opt_param_scheduler")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler")
    g.add_argument("--decoupled-lr", type=float, default=None)
    g.add_argument("--decoupled-min-lr", type=float, default=None)


def _add_checkpointing_args(parser):
    g = parser.add_argument_group(title="checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true", default=None)
    g.add_argument("--no-save-rng", action="store_true", default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--pretrained-checkpoint", type=str, default=None,
                   help="when --load holds no checkpoint, start from this checkpoint's weights "
                   "as --finetune does")
    g.add_argument("--ckpt-step", type=int, default=None)
    g.add_argument("--use-checkpoint-args", action="store_true")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-format", type=str, default="torch", choices=["torch", "torch_dist"],
                   help="torch: one model_optim_rng.pt per (tensor, pipeline) rank; torch_dist: "
                        "Megatron-Core's distributed checkpoint, every rank writing its own "
                        "shards, loadable at any other parallel layout")
    g.add_argument("--use-dist-ckpt", action="store_true",
                   help="older spelling of --ckpt-format torch_dist")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="accepted for Megatron's scripts, no effect here: loading always "
                        "detects the format of the checkpoint in --load")
    g.add_argument("--ckpt-convert-format", type=str, default=None,
                   choices=["torch", "torch_dist"],
                   help="after loading --load, save it in this format to --ckpt-convert-save "
                        "and exit")
    g.add_argument("--ckpt-convert-save", type=str, default=None)
    g.add_argument("--dist-ckpt-strictness", type=str, default="assume_ok_unexpected",
                   choices=["assume_ok_unexpected", "log_unexpected", "raise_unexpected",
                            "raise_all", "log_all", "ignore_all", "return_unexpected",
                            "return_all"],
                   help="torch_dist loads: what to do with saved tensors the model has no "
                        "place for (ignore, log, raise); a tensor the model needs and the "
                        "checkpoint lacks always stops the load")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   help="accepted for Megatron's scripts, no effect here: every rank always "
                        "writes its own torch_dist shards")
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_true",
                   help="accepted for Megatron's scripts, no effect here: every rank always "
                        "writes its own torch_dist shards")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="accepted for Megatron's scripts, no effect here: every rank always "
                        "reads only the slices it needs")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints on a background thread while training goes on; the "
                   "tracker is updated once every rank's file is complete")


def _add_mixed_precision_args(parser):
    g = parser.add_argument_group(title="mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--fp32-residual-connection", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true", default=False,
                   help="scale q k^T by 1 / layer number (undone in the fp32 softmax); also "
                   "sets --attention-softmax-in-fp32")
    g.add_argument("--no-query-key-layer-scaling", action="store_false", default=False,
                   dest="apply_query_key_layer_scaling",
                   help="older spelling of the default (no query-key layer scaling)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--fp16-lm-cross-entropy", action="store_true")


def _add_distributed_args(parser):
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None)
    g.add_argument("--model-parallel-size", type=int, default=None,
                   help="old alias of --tensor-model-parallel-size")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--overlap-p2p-communication", action="store_true")
    g.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bit-reproducible runs on GPUs: deterministic kernels only (an op "
                        "without one raises), pinned cuBLAS workspace and NCCL algorithm")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--no-delay-grad-reduce", action="store_false", dest="delay_grad_reduce")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--delay-param-gather", action="store_true")
    g.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_false",
                   dest="scatter_gather_tensors_in_pipeline")
    g.add_argument("--use-ring-exchange-p2p", action="store_true")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank")
    g.add_argument("--lazy-mpu-init", type=bool, required=False)
    g.add_argument("--use-cpu-initialization", action="store_true", default=None)
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="empty the CUDA caching allocator after forward-backward and evaluation "
                   "steps (1) and after the optimizer step too (2); no effect on CPU")
    g.add_argument("--standalone-embedding-stage", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split every sequence over this many ranks (attention exchanges "
                        "keys and values; everything else runs on the local tokens)")
    g.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "all_gather", "a2a"],
                   help="context parallelism's exchange: a ring of key/value blocks (p2p), "
                        "one all-gather of them (all_gather), or all-to-all from a sequence "
                        "split to a head split (a2a)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--DDP-impl", default="local", choices=["local", "torch"],
                   help="accepted for old scripts; the local (Megatron) implementation is used")
    g.add_argument("--no-contiguous-buffers-in-local-ddp", action="store_false",
                   dest="use_contiguous_buffers_in_local_ddp")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run: CUDA + NCCL when GPUs are present (auto), else CPU + gloo")


def _add_validation_args(parser):
    g = parser.add_argument_group(title="validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)


def _add_data_args(parser):
    g = parser.add_argument_group(title="data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969, 30, 1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                   help="NullTokenizer: the end-of-document id, one of the --vocab-size ids "
                        "(Megatron-Core's tokenizers). Without it, the end-of-document id is "
                        "--vocab-size itself and the vocabulary one larger (Megatron's legacy "
                        "NullTokenizer)")
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--vocab-extra-ids", type=int, default=0)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--encoder-seq-length", type=int, default=None)
    g.add_argument("--decoder-seq-length", type=int, default=None)
    g.add_argument("--sample-rate", type=float, default=1.0)
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="BERT: fraction of the tokens of a sample chosen for masked-LM")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="BERT: probability of a sample shorter than --seq-length")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--tokenizer-type", type=str, default=None, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    g.add_argument("--num-dataset-builder-threads", type=int, default=1)
    g.add_argument("--data-impl", type=str, default=None,
                   choices=["mmap", "lazy", "cached", "infer"],
                   help="accepted for old scripts and ignored: only the mmap format exists")
    g.add_argument("--dataset-impl", type=str, default=None,
                   choices=["mmap", "lazy", "cached", "infer"],
                   help="accepted for old scripts and ignored: only the mmap format exists")
    g.add_argument("--mmap-warmup", action="store_true")
    g.add_argument("--data-args-path", type=str, default=None,
                   help="a file holding the --data-path value (whitespace separated: "
                   "[weight] prefix ...); instead of --data-path")
    g.add_argument("--per-split-data-args-path", type=str, default=None,
                   help='a JSON file {"train": [...], "valid": [...], "test": [...]} holding '
                   "the --train/--valid/--test-data-path values (a list, or one whitespace "
                   "separated string, each)")


def _add_logging_args(parser):
    g = parser.add_argument_group(title="logging")
    g.add_argument("--log-params-norm", action="store_true",
                   help="L2 norm of all parameters (each counted once) in the log line "
                   "(params norm) and TensorBoard (params-norm)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-throughput", action="store_true",
                   help="model TFLOP/s per device in the log line and TensorBoard (throughput)")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2])
    g.add_argument("--timing-log-option", type=str, default="minmax",
                   choices=["max", "minmax", "all"])
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="iteration-time and <timer>-time scalars (the timers of "
                   "--timing-log-level)")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", action="store_false",
                   dest="log_learning_rate_to_tensorboard")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes (and "
                   "mem-allocated-count) from the CUDA allocator; on CPU the process's resident "
                   "set size (current, and peak for max-allocated)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", type=str, default="")
    g.add_argument("--wandb-exp-name", type=str, default="")
    g.add_argument("--wandb-save-dir", type=str, default="")


def _add_profiling_args(parser):
    g = parser.add_argument_group(title="profiling")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start to --profile-step-end on "
                   "--profile-ranks: a torch profiler trace with --use-pytorch-profiler, else "
                   "cudaProfilerStart/Stop for nsys on GPUs (no effect on CPU)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0],
                   help="global ranks to profile")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: write a torch profiler trace (Chrome trace json) into "
                   "--tensorboard-dir")


def _add_moe_args(parser):
    g = parser.add_argument_group(title="mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (default: a dense MLP in every layer)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="default: --tensor-model-parallel-size")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="FFN size of each expert (default: --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=parse_moe_layer_freq, default=1,
                   help="N: every N-th layer (0, N, 2N, ...) is MoE; or a list with one 0/1 per "
                   "layer, e.g. \"([0]+[1]*23)\"")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-score-function", default="softmax", choices=SCORE_FUNCTIONS)
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=LOAD_BALANCING_TYPES)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=DISPATCHER_TYPES)
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=DROP_POLICIES)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output per token by sigmoid(x . gate_weight)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="also log load_balancing_loss / z_loss of each MoE layer (TensorBoard)")


ARG_GROUP_BUILDERS = [
    _add_network_size_args, _add_regularization_args, _add_training_args,
    _add_initialization_args, _add_learning_rate_args, _add_checkpointing_args,
    _add_mixed_precision_args, _add_distributed_args, _add_validation_args, _add_data_args,
    _add_logging_args, _add_profiling_args, _add_moe_args,
]


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron-style arguments", allow_abbrev=False)
    for add in ARG_GROUP_BUILDERS:
        add(parser)
    _describe_registered_flags(parser)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    return parser


def _describe_registered_flags(parser) -> None:
    """--help of each flag in NO_EFFECT_FLAGS / UNSUPPORTED_FLAGS says what it does here."""
    for action in parser._actions:
        if action.dest in NO_EFFECT_FLAGS:
            action.help = ("accepted for Megatron scripts; no effect here: "
                           + NO_EFFECT_FLAGS[action.dest])
        elif action.dest in UNSUPPORTED_FLAGS:
            action.help = ("not supported here (a run that sets it stops): "
                           + UNSUPPORTED_FLAGS[action.dest])


def parse_args(argv: Optional[List[str]] = None, extra_args_provider: Optional[Callable] = None,
               ignore_unknown_args: bool = False) -> argparse.Namespace:
    """Parse Megatron's flags (no validation); unknown flags are argparse errors (exit 2)."""
    parser = build_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return args


def _note(args, message: str) -> None:
    if args.rank == 0:
        print(f"NOTE: {message}", flush=True)


def _fail(message: str):
    raise ArgumentsError(message)


def _require(args, *names: str) -> None:
    missing = ["--" + n.replace("_", "-") for n in names if getattr(args, n) is None]
    if missing:
        _fail(f"missing required flag(s): {', '.join(missing)}")


def _validate_checkpoint_format(args) -> None:
    if args.use_dist_ckpt:
        args.ckpt_format = "torch_dist"
    if args.dist_ckpt_strictness not in ("assume_ok_unexpected", "log_unexpected",
                                         "raise_unexpected", "raise_all"):
        _fail(f"--dist-ckpt-strictness {args.dist_ckpt_strictness} is not supported: a tensor "
              "the model needs and the checkpoint lacks always stops a load here; use "
              "assume_ok_unexpected, log_unexpected, raise_unexpected or raise_all")
    if (args.ckpt_convert_format is None) != (args.ckpt_convert_save is None):
        _fail("--ckpt-convert-format and --ckpt-convert-save go together (the format to "
              "convert --load to, and the folder to write it in)")
    if args.ckpt_convert_format is not None and not args.load:
        _fail("--ckpt-convert-format needs --load: the checkpoint to convert")


def _apply_old_spellings(args) -> None:
    """Map flags that older Megatron scripts pass onto their current meaning."""
    if args.batch_size is not None:
        if args.micro_batch_size is None:
            args.micro_batch_size = args.batch_size
        _note(args, "--batch-size is the old name of --micro-batch-size")
    if args.warmup is not None:
        args.lr_warmup_iters = args.warmup
        _note(args, "--warmup is the old name of --lr-warmup-iters")
    if args.model_parallel_size is not None:
        args.tensor_model_parallel_size = args.model_parallel_size
        _note(args, "--model-parallel-size is the old name of --tensor-model-parallel-size")
    if args.layernorm_epsilon is not None:
        args.norm_epsilon = args.layernorm_epsilon
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.checkpoint_activations:
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1
        _note(args, "--checkpoint-activations means --recompute-granularity full "
                    "--recompute-method uniform")
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.encoder_seq_length is not None:
        if args.seq_length is not None and args.seq_length != args.encoder_seq_length:
            _fail(f"--seq-length ({args.seq_length}) and --encoder-seq-length "
                  f"({args.encoder_seq_length}) disagree")
        args.seq_length = args.encoder_seq_length
    if args.encoder_num_layers is not None and args.num_layers is None:
        args.num_layers = args.encoder_num_layers


def _check_registered_flags(args) -> None:
    """Stop on an unsupported flag that is set; one note for each no-effect flag that is set."""
    parser = build_parser()
    names = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    for dest, instead in UNSUPPORTED_FLAGS.items():
        value = getattr(args, dest, None)
        if value != parser.get_default(dest):
            _fail(f"{names[dest]} {value} is not supported: {instead}")
    for dest, reason in NO_EFFECT_FLAGS.items():
        if getattr(args, dest, None) != parser.get_default(dest):
            _note(args, f"{names[dest]} has no effect here: {reason}")


def _read_data_args_files(args) -> None:
    """--data-args-path / --per-split-data-args-path: the path flags' values, read from files."""
    if args.data_args_path is not None:
        if args.data_path:
            _fail("give only one of --data-path and --data-args-path")
        try:
            with open(args.data_args_path) as f:
                args.data_path = f.read().split()
        except OSError as err:
            _fail(f"--data-args-path {args.data_args_path}: cannot read it ({err.strerror})")
    if args.per_split_data_args_path is None:
        return
    path = args.per_split_data_args_path
    if any((args.train_data_path, args.valid_data_path, args.test_data_path)):
        _fail("give only one of --per-split-data-args-path and --train/--valid/--test-data-path")
    try:
        with open(path) as f:
            splits = json.load(f)
    except OSError as err:
        _fail(f"--per-split-data-args-path {path}: cannot read it ({err.strerror})")
    except ValueError as err:
        _fail(f"--per-split-data-args-path {path}: not JSON ({err})")
    if not isinstance(splits, dict) or set(splits) - {"train", "valid", "test"}:
        _fail(f"--per-split-data-args-path {path}: expected a JSON object with keys train, "
              f"valid and test, got {type(splits).__name__} "
              f"{sorted(splits) if isinstance(splits, dict) else ''}")
    for split in ("train", "valid", "test"):
        value = splits.get(split)
        if isinstance(value, str):
            value = value.split()
        if value is not None and not (isinstance(value, list)
                                      and all(isinstance(v, (str, int, float)) for v in value)):
            _fail(f"--per-split-data-args-path {path}: {split!r} must be a list of [weight] "
                  f"prefix values or one string, got {value!r}")
        setattr(args, f"{split}_data_path", [str(v) for v in value] if value else None)


def _validate_surface(args) -> None:
    """The implementation, profiling and data-file flags."""
    if args.transformer_impl == "transformer_engine":
        _fail("--transformer-impl transformer_engine is not supported: this project's layers "
              "are its own and TransformerEngine is not wired in; use --transformer-impl local")
    if args.profile:
        if args.profile_step_start < 0 or args.profile_step_end <= args.profile_step_start:
            _fail(f"--profile-step-end ({args.profile_step_end}) must be larger than "
                  f"--profile-step-start ({args.profile_step_start}) >= 0")
        if args.use_pytorch_profiler and not args.tensorboard_dir:
            _fail("--use-pytorch-profiler writes its trace into --tensorboard-dir; give one")
    if args.manual_gc_interval < 0:
        _fail(f"--manual-gc-interval must be >= 0, got {args.manual_gc_interval}")
    _read_data_args_files(args)


def _validate_context_parallel(args) -> None:
    """--context-parallel-size: the sequence, heads and masks must split over the cp ranks."""
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp == 1:
        return
    if args.seq_length % (2 * cp):
        _fail(f"--seq-length ({args.seq_length}) is not divisible by 2 x "
              f"--context-parallel-size ({cp}) = {2 * cp}: each sequence is cut into "
              f"{2 * cp} equal chunks")
    if args.cp_comm_type == "a2a":
        heads = args.num_attention_heads // tp
        if heads % cp:
            _fail(f"--cp-comm-type a2a splits the {heads} attention heads per tensor-parallel "
                  f"rank (--num-attention-heads {args.num_attention_heads} / "
                  f"--tensor-model-parallel-size {tp}) over --context-parallel-size {cp}; "
                  "they must divide evenly (or use --cp-comm-type p2p or all_gather)")


def _validate_parallel(args) -> None:
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for name, value in (("--tensor-model-parallel-size", tp),
                        ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", args.context_parallel_size)):
        if value < 1:
            _fail(f"{name} must be >= 1, got {value}")
    cp = args.context_parallel_size
    if args.world_size % (tp * cp * pp) != 0:
        sizes = [f"--tensor-model-parallel-size ({tp})"]
        if cp > 1:
            sizes.append(f"--context-parallel-size ({cp})")
        sizes.append(f"--pipeline-model-parallel-size ({pp})")
        _fail(f"world size ({args.world_size}) is not divisible by {' x '.join(sizes)} "
              f"= {tp * cp * pp}")
    args.data_parallel_size = args.world_size // (tp * cp * pp)
    _validate_context_parallel(args)
    if args.sequence_parallel and tp == 1:
        _note(args, "--sequence-parallel has no effect with --tensor-model-parallel-size 1; "
                    "disabling it")
        args.sequence_parallel = False
    uneven = (args.decoder_first_pipeline_num_layers is not None
              or args.decoder_last_pipeline_num_layers is not None)
    try:
        pipeline_layer_counts(args.num_layers, pp, args.decoder_first_pipeline_num_layers,
                              args.decoder_last_pipeline_num_layers)
    except ConfigError as err:
        _fail(str(err))
    if uneven and pp < 2:
        _fail("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size "
              f">= 2, got {pp}")
    if uneven and args.num_layers_per_virtual_pipeline_stage is not None:
        _fail("--decoder-first/last-pipeline-num-layers cannot be combined with "
              "--num-layers-per-virtual-pipeline-stage")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_vstage = args.num_layers_per_virtual_pipeline_stage
        if pp < 2:
            _fail("--num-layers-per-virtual-pipeline-stage needs "
                  f"--pipeline-model-parallel-size >= 2, got {pp}")
        if per_vstage < 1 or (args.num_layers // pp) % per_vstage != 0:
            _fail(f"--num-layers ({args.num_layers}) / --pipeline-model-parallel-size ({pp}) "
                  f"= {args.num_layers // pp} layers per stage, not divisible by "
                  f"--num-layers-per-virtual-pipeline-stage ({per_vstage})")
        args.virtual_pipeline_model_parallel_size = args.num_layers // pp // per_vstage
    if args.num_attention_heads % tp != 0:
        _fail(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
              f"--tensor-model-parallel-size ({tp})")
    if args.group_query_attention and args.num_query_groups % tp != 0:
        _fail(f"--num-query-groups ({args.num_query_groups}) must be divisible by "
              f"--tensor-model-parallel-size ({tp})")
    if args.ffn_hidden_size % tp != 0:
        _fail(f"--ffn-hidden-size ({args.ffn_hidden_size}) must be divisible by "
              f"--tensor-model-parallel-size ({tp})")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        _fail("--overlap-param-gather needs --use-distributed-optimizer")
    if args.distributed_backend == "nccl" and not torch.cuda.is_available():
        args.distributed_backend = "gloo"


def _validate_model(args) -> None:
    _require(args, "num_layers", "hidden_size", "num_attention_heads", "seq_length")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_position_embeddings is None:
        if args.position_embedding_type == "learned_absolute":
            _fail("--max-position-embeddings is required with learned absolute position "
                  "embeddings")
        args.max_position_embeddings = args.seq_length
    if (args.position_embedding_type == "learned_absolute"
            and args.seq_length > args.max_position_embeddings):
        _fail(f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings "
              f"({args.max_position_embeddings})")
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads != 0:
            _fail(f"--hidden-size ({args.hidden_size}) must be divisible by "
                  f"--num-attention-heads ({args.num_attention_heads}) unless --kv-channels "
                  "is given")
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    elif args.num_attention_heads % args.num_query_groups != 0:
        _fail(f"--num-attention-heads ({args.num_attention_heads}) must be divisible by "
              f"--num-query-groups ({args.num_query_groups})")
    if args.ffn_hidden_size is None:
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64
        else:
            args.ffn_hidden_size = 4 * args.hidden_size
    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 cannot both be given")
    conflict = numerics_flag_conflict(args)
    if conflict is not None:
        _fail(conflict)
    if args.apply_query_key_layer_scaling:
        args.attention_softmax_in_fp32 = True
    if (args.rotary_seq_len_interpolation_factor is not None
            and args.rotary_seq_len_interpolation_factor < 1):
        _fail("--rotary-seq-len-interpolation-factor must be >= 1, got "
              f"{args.rotary_seq_len_interpolation_factor}")
    args.params_dtype = torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float
    if args.bf16 and not args.accumulate_allreduce_grads_in_fp32:
        # As in Megatron: bf16 gradients are reduced and accumulated in fp32.
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.recompute_granularity == "full":
        if args.recompute_method is None:
            _fail("--recompute-granularity full needs --recompute-method uniform or block")
        if args.recompute_num_layers is None:
            _fail("--recompute-granularity full needs --recompute-num-layers")
    elif args.recompute_granularity == "selective" and args.recompute_method is not None:
        _fail(f"--recompute-method {args.recompute_method} applies only to "
              "--recompute-granularity full")
    elif args.recompute_granularity is None and args.recompute_method is not None:
        _fail("--recompute-method needs --recompute-granularity full")


def _validate_batch_and_schedule(args) -> None:
    _require(args, "micro_batch_size")
    dp = args.data_parallel_size
    if args.micro_batch_size < 1:
        _fail(f"--micro-batch-size must be >= 1, got {args.micro_batch_size}")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
        _note(args, f"--global-batch-size not given; using micro batch x data-parallel size "
                    f"= {args.global_batch_size}")
    if args.global_batch_size % (args.micro_batch_size * dp) != 0:
        _fail(f"--global-batch-size ({args.global_batch_size}) must be divisible by "
              f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size ({dp})")
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * dp)
    if args.rampup_batch_size is not None:
        if len(args.rampup_batch_size) != 3:
            _fail("--rampup-batch-size takes 3 values: start increment ramp-samples, got "
                  f"{args.rampup_batch_size}")
        args.rampup_batch_size = [int(v) for v in args.rampup_batch_size]
        if args.train_samples is None:
            _fail("--rampup-batch-size needs --train-samples (the schedule counts samples), "
                  "not --train-iters")
    if args.train_iters is not None and args.train_samples is not None:
        _fail("give only one of --train-iters and --train-samples")
    if args.train_samples is not None:
        if args.lr_decay_iters is not None or args.lr_warmup_iters:
            _fail("with --train-samples, give the schedule in samples "
                  "(--lr-decay-samples, --lr-warmup-samples), not iterations")
    elif args.lr_decay_samples is not None or args.lr_warmup_samples:
        _fail("with --train-iters, give the schedule in iterations "
              "(--lr-decay-iters, --lr-warmup-iters), not samples")
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        _fail("give only one of --lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples")
    if args.train_iters is not None and args.lr_warmup_fraction is None:
        decay_iters = args.lr_decay_iters or args.train_iters
        if args.lr_warmup_iters >= decay_iters:
            _fail(f"--lr-warmup-iters ({args.lr_warmup_iters}) must be smaller than "
                  f"--lr-decay-iters or --train-iters ({decay_iters})")
    if args.lr is not None and args.min_lr > args.lr:
        _fail(f"--min-lr ({args.min_lr}) is larger than --lr ({args.lr})")
    if args.decoupled_lr is None and args.decoupled_min_lr is not None:
        _note(args, "--decoupled-min-lr has no effect without --decoupled-lr")
    if args.decoupled_lr is not None:
        low = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
        if not 0.0 <= low <= args.decoupled_lr:
            _fail(f"--decoupled-min-lr (else --min-lr) ({low}) must be in [0, --decoupled-lr "
                  f"({args.decoupled_lr})]")
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.dataloader_type is None:
        args.dataloader_type = "single"
    if args.save_interval is not None and args.save_interval < 1:
        _fail(f"--save-interval must be >= 1, got {args.save_interval}")
    for name in ("log_interval", "eval_interval"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_iters < 0:
        _fail(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if args.loss_spike_factor <= 1.0:
        _fail(f"--loss-spike-factor must be > 1, got {args.loss_spike_factor}")
    if args.loss_spike_window < 1:
        _fail(f"--loss-spike-window must be >= 1, got {args.loss_spike_window}")


def _validate_masking(args) -> None:
    """The BERT data flags; their defaults pass, so GPT runs never trip on them."""
    if not 0.0 < args.mask_prob < 1.0:
        _fail(f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    if not 0.0 <= args.short_seq_prob <= 1.0:
        _fail(f"--short-seq-prob must be in [0, 1], got {args.short_seq_prob}")


BERT_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase")


def _validate_moe(args) -> None:
    """Megatron's checks of the MoE flags."""
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        if ep != 1:
            _fail(f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    tp = args.tensor_model_parallel_size
    if ep < 1 or args.num_experts % ep:
        _fail(f"--num-experts ({args.num_experts}) must be divisible by "
              f"--expert-model-parallel-size ({ep})")
    cp = getattr(args, "context_parallel_size", 1)
    if cp > 1 and args.moe_router_load_balancing_type == "sinkhorn":
        _fail(f"--moe-router-load-balancing-type sinkhorn with --context-parallel-size {cp}: "
              "Sinkhorn balances one rank's tokens, so it would route differently from CP 1; "
              "use aux_loss, seq_aux_loss or none")
    if cp > 1 and (args.moe_expert_capacity_factor or -1) >= 0:
        _fail(f"--moe-expert-capacity-factor with --context-parallel-size {cp}: the capacity "
              "of one rank's tokens would drop other tokens than CP 1; drop one of them")
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    if etp < 1:
        _fail(f"--expert-tensor-parallel-size must be >= 1, got {etp}")
    if etp != tp and tp > 1:
        # Each tensor-parallel rank routes its own slice of the sequence.
        if args.moe_router_load_balancing_type == "sinkhorn":
            _fail(f"--moe-router-load-balancing-type sinkhorn with --expert-tensor-parallel-size "
                  f"{etp} other than --tensor-model-parallel-size {tp}: each rank balances "
                  "its own slice of the sequence, so it would route differently from one rank; "
                  "use aux_loss, seq_aux_loss or none")
        if (args.moe_expert_capacity_factor or -1) >= 0:
            _fail(f"--moe-expert-capacity-factor with --expert-tensor-parallel-size {etp} other "
                  f"than --tensor-model-parallel-size {tp}: the capacity of one rank's slice "
                  "of the sequence would drop other tokens than one rank; drop one of them")
    if tp > 1 and not args.sequence_parallel:
        _fail(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel "
              "(as in Megatron)")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    gelu = not (args.swiglu or args.squared_relu or args.openai_gelu)
    if gelu and args.bias_gelu_fusion:
        _fail("--num-experts: experts use exact (erf) GeLU, as Megatron-Core's do, and it "
              "refuses the fused tanh bias-GeLU with them; add --no-bias-gelu-fusion")
    freq = args.moe_layer_freq
    if isinstance(freq, int) and freq < 1:
        _fail(f"--moe-layer-freq must be >= 1, got {freq}")
    if not isinstance(freq, int) and len(freq) != args.num_layers:
        _fail(f"--moe-layer-freq lists {len(freq)} layers, --num-layers is {args.num_layers}")
    if args.moe_ffn_hidden_size % etp:
        _fail(f"--moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) must be divisible by "
              f"--expert-tensor-parallel-size ({etp})")
    _moe_config(args)


def validate_bert_args(args: argparse.Namespace) -> None:
    """What pretrain_bert.py needs beyond :func:`validate_args`.

    BERT samples are built from the WordPiece ``[CLS]``, ``[SEP]``, ``[MASK]`` and ``[PAD]``
    tokens, its position embeddings are learned, and its data are real sentence pairs.

    Raises:
        ArgumentsError: naming the flag, the value seen and what BERT takes.
    """
    if args.tokenizer_type not in BERT_TOKENIZER_TYPES:
        _fail(f"--tokenizer-type {args.tokenizer_type} cannot make BERT samples (they need the "
              "WordPiece [CLS], [SEP], [MASK] and [PAD] tokens); use --tokenizer-type "
              f"{' or '.join(BERT_TOKENIZER_TYPES)} with --vocab-file vocab.txt")
    if args.position_embedding_type != "learned_absolute" or args.use_rotary_position_embeddings:
        _fail(f"--position-embedding-type {args.position_embedding_type}: BERT has learned "
              "absolute position embeddings (learned_absolute) only")
    if not args.add_position_embedding:
        _fail("--no-position-embedding: BERT needs its learned position embeddings")
    if args.untie_embeddings_and_output_weights:
        _fail("--untie-embeddings-and-output-weights: BERT's masked-LM head always uses the "
              "word embeddings")
    if args.mock_data:
        _fail("--mock-data makes GPT samples only; give BERT sentence data with --data-path "
              "(tools/preprocess_data.py --split-sentences)")
    if args.context_parallel_size != 1:
        _fail(f"--context-parallel-size {args.context_parallel_size}: BERT's bidirectional "
              "attention over padded sequences has no context-parallel split here (it is "
              "causal GPT attention only); use --context-parallel-size 1")


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Derive sizes and reject impossible combinations, before any process group exists.

    Raises:
        ArgumentsError: naming the flags and values involved.
    """
    _check_registered_flags(args)
    _validate_surface(args)
    _apply_old_spellings(args)
    _validate_model(args)
    _validate_parallel(args)
    _validate_moe(args)
    _validate_batch_and_schedule(args)
    _validate_masking(args)
    _validate_checkpoint_format(args)
    return args


def parse_and_validate(argv: Optional[List[str]] = None,
                       extra_args_provider: Optional[Callable] = None,
                       prog: Optional[str] = None) -> argparse.Namespace:
    """What an entry point calls: bad sizes print one line naming the flags and exit with 2."""
    args = parse_args(argv, extra_args_provider)
    try:
        return validate_args(args)
    except (ArgumentsError, ConfigError) as err:
        name = prog or os.path.basename(sys.argv[0]) or "megatron"
        print(f"{name}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2)


@dataclass
class Configs:
    """The typed configs built from validated flags; each component takes only its own.

    ``optimizer`` is None without --lr, and ``scheduler`` also without --train-iters or
    --train-samples: flags that describe no training (generation, evaluation, conversion).
    """

    parallel: ParallelConfig
    model: TransformerConfig
    ddp: DistributedDataParallelConfig
    checkpoint: CheckpointConfig
    data: DataConfig
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    moe: Optional[MoEConfig] = None


def build_configs(args: argparse.Namespace) -> Configs:
    """Typed configs from validated args (``args.padded_vocab_size`` must be set).

    The builders of the other configs follow this function: the flag audit
    (tests/unit/test_flag_audit.py) reads the ``field=args.flag`` pairs from here to the end.
    """
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        data_parallel_size=args.data_parallel_size,
    )
    model = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        padded_vocab_size=args.padded_vocab_size,
        max_position_embeddings=args.max_position_embeddings, seq_length=args.seq_length,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        layernorm_epsilon=args.norm_epsilon, normalization=args.normalization,
        apply_residual_connection_post_layernorm=args.apply_residual_connection_post_layernorm,
        position_embedding_type=args.position_embedding_type, cp_comm_type=args.cp_comm_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        rotary_interleaved=args.rotary_interleaved,
        rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        swiglu=args.swiglu, openai_gelu=args.openai_gelu, squared_relu=args.squared_relu,
        apply_layernorm_1p=args.apply_layernorm_1p, qk_layernorm=args.qk_layernorm,
        init_method_xavier_uniform=args.init_method_xavier_uniform,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        params_dtype=args.params_dtype, fp16=args.fp16, bf16=args.bf16,
        fp32_residual_connection=args.fp32_residual_connection,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        masked_softmax_fusion=args.masked_softmax_fusion,
        bias_gelu_fusion=args.bias_gelu_fusion, bias_dropout_fusion=args.bias_dropout_fusion,
        bias_swiglu_fusion=args.bias_swiglu_fusion,
        use_flash_attn=args.use_flash_attn, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
    )
    model.check_splittable(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    return Configs(parallel=parallel, model=model, ddp=_ddp_config(args),
                   checkpoint=_checkpoint_config(args), data=build_data_config(args),
                   optimizer=_optimizer_config(args), scheduler=_scheduler_config(args),
                   moe=_moe_config(args))


def _moe_config(args) -> Optional[MoEConfig]:
    """The MoE settings (None for a dense model); ``--expert-tensor-parallel-size`` defaults
    to the tensor-parallel size, as in Megatron-Core."""
    if args.num_experts is None:
        return None
    return MoEConfig(
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_input_jitter_eps=args.moe_input_jitter_eps,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=(args.expert_tensor_parallel_size
                                     or args.tensor_model_parallel_size),
        moe_layer_freq=args.moe_layer_freq, moe_per_layer_logging=args.moe_per_layer_logging)


def _ddp_config(args) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion)


def _checkpoint_config(args) -> CheckpointConfig:
    return CheckpointConfig(
        save=args.save, save_interval=args.save_interval, no_save_optim=args.no_save_optim,
        no_save_rng=args.no_save_rng, load=args.load, no_load_optim=args.no_load_optim,
        no_load_rng=args.no_load_rng, finetune=args.finetune,
        pretrained_checkpoint=args.pretrained_checkpoint, ckpt_step=args.ckpt_step,
        exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
        ckpt_format=args.ckpt_format, async_save=args.async_save,
        ckpt_convert_format=args.ckpt_convert_format, ckpt_convert_save=args.ckpt_convert_save,
        dist_ckpt_strictness=args.dist_ckpt_strictness)


def build_data_config(args) -> DataConfig:
    """The data config alone: what a dataset provider needs, before or without the model's
    (which needs the tokenizer's padded vocabulary)."""
    return DataConfig(
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, seed=args.seed,
        data_path=args.data_path, train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path, test_data_path=args.test_data_path,
        split=args.split, data_cache_path=args.data_cache_path, mock_data=args.mock_data,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob,
        dataloader_type=args.dataloader_type, num_workers=args.num_workers)


def _optimizer_config(args) -> Optional[OptimizerConfig]:
    if args.lr is None:
        return None
    return OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr,
        decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
        fp16=args.fp16, bf16=args.bf16, params_dtype=args.params_dtype,
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=int(args.loss_scale_window),
        hysteresis=args.hysteresis, use_distributed_optimizer=args.use_distributed_optimizer,
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad)


def _scheduler_config(args) -> Optional[SchedulerConfig]:
    """The schedule with its lengths in samples, as the training loop steps it."""
    if args.lr is None or (args.train_iters is None and args.train_samples is None):
        return None
    gbs = args.global_batch_size
    if args.train_samples is None:
        decay_steps = (args.lr_decay_iters or args.train_iters) * gbs
        wd_incr_steps = args.train_iters * gbs
        wsd_steps = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None
        warmup_steps = (args.lr_warmup_fraction * decay_steps
                        if args.lr_warmup_fraction is not None else args.lr_warmup_iters * gbs)
    else:
        decay_steps = args.lr_decay_samples or args.train_samples
        wd_incr_steps = args.train_samples
        wsd_steps = args.lr_wsd_decay_samples
        warmup_steps = (args.lr_warmup_fraction * decay_steps
                        if args.lr_warmup_fraction is not None else args.lr_warmup_samples)
    return SchedulerConfig(
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay, wd_incr_steps=wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_steps, lr_wsd_decay_style=args.lr_wsd_decay_style)
