"""The Megatron-LM flags of megatron_flags_table.py that work here act as Megatron defines them.

Each test sets the flag on the command line and checks what it does against a reference
written out independently (Megatron's rule in a few plain lines, a brute-force walk, a run
without the flag).
"""

import logging
import os
import signal
import types

import numpy as np
import pytest
import torch

from megatron.data.gpt_dataset import GPTDatasetConfig, build_train_valid_test_datasets
from megatron.optimizer.builder import get_param_groups
from megatron.training import log as training_log
from megatron.training import save_extras, training
from megatron.training.arguments import (ArgumentsError, build_configs, build_data_config,
                                         parse_args, validate_args)
from megatron.training.initialize import apply_process_settings
from tests.unit.test_gpt_dataset import expected_samples, random_docs, write_dataset

MINIMAL = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
           "--max-position-embeddings 8 --micro-batch-size 1").split()


def _args(*flags, world_size=1):
    args = parse_args(argv=MINIMAL + list(flags))
    args.world_size = world_size
    return validate_args(args)


def _configs(*flags):
    args = _args(*flags)
    args.padded_vocab_size = 64   # what the tokenizer sets before the configs are built
    return build_configs(args)


def test_megatron_aliases_set_the_same_dest():
    args = parse_args(argv=MINIMAL + ["--persistent-save-interval", "7",
                                      "--disable-log-loss-scale-to-tensorboard",
                                      "--no-check-for-nan-in-loss-and-grad"])
    assert args.save_interval == 7
    assert args.log_loss_scale_to_tensorboard is False
    assert args.check_for_nan_in_loss_and_grad is False


def test_logging_level_sets_the_root_logger():
    root = logging.getLogger()
    before = root.level
    try:
        apply_process_settings(_args("--logging-level", "40"))
        assert root.level == logging.ERROR
        root.setLevel(logging.INFO)
        apply_process_settings(_args())   # without the flag the level is left alone
        assert root.level == logging.INFO
    finally:
        root.setLevel(before)


def test_disable_bf16_reduced_precision_matmul():
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_bf16_reduced_precision_reduction
    try:
        matmul.allow_bf16_reduced_precision_reduction = True
        apply_process_settings(_args())
        assert matmul.allow_bf16_reduced_precision_reduction is True
        apply_process_settings(_args("--disable-bf16-reduced-precision-matmul"))
        assert matmul.allow_bf16_reduced_precision_reduction is False
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def test_exit_signal_is_the_signal_the_handler_waits_for():
    args = _args("--exit-signal-handler", "--exit-signal", str(int(signal.SIGUSR1)))
    previous = signal.getsignal(signal.SIGUSR1)
    stop = training._StopSignal(args.exit_signal)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1
    finally:
        stop.release()
    assert signal.getsignal(signal.SIGUSR1) == previous
    assert _args().exit_signal == signal.SIGTERM


def test_num_virtual_stages_per_pipeline_rank_splits_as_layers_per_stage():
    # (a global batch of two micro-batches: the interleaved schedule needs a multiple of pp)
    common = ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size",
              str(2 * _args().micro_batch_size)]
    by_stages = _args(*common, "--num-virtual-stages-per-pipeline-rank", "2", world_size=2)
    by_layers = _args(*common, "--num-layers-per-virtual-pipeline-stage", "2", world_size=2)
    # 8 layers over 2 stages: 4 per rank, in 2 virtual stages of 2 layers.
    assert by_stages.virtual_pipeline_model_parallel_size == 2
    assert by_stages.num_layers_per_virtual_pipeline_stage == 2
    assert (by_layers.virtual_pipeline_model_parallel_size
            == by_stages.virtual_pipeline_model_parallel_size)
    with pytest.raises(ArgumentsError, match="--num-virtual-stages-per-pipeline-rank 3"):
        _args(*common, "--num-virtual-stages-per-pipeline-rank", "3", world_size=2)


def test_recompute_modules_core_attn_is_selective_recompute():
    args = _args("--recompute-granularity", "selective", "--recompute-modules", "core_attn")
    assert args.recompute_granularity == "selective"
    assert _configs("--recompute-granularity", "selective", "--recompute-modules",
                    "core_attn").model.recompute_granularity == "selective"
    with pytest.raises(ArgumentsError) as err:
        _args("--recompute-granularity", "selective", "--recompute-modules", "core_attn",
              "mla_up_proj")
    assert str(err.value).startswith("--recompute-modules mla_up_proj recomputes multi-latent")


class _QKNormAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_qkv = torch.nn.Linear(4, 12)
        self.q_layernorm = torch.nn.LayerNorm(2)
        self.k_layernorm = torch.nn.LayerNorm(2)
        self.input_layernorm = torch.nn.LayerNorm(4)


def _decayed(model, config):
    """Names of the parameters whose group has weight decay."""
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names[id(p)] for g in get_param_groups([model], config)
                  if g["weight_decay"] > 0 for p in g["params"])


@pytest.mark.parametrize("flags", [["--apply-wd-to-qk-layernorm"],
                                   ["--no-weight-decay-cond-type", "apply_wd_to_qk_layernorm"]])
