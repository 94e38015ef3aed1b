"""Megatron's flag surface: the classic GPT-2 recipe parses unchanged; sizes derive; bad ones fail."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from megatron.training.arguments import ArgumentsError, build_configs, parse_args, validate_args
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.tokenizer import vocab_size_with_padding

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The classic GPT-2 recipe as users' launch scripts pass it (sizes as in the CodeParrot example).
CLASSIC_GPT2 = """
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
--num-layers-per-virtual-pipeline-stage 3 --use-distributed-optimizer
--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
--max-position-embeddings 1024 --micro-batch-size 12 --global-batch-size 192 --lr 0.0005
--train-iters 150000 --lr-decay-iters 150000 --lr-decay-style cosine --lr-warmup-iters 2000
--min-lr 1e-5 --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.999
--adam-eps 1e-8 --fp16 --log-interval 10 --save-interval 2000 --eval-interval 200
--eval-iters 10 --vocab-file vocab.json --merge-file merges.txt --tokenizer-type GPT2BPETokenizer
--data-path codeparrot_content_document --split 969,30,1 --save ckpts --load ckpts
--tensorboard-dir tb --seed 1234 --init-method-std 0.02 --attention-dropout 0.1
--hidden-dropout 0.1 --recompute-granularity full --recompute-method uniform
--recompute-num-layers 1 --distributed-backend nccl --data-impl mmap --dataset-impl mmap
""".split()

# Without --lr-warmup-iters (it cannot be combined with --lr-warmup-fraction).
CLASSIC_WITH_FRACTION = [a for a in CLASSIC_GPT2] + ["--lr-warmup-fraction", "0.01"]


def _args(argv, world_size=1, monkeypatch=None):
    args = parse_args(argv=argv)
    args.world_size = world_size
    return args


def test_classic_recipe_parses_and_derives():
    args = validate_args(_args(CLASSIC_GPT2, world_size=8))
    assert args.data_parallel_size == 2
    assert args.num_micro_batches == 192 // (12 * 2)
    assert args.ffn_hidden_size == 4 * 768
    assert args.kv_channels == 64
    assert args.virtual_pipeline_model_parallel_size == 12 // 2 // 3
    assert args.params_dtype == torch.half
    assert args.lr_decay_style == "cosine" and args.lr == 5e-4 and args.adam_beta2 == 0.999
    assert args.sequence_parallel and args.use_distributed_optimizer
    assert args.data_path == ["codeparrot_content_document"]
    assert args.distributed_backend in ("gloo", "nccl")


def test_classic_recipe_rejects_two_warmups():
    with pytest.raises(ArgumentsError, match="--lr-warmup-fraction"):
        validate_args(_args(CLASSIC_WITH_FRACTION, world_size=8))


def test_defaults_match_megatron():
    args = parse_args(argv=["--num-layers", "2"])
    expected = dict(seed=1234, split="969, 30, 1", init_method_std=0.02, clip_grad=1.0,
                    weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
                    attention_dropout=0.1, hidden_dropout=0.1, initial_loss_scale=2 ** 32,
                    min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2,
                    make_vocab_size_divisible_by=128, log_interval=100, eval_interval=1000,
                    eval_iters=100, lr_decay_style="linear", optimizer="adam",
                    distributed_timeout_minutes=10, num_workers=2,
                    check_for_nan_in_loss_and_grad=True, rerun_mode="validate_results")
    for name, value in expected.items():
        assert getattr(args, name) == value, name


def test_loss_spike_skipping_takes_over_non_finite_losses_from_the_default_check(capsys):
    skip = ["--vocab-size", "1000", "--tokenizer-type", "NullTokenizer",
            "--skip-iterations-with-loss-spike"]
    args = validate_args(_args(BASE + skip))
    assert args.check_for_nan_in_loss_and_grad is False
    assert "--skip-iterations-with-loss-spike: the inf/nan check" in capsys.readouterr().out
    # Asked for by name, the two answers to a nan loss (skip, stop) are refused together.
    with pytest.raises(ArgumentsError, match="pass one of them"):
        validate_args(_args(BASE + skip + ["--check-for-nan-in-loss-and-grad"]))
    assert validate_args(_args(BASE + skip[:4])).check_for_nan_in_loss_and_grad is True


BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 10").split()


def test_derived_single_rank():
    args = validate_args(_args(BASE + ["--vocab-size", "1000", "--tokenizer-type",
                                       "NullTokenizer"]))
    assert args.data_parallel_size == 1 and args.global_batch_size == 2
    assert args.num_micro_batches == 1 and args.ffn_hidden_size == 256
    assert args.kv_channels == 8 and args.num_query_groups == 8
    build_tokenizer(args)
    assert args.padded_vocab_size == 1024  # 1000 ids + end-of-document, padded to 128


def test_swiglu_ffn_and_gqa():
    args = validate_args(_args(BASE + ["--swiglu", "--group-query-attention",
                                       "--num-query-groups", "2"]))
    assert args.ffn_hidden_size == int((4 * 64 * 2 / 3) / 64) * 64
    assert args.num_query_groups == 2


def test_pad_vocab_size():
    args = _args(BASE + ["--tensor-model-parallel-size", "2"], world_size=2)
    assert vocab_size_with_padding(50257, args) == 50432  # GPT-2's padded size at TP=2
    args.tensor_model_parallel_size = 1
    assert vocab_size_with_padding(50257, args) == 50304


@pytest.mark.parametrize("extra,world,pattern", [
    (["--tensor-model-parallel-size", "3"], 3,
     r"--num-attention-heads \(8\) must be divisible by --tensor-model-parallel-size \(3\)"),
    (["--pipeline-model-parallel-size", "3"], 3,
     r"--num-layers \(4\) must be divisible by --pipeline-model-parallel-size \(3\)"),
    (["--tensor-model-parallel-size", "2"], 3,
     r"world size \(3\) is not divisible by --tensor-model-parallel-size \(2\)"),
    (["--global-batch-size", "5"], 2,
     r"--global-batch-size \(5\) must be divisible by --micro-batch-size \(2\) x "
     r"data-parallel size \(2\)"),
    (["--fp16", "--bf16"], 1, "--fp16 and --bf16"),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1"], 3,
     r"leaves 3 layers, which cannot be split evenly over the other 2 pipeline stage"),
    (["--decoder-last-pipeline-num-layers", "2"], 1,
     r"need --pipeline-model-parallel-size >= 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     r"not divisible by --num-layers-per-virtual-pipeline-stage \(3\)"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1,
     r"--pipeline-model-parallel-size >= 2"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "6"], 2, r"number of micro-batches \(3\) leaves 1 after whole groups"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "2"], 2, r"must lie between --pipeline-model-parallel-size \(2\) "
                                      r"and the number of micro-batches \(1\)"),
    (["--seq-length", "64"], 1, r"--seq-length \(64\) exceeds --max-position-embeddings \(32\)"),
    (["--hidden-size", "60"], 1, r"--hidden-size \(60\) must be divisible by"),
    (["--group-query-attention", "--num-query-groups", "3"], 1,
     r"--num-attention-heads \(8\) must be divisible by --num-query-groups \(3\)"),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size",
      "4"], 4, r"--num-query-groups \(2\) must be divisible by --tensor-model-parallel-size"),
    (["--ffn-hidden-size", "100", "--tensor-model-parallel-size", "8"], 8,
     r"--ffn-hidden-size \(100\) must be divisible"),
    (["--recompute-granularity", "full"], 1, "--recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], 1,
     "applies only to --recompute-granularity full"),
    (["--train-samples", "100"], 1, "only one of --train-iters and --train-samples"),
    (["--rampup-batch-size", "2", "2", "100"], 1, "--rampup-batch-size needs --train-samples"),
    (["--lr-warmup-iters", "10"], 1,
     r"--lr-warmup-iters \(10\) must be smaller than --lr-decay-iters or --train-iters \(10\)"),
    (["--min-lr", "1", "--lr", "0.1"], 1, r"--min-lr \(1.0\) is larger than --lr \(0.1\)"),
    (["--num-experts", "6", "--no-bias-gelu-fusion", "--expert-model-parallel-size", "4"], 4,
     r"--num-experts \(6\) must be divisible by --expert-model-parallel-size \(4\)"),
    (["--expert-model-parallel-size", "2"], 2, "--expert-model-parallel-size 2 needs --num-experts"),
    (["--num-experts", "4", "--no-bias-gelu-fusion", "--context-parallel-size", "2",
      "--moe-router-load-balancing-type", "sinkhorn"], 2,
     r"sinkhorn with --context-parallel-size 2: Sinkhorn balances one rank's tokens"),
    (["--num-experts", "4", "--no-bias-gelu-fusion", "--context-parallel-size", "2",
      "--moe-expert-capacity-factor", "1.0"], 2,
     r"--moe-expert-capacity-factor with --context-parallel-size 2"),
    (["--num-experts", "4", "--moe-grouped-gemm"], 1,
     r"--moe-grouped-gemm: the grouped experts have no fused bias-GeLU"),
    (["--num-experts", "4", "--no-bias-gelu-fusion", "--tensor-model-parallel-size", "2",
      "--sequence-parallel", "--expert-tensor-parallel-size", "1",
      "--moe-router-load-balancing-type", "sinkhorn"], 2,
     r"sinkhorn with --expert-tensor-parallel-size 1 other than --tensor-model-parallel-size 2"),
    (["--num-experts", "4", "--no-bias-gelu-fusion", "--tensor-model-parallel-size", "2",
      "--sequence-parallel", "--expert-tensor-parallel-size", "1",
      "--moe-expert-capacity-factor", "1.0"], 2,
     r"--moe-expert-capacity-factor with --expert-tensor-parallel-size 1 other than "
     r"--tensor-model-parallel-size 2"),
    (["--num-experts", "4", "--no-bias-gelu-fusion", "--expert-tensor-parallel-size", "2",
      "--save", "/tmp/never-written", "--ckpt-format", "torch"], 2,
     r"--ckpt-format torch cannot save --expert-tensor-parallel-size 2 with "
     r"--tensor-model-parallel-size 1: .*use --ckpt-format torch_dist"),
    (["--num-experts", "4", "--no-bias-gelu-fusion", "--expert-tensor-parallel-size", "2",
      "--moe-ffn-hidden-size", "33"], 2,
     r"--moe-ffn-hidden-size \(33\) must be divisible by --expert-tensor-parallel-size \(2\)"),
    (["--mid-level-dataset-surplus", "-0.01"], 1,
     r"--mid-level-dataset-surplus must be a finite number >= 0, got -0.01"),
])
def test_validation_errors(extra, world, pattern):
    with pytest.raises(ArgumentsError, match=pattern):
        validate_args(_args(BASE + extra, world_size=world))


def test_moe_with_the_fused_bias_gelu_is_accepted_where_megatron_accepts_it():
    """The loop over experts runs the fused bias-GeLU (with biases) or exact GeLU (without:
    Megatron turns the fusion off); only grouped GEMM with biases refuses it."""
    for extra in ([], ["--disable-bias-linear"], ["--disable-bias-linear", "--moe-grouped-gemm"],
                  ["--moe-grouped-gemm", "--no-bias-gelu-fusion"]):
        args = validate_args(_args(BASE + ["--num-experts", "4"] + extra, world_size=1))
        assert args.num_experts == 4 and args.bias_gelu_fusion == ("--no-bias-gelu-fusion"
                                                                   not in extra)


# Every size, count and interval flag with the smallest value it accepts: 0 only where it means
# something (no evaluation, no warmup, no workers, no manual GC, no extra ids).
SIZE_FLAGS = [
    ("--num-layers", 1), ("--encoder-num-layers", 1), ("--hidden-size", 1),
    ("--ffn-hidden-size", 1), ("--num-attention-heads", 1), ("--kv-channels", 1),
    ("--num-query-groups", 1), ("--max-position-embeddings", 1), ("--rotary-base", 1),
    ("--make-vocab-size-divisible-by", 1), ("--vocab-size", 1), ("--vocab-extra-ids", 0),
    ("--seq-length", 1), ("--encoder-seq-length", 1), ("--micro-batch-size", 1),
    ("--batch-size", 1), ("--global-batch-size", 1), ("--recompute-num-layers", 1),
    ("--train-iters", 1), ("--train-samples", 1), ("--lr-decay-iters", 1),
    ("--lr-decay-samples", 1), ("--lr-wsd-decay-iters", 1), ("--lr-wsd-decay-samples", 1),
    ("--lr-warmup-iters", 0), ("--lr-warmup-samples", 0), ("--warmup", 0),
    ("--log-interval", 1), ("--tensorboard-log-interval", 1), ("--tensorboard-queue-size", 1),
    ("--eval-iters", 0), ("--eval-interval", 1), ("--save-interval", 1), ("--exit-interval", 1),
    ("--exit-duration-in-mins", 1), ("--manual-gc-interval", 0), ("--loss-spike-window", 1),
    ("--hysteresis", 1), ("--num-workers", 0), ("--distributed-timeout-minutes", 1),
    ("--ddp-bucket-size", 1), ("--tensor-model-parallel-size", 1), ("--model-parallel-size", 1),
    ("--pipeline-model-parallel-size", 1), ("--num-layers-per-virtual-pipeline-stage", 1),
    ("--context-parallel-size", 1), ("--num-experts", 1), ("--expert-model-parallel-size", 1),
    ("--expert-tensor-parallel-size", 1), ("--moe-ffn-hidden-size", 1), ("--moe-router-topk", 1),
    ("--moe-shared-expert-intermediate-size", 1),
]


@pytest.mark.parametrize("flag,minimum", SIZE_FLAGS, ids=[f for f, _ in SIZE_FLAGS])
def test_size_flags_below_their_minimum_are_named(flag, minimum):
    """One below the minimum, and a negative value, stop validation with one line naming the
    flag and the value, before any size is derived from it (--global-batch-size 0 used to be
    reported as "lr decay steps ... must be > 0, got 0")."""
    for value in sorted({minimum - 1, -3}):
        with pytest.raises(ArgumentsError) as err:
            validate_args(_args(BASE + [flag, str(value)]))
        assert str(err.value) == f"{flag} must be >= {minimum}, got {value}"


@pytest.mark.parametrize("flag", [f for f, minimum in SIZE_FLAGS if minimum == 0])
def test_zero_is_accepted_where_it_means_something(flag):
    validate_args(_args(BASE + [flag, "0"]))


def test_expert_tensor_parallel_size_may_differ_from_tp():
    """Expert TP 2 over two data-parallel ranks, and expert TP 1 under TP 2: the experts
    re-cut the ranks of a stage; capacity dropping stays with whole micro-batches (TP 1)."""
    moe = ["--num-experts", "4", "--no-bias-gelu-fusion"]
    args = validate_args(_args(BASE + moe + ["--expert-tensor-parallel-size", "2",
                                             "--moe-expert-capacity-factor", "1.0",
                                             "--ckpt-format", "torch_dist", "--save", "/tmp/x"],
                               world_size=2))
    assert (args.tensor_model_parallel_size, args.expert_tensor_parallel_size) == (1, 2)
    args = validate_args(_args(BASE + moe + ["--tensor-model-parallel-size", "2",
                                             "--sequence-parallel",
                                             "--expert-tensor-parallel-size", "1",
                                             "--expert-model-parallel-size", "2"],
                               world_size=2))
    assert (args.expert_tensor_parallel_size, args.expert_model_parallel_size) == (1, 2)


def test_missing_required():
    with pytest.raises(ArgumentsError, match="--hidden-size"):
        validate_args(_args(["--num-layers", "2", "--num-attention-heads", "2",
                             "--seq-length", "8", "--micro-batch-size", "1"]))


def test_sequence_parallel_without_tp_is_dropped_with_note(capsys):
    args = validate_args(_args(BASE + ["--sequence-parallel"]))
    assert not args.sequence_parallel
    assert "--sequence-parallel has no effect" in capsys.readouterr().out


def test_old_flags_accepted_with_note(capsys):
    args = validate_args(_args(BASE + ["--data-impl", "mmap", "--dataset-impl", "lazy",
                                       "--checkpoint-activations"]))
    out = capsys.readouterr().out
    assert "--data-impl has no effect here" in out and "--dataset-impl has no effect here" in out
    assert args.recompute_granularity == "full" and args.recompute_method == "uniform"


def test_build_configs():
    args = validate_args(_args(BASE + ["--vocab-size", "500", "--tensor-model-parallel-size",
                                       "2", "--sequence-parallel", "--bf16", "--tokenizer-type",
                                       "NullTokenizer"], world_size=4))
    build_tokenizer(args)
    configs = build_configs(args)
    assert args.data_parallel_size == 2 and args.sequence_parallel
    assert configs.model.padded_vocab_size == 512 and configs.model.ffn_hidden_size == 256
    assert configs.model.params_dtype == torch.bfloat16
    assert args.accumulate_allreduce_grads_in_fp32 and configs.ddp.grad_reduce_in_fp32


def test_build_configs_returns_every_config_from_the_flags():
    """Each component's config holds its flags' values (the schedule's lengths in samples)."""
    args = validate_args(_args(CLASSIC_GPT2 + [
        "--overlap-grad-reduce", "--ddp-bucket-size", "4096", "--overlap-param-gather",
        "--no-save-optim", "--ckpt-format", "torch_dist", "--async-save", "--num-workers", "3",
        "--dataloader-type", "cyclic", "--reset-position-ids", "--lr-warmup-init", "1e-6",
        "--exit-interval", "7", "--check-for-nan-in-loss-and-grad", "--log-params-norm",
        "--timing-log-level", "2", "--tensorboard-log-interval", "5"],
        world_size=8))
    args.padded_vocab_size = 50304
    configs = build_configs(args)
    assert [f.name for f in dataclasses.fields(configs)] == [
        "model", "ddp", "checkpoint", "data", "optimizer", "scheduler", "moe", "training",
        "logging"]
    training, logging = configs.training, configs.logging
    assert (training.train_iters, training.eval_interval, training.eval_iters) == (
        args.train_iters, args.eval_interval, args.eval_iters)
    assert training.exit_interval == 7 and training.check_for_nan_in_loss_and_grad
    assert not training.skip_train and training.global_batch_size == args.global_batch_size
    assert (logging.log_interval, logging.tensorboard_log_interval) == (args.log_interval, 5)
    assert logging.log_params_norm and logging.timing_log_level == 2
    assert configs.moe is None  # a dense model
    assert configs.ddp == DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=True, overlap_param_gather=True,
        use_distributed_optimizer=True, bucket_size=4096, gradient_accumulation_fusion=True)
    ckpt = configs.checkpoint
    assert (ckpt.save, ckpt.load, ckpt.save_interval) == ("ckpts", "ckpts", 2000)
    assert ckpt.no_save_optim and ckpt.async_save and ckpt.ckpt_format == "torch_dist"
    assert ckpt.no_load_optim is None and not ckpt.finetune
    data = configs.data
    assert data.data_path == ["codeparrot_content_document"] and data.split == "969,30,1"
    assert (data.seq_length, data.micro_batch_size, data.seed) == (1024, 12, 1234)
    assert (data.num_workers, data.dataloader_type, data.reset_position_ids) == (3, "cyclic",
                                                                                 True)
    opt = configs.optimizer
    assert (opt.lr, opt.min_lr, opt.weight_decay, opt.clip_grad) == (5e-4, 1e-5, 0.1, 1.0)
    assert opt.fp16 and opt.params_dtype == torch.float16 and opt.use_distributed_optimizer
    sched = configs.scheduler
    assert (sched.init_lr, sched.max_lr, sched.min_lr) == (1e-6, 5e-4, 1e-5)
    assert sched.lr_decay_style == "cosine"
    assert (sched.lr_warmup_steps, sched.lr_decay_steps, sched.wd_incr_steps) == (
        2000 * 192, 150000 * 192, 150000 * 192)


