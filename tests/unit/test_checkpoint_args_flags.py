"""--use-checkpoint-args with --use-mp-args-from-checkpoint-args and
--no-use-tokenizer-model-from-checkpoint-args: which saved flags a run takes, as Megatron's
load_args_from_checkpoint takes them: only values the checkpoint recorded (never a None over a
run's flag), the model sizes and sequence length only where the run gives none, the rest (the
mixture-of-experts routing among them) from the file, with one note naming each flag of the
run it replaced."""

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


def test_default_takes_shape_and_tokenizer_not_parallel_sizes(monkeypatch, capsys):
    got = _view(_loaded(monkeypatch, []))
    # The run's --num-layers 2 stays (Megatron's default for it is None: a run that gives it
    # keeps it, and a load of the 6-layer file then refuses it by flag).
    assert got == dict(vars(SAVED), num_layers=2, tensor_model_parallel_size=2,
                       pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                       num_layers_per_virtual_pipeline_stage=None)
    note = capsys.readouterr().out
    assert note.count("NOTE") == 1
    assert "--tokenizer-type HuggingFaceTokenizer -> TikTokenizer" in note
    assert "--tokenizer-model /mine -> /saved/tok.json" in note


def test_mp_args_from_checkpoint(monkeypatch):
    assert _view(_loaded(monkeypatch, ["--use-mp-args-from-checkpoint-args"])) == dict(
        vars(SAVED), num_layers=2)


def test_a_value_the_checkpoint_did_not_record_leaves_the_runs(monkeypatch, capsys):
    """A converted checkpoint may name no tokenizer: the run's stays (before, a None replaced
    it and the run failed building a tokenizer of type None)."""
    blank = argparse.Namespace(**dict(vars(SAVED), tokenizer_type=None, tokenizer_model=None,
                                      hidden_size=None))
    monkeypatch.setattr(ckpt_load, "_saved_args_in", lambda folder, flag, verify=False: blank)
    got = ckpt_load.load_args_from_checkpoint(parse_args(argv=RUN))
    assert (got.tokenizer_type, got.tokenizer_model) == ("HuggingFaceTokenizer", "/mine")
    assert got.hidden_size is None and got.num_attention_heads == 6
    assert "NOTE" not in capsys.readouterr().out


def test_sizes_are_the_runs_when_given_and_routing_is_the_files(monkeypatch, capsys):
    """--seq-length of the run stays (a longer context from a shorter-context checkpoint), as
    do its sizes; the experts, their routing, the MTP depth and the dropout come from the file,
    each flag the run set otherwise named once."""
    moe = argparse.Namespace(**dict(
        vars(SAVED), seq_length=128, max_position_embeddings=128, num_experts=8,
        moe_router_topk=4, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1, 1, 1, 1, 1],
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
        moe_shared_expert_intermediate_size=32, mtp_num_layers=1, hidden_dropout=0.0,
        attention_dropout=0.0))
    monkeypatch.setattr(ckpt_load, "_saved_args_in", lambda folder, flag, verify=False: moe)
    got = ckpt_load.load_args_from_checkpoint(parse_args(argv=RUN + [
        "--seq-length", "512", "--moe-router-topk", "3", "--hidden-dropout", "0.2"]))
    assert (got.seq_length, got.max_position_embeddings) == (512, 128)
    assert (got.num_experts, got.moe_router_topk, got.moe_ffn_hidden_size) == (8, 4, 16)
    assert got.moe_layer_freq == [0, 1, 1, 1, 1, 1] and got.mtp_num_layers == 1
    assert (got.moe_router_score_function, got.moe_router_enable_expert_bias,
            got.moe_router_num_groups, got.moe_router_group_topk) == ("sigmoid", True, 4, 2)
    assert (got.hidden_dropout, got.attention_dropout) == (0.0, 0.0)
    note = capsys.readouterr().out
    assert "--moe-router-topk 3 -> 4" in note and "--hidden-dropout 0.2 -> 0.0" in note
    assert "--seq-length" not in note and "--attention-dropout" not in note


def test_a_dense_checkpoint_leaves_no_expert_size(monkeypatch):
    monkeypatch.setattr(ckpt_load, "_saved_args_in", lambda folder, flag, verify=False: SAVED)
    got = ckpt_load.load_args_from_checkpoint(parse_args(argv=RUN + [
        "--moe-ffn-hidden-size", "64"]))
    assert got.num_experts is None and got.moe_ffn_hidden_size is None


def test_mp_args_keep_the_runs_virtual_stages(monkeypatch):
    """Megatron takes the virtual-stage size only when the run gives none."""
    got = _loaded(monkeypatch, ["--use-mp-args-from-checkpoint-args",
                                "--num-layers-per-virtual-pipeline-stage", "3"])
    assert got.num_layers_per_virtual_pipeline_stage == 3
    assert got.tensor_model_parallel_size == 4


def test_no_tokenizer_model_from_checkpoint(monkeypatch):
    got = _loaded(monkeypatch, ["--no-use-tokenizer-model-from-checkpoint-args"])
    # Megatron takes the tiktoken pattern whatever that flag says.
    assert (got.tokenizer_type, got.tokenizer_model, got.tiktoken_pattern) == (
        "HuggingFaceTokenizer", "/mine", "v2")
    assert got.num_layers == 2 and got.hidden_size == 48


@pytest.mark.parametrize("extra,tp", [([], 2), (["--use-mp-args-from-checkpoint-args"], 1)])
def test_a_megatron_written_file(extra, tp):
    """The legacy TP=1 file Megatron-LM wrote: its shape always, its TP size only when asked."""
    args = parse_args(argv=["--load", os.path.join(DATA, "legacy_tp1"), "--use-checkpoint-args",
                            "--tensor-model-parallel-size", "2"] + extra)
    got = ckpt_load.load_args_from_checkpoint(args)
    assert got.num_layers == 4 and got.tokenizer_type == "NullTokenizer"
    assert got.tensor_model_parallel_size == tp