def test_weight_decay_on_qk_layernorm(flags):
    """Megatron's rule: 1-D parameters and biases get no weight decay, except (with the flag)
    those of q_layernorm / k_layernorm."""
    model = _QKNormAttention()
    plain = _configs("--lr", "1e-3").optimizer
    assert _decayed(model, plain) == ["linear_qkv.weight"]
    config = _configs("--lr", "1e-3", *flags).optimizer
    assert _decayed(model, config) == ["k_layernorm.bias", "k_layernorm.weight",
                                       "linear_qkv.weight", "q_layernorm.bias",
                                       "q_layernorm.weight"]


def test_eval_global_batch_size_sets_the_evaluation_step(monkeypatch):
    calls = []

    def schedule(**kw):
        calls.append(kw["num_microbatches"])
        return [{"lm loss": torch.tensor(1.0)}] * kw["num_microbatches"]

    monkeypatch.setattr(training, "get_forward_backward_func", lambda *a: schedule)
    monkeypatch.setattr(training, "schedule_kwargs", lambda *a: {})
    args = _args("--global-batch-size", "4", "--eval-global-batch-size", "6", world_size=2)
    pstate = types.SimpleNamespace(pp_size=1, virtual_pp_size=None, dp_size=2, dp_cp_group=None)
    calculator = types.SimpleNamespace(current_global_batch_size=4, num_micro_batches=2)
    state = types.SimpleNamespace(consumed_valid_samples=0)
    losses = training.evaluate(None, None, [torch.nn.Linear(1, 1)], args, pstate, calculator,
                               eval_iters=2, train_state=state)
    # Megatron: eval micro-batches = eval batch / (micro batch x dp) = 6 / (1 x 2) = 3.
    assert calls == [3, 3] and state.consumed_valid_samples == 12 and losses == {"lm loss": 1.0}
    args.train_iters, args.eval_interval, args.eval_iters = 10, 5, 2
    assert training._num_samples(args) == [40, 3 * 2 * 6, 2 * 6]
    with pytest.raises(ArgumentsError, match="--eval-global-batch-size"):
        _args("--eval-global-batch-size", "3", world_size=2)


def test_no_mmap_bin_files_reads_the_same_samples(tmp_path):
    prefix = str(tmp_path / "text_document")
    docs = random_docs(5, 30)
    write_dataset(prefix, docs)
    data = build_data_config(_args("--no-mmap-bin-files"))
    assert data.mmap_bin_files is False
    config = GPTDatasetConfig(seed=3, seq_length=5, split="1,0,0",
                              data_cache_path=str(tmp_path / "c"),
                              mmap_bin_files=data.mmap_bin_files)
    train, _, _ = build_train_valid_test_datasets(config, prefix, [20, 0, 0])
    want = expected_samples(docs, np.arange(30), 20, 5, 3)
    for i, w in enumerate(want):
        np.testing.assert_array_equal(train[i]["text"], w)
    buffer = train.indexed_dataset._bin_buffer
    assert isinstance(buffer, np.ndarray) and not isinstance(buffer, np.memmap)


def test_padded_vocab_size_is_used_as_given():
    from megatron.tokenizer import build_tokenizer

    args = _args("--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                 "--padded-vocab-size", "384")
    build_tokenizer(args)
    assert args.padded_vocab_size == 384
    args = _args("--tokenizer-type", "NullTokenizer", "--vocab-size", "100")
    build_tokenizer(args)
    assert args.padded_vocab_size == 128   # 101 ids (eod included) padded to 128
    with pytest.raises(ArgumentsError, match="--padded-vocab-size"):
        _args("--padded-vocab-size", "385", "--tensor-model-parallel-size", "2", world_size=2)


def _iteration_dirs(path):
    return sorted(n for n in os.listdir(path) if n.startswith("iter_"))


def test_save_retain_interval_keeps_multiples_and_the_latest(tmp_path):
    for it in (10, 20, 30, 40, 50, 60):
        os.makedirs(tmp_path / f"iter_{it:07d}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("50")
    removed = save_extras.prune_checkpoints(str(tmp_path), 20)
    # Kept: multiples of 20, the tracked checkpoint, and anything newer than it (a save that
    # is not published yet).
    assert removed == ["iter_0000010", "iter_0000030"]
    assert _iteration_dirs(tmp_path) == ["iter_0000020", "iter_0000040", "iter_0000050",
                                         "iter_0000060"]
    with pytest.raises(ArgumentsError, match="--save-retain-interval"):
        _args("--save-retain-interval", "20")


def test_log_progress_writes_megatrons_lines(tmp_path):
    args = _args("--log-progress", "--save", str(tmp_path), "--global-batch-size", "4")
    args.padded_vocab_size = 64
    state = types.SimpleNamespace(iteration=5, consumed_train_samples=20)
    run = types.SimpleNamespace(args=args, train_state=state)
    save_extras.append_progress(args.save, args.world_size, "Starting job")
    training._after_save(run)
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith("\t# GPUs: 1\tStarting job")
    fields = dict(f.split(": ", 1) for f in lines[1].split("\t")[1:] if ": " in f)
    assert fields["Iteration"] == "5"
    # 5 iterations of 4 sequences of 8 tokens; FLOPs: 5 x one iteration's.
    assert fields["Tokens (in billions)"] == f"{5 * 4 * 8 / 1e9:.2f}"
    per_iteration = training_log.num_floating_point_operations(args, 4)
    assert float(fields["Floating-point operations"]) == pytest.approx(5 * per_iteration,
                                                                      rel=1e-2)
    with pytest.raises(ArgumentsError, match="--log-progress"):
        _args("--log-progress")