def test_build_configs_schedule_in_samples_and_no_training():
    without_iters = [f for f in BASE if f not in ("--train-iters", "10")]
    args = validate_args(_args(without_iters + [
        "--lr", "1e-3", "--global-batch-size", "4", "--lr-warmup-samples", "8",
        "--lr-decay-samples", "80", "--train-samples", "100"]))
    args.padded_vocab_size = 128
    sched = build_configs(args).scheduler
    assert (sched.lr_warmup_steps, sched.lr_decay_steps, sched.wd_incr_steps) == (8, 80, 100)
    # Generation or evaluation flags (no --lr): no optimizer, no schedule.
    args = validate_args(_args(BASE))
    args.padded_vocab_size = 128
    configs = build_configs(args)
    assert configs.optimizer is None and configs.scheduler is None
    assert configs.checkpoint.save is None and configs.data.seq_length == 32


def _run_entry(argv, env_world="1"):
    code = ("import sys; from megatron.training.arguments import parse_and_validate; "
            "parse_and_validate(sys.argv[1:], prog='pretrain_gpt.py')")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env={"WORLD_SIZE": env_world, "PATH": "/usr/bin:/bin"}, timeout=120,
                          cwd=REPO_ROOT)


def test_entry_exit_codes():
    bad = _run_entry(BASE + ["--tensor-model-parallel-size", "3"], env_world="3")
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--tensor-model-parallel-size (3)" in lines[0], bad.stderr
    unknown = _run_entry(BASE + ["--no-such-flag"])
    assert unknown.returncode == 2 and "unrecognized arguments: --no-such-flag" in unknown.stderr


def test_uneven_pipeline_split():
    from megatron.core.config import pipeline_layer_counts

    args = validate_args(_args(BASE + ["--pipeline-model-parallel-size", "3",
                                       "--decoder-first-pipeline-num-layers", "2"], world_size=3))
    assert args.decoder_first_pipeline_num_layers == 2
    assert pipeline_layer_counts(4, 3, first=2) == [2, 1, 1]
    assert pipeline_layer_counts(10, 4, first=1, last=3) == [1, 3, 3, 3]
    assert pipeline_layer_counts(5, 2, last=4) == [1, 4]
    assert pipeline_layer_counts(8, 4) == [2, 2, 2, 2]
