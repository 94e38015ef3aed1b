"""--use-checkpoint-args with --use-mp-args-from-checkpoint-args and
--no-use-tokenizer-model-from-checkpoint-args: which saved flags a run takes, as Megatron's
load_args_from_checkpoint takes them."""

import argparse
import os

import pytest

from megatron.checkpoint import load as ckpt_load
from megatron.training.arguments import parse_args

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "megatron_written")

SAVED = argparse.Namespace(
    num_layers=6, hidden_size=48, num_attention_heads=6, tensor_model_parallel_size=4,
    pipeline_model_parallel_size=2, expert_model_parallel_size=2,
    num_layers_per_virtual_pipeline_stage=1, tokenizer_type="TikTokenizer",
    tokenizer_model="/saved/tok.json", tiktoken_pattern="v2")

RUN = ["--load", "ckpt", "--use-checkpoint-args", "--num-layers", "2",
       "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
       "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "/mine"]


def _loaded(monkeypatch, extra):
    monkeypatch.setattr(ckpt_load, "_saved_args_in", lambda folder, flag, verify=False: SAVED)
    return ckpt_load.load_args_from_checkpoint(parse_args(argv=RUN + extra))


def _view(args):
    return {k: getattr(args, k) for k in vars(SAVED)}


def test_default_takes_shape_and_tokenizer_not_parallel_sizes(monkeypatch):
    got = _view(_loaded(monkeypatch, []))
    assert got == dict(vars(SAVED), tensor_model_parallel_size=2,
                       pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                       num_layers_per_virtual_pipeline_stage=None)


def test_mp_args_from_checkpoint(monkeypatch):
    assert _view(_loaded(monkeypatch, ["--use-mp-args-from-checkpoint-args"])) == vars(SAVED)


def test_mp_args_keep_the_runs_virtual_stages(monkeypatch):
    """Megatron takes the virtual-stage size only when the run gives none."""
    got = _loaded(monkeypatch, ["--use-mp-args-from-checkpoint-args",
                                "--num-layers-per-virtual-pipeline-stage", "3"])
    assert got.num_layers_per_virtual_pipeline_stage == 3
    assert got.tensor_model_parallel_size == 4


def test_no_tokenizer_model_from_checkpoint(monkeypatch):
    got = _loaded(monkeypatch, ["--no-use-tokenizer-model-from-checkpoint-args"])
    assert (got.tokenizer_type, got.tokenizer_model, got.tiktoken_pattern) == (
        "HuggingFaceTokenizer", "/mine", None)
    assert got.num_layers == 6


@pytest.mark.parametrize("extra,tp", [([], 2), (["--use-mp-args-from-checkpoint-args"], 1)])
def test_a_megatron_written_file(extra, tp):
    """The legacy TP=1 file Megatron-LM wrote: its shape always, its TP size only when asked."""
    args = parse_args(argv=["--load", os.path.join(DATA, "legacy_tp1"), "--use-checkpoint-args",
                            "--tensor-model-parallel-size", "2"] + extra)
    got = ckpt_load.load_args_from_checkpoint(args)
    assert got.num_layers == 4 and got.tokenizer_type == "NullTokenizer"
    assert got.tensor_model_parallel_size == tp
