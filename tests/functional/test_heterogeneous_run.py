"""A heterogeneous GPT (``--heterogeneous-layers-config-path``: a no-op attention, linear
replacements, per-layer query groups and MLP sizes) end to end: its loss falls, TP 2 (with and
without sequence parallelism) gives one process's losses, a run resumed from either checkpoint
format repeats the uninterrupted run's losses bit for bit, the config travels in the saved
arguments, and a bad config stops the run with a line naming the file and the key."""

import json
import os

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

BLOCKS = [
    {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
     "ffn": {"ffn_mult": None, "intermediate_size": 48, "no_op": False,
             "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
     "ffn": {"no_op": False, "replace_with_linear": True}},
    {"attention": {"no_op": False, "replace_with_linear": True},
     "ffn": {"intermediate_size": 96, "no_op": False, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": 1, "no_op": False, "replace_with_linear": False},
     "ffn": {"no_op": True, "replace_with_linear": False}},
]


def _config(tmp_path, blocks=None) -> str:
    path = str(tmp_path / "config.json")
    with open(path, "w") as f:
        json.dump({"architectures": ["DeciLMForCausalLM"], "num_hidden_layers": 4,
                   "block_configs": BLOCKS if blocks is None else blocks}, f)
    return path


def _flags(corpus, config, iters, extra=()):
    flags = gpt_flags(corpus, iters, dropout=0.0, extra=[
        "--heterogeneous-layers-config-path", config, "--normalization", "RMSNorm",
        "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope"] + list(extra))
    at = flags.index("--num-layers")
    flags[at + 1] = "4"
    return flags


def _run(flags, tp=1):
    return run_on_ranks(run_pretrain, tp, flags)[-1]


@pytest.mark.slow
def test_trains_and_tp2_equals_one_process(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    config = _config(tmp_path)
    one = _run(_flags(corpus, config, 8, ["--lr", "2e-2"]))
    losses = [loss for _, loss in one["losses"]]
    assert sum(losses[-2:]) < sum(losses[:2]) - 0.5, losses
    for extra in ([], ["--sequence-parallel"]):
        flags = _flags(corpus, config, 8, ["--lr", "2e-2"] + extra)
        flags[flags.index("--tensor-model-parallel-size") + 1] = "2"
        two = _run(flags, tp=2)
        torch.testing.assert_close(torch.tensor([loss for _, loss in two["losses"]]),
                                   torch.tensor(losses),
                                   rtol=1e-5, atol=1e-5, msg=str(extra))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_bit_identical(tmp_path, fmt, capsys):
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    config = _config(tmp_path)
    save = str(tmp_path / "ckpt")
    ckpt = ["--ckpt-format", fmt, "--save", save, "--save-interval", "3"]
    full = _run(_flags(corpus, config, 6, ckpt))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    _converter_refuses(save, tmp_path, capsys)
    os.remove(config)   # the resumed run reads the config from the checkpoint's arguments
    flags = _flags(corpus, config, 6, ["--ckpt-format", fmt, "--load", save,
                                       "--use-checkpoint-args"])
    at = flags.index("--heterogeneous-layers-config-path")
    resumed = _run(flags[:at] + flags[at + 2:])
    assert resumed["losses"] == full["losses"][3:]


def _converter_refuses(save, tmp_path, capsys):
    from tools.checkpoint.convert import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model-type", "GPT", "--load-dir", save, "--save-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    assert "--heterogeneous-layers-config-path: the converter does not know per-layer " \
        "shapes" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def test_a_bad_config_names_the_file_and_the_key(tmp_path, capsys):
    from megatron.training.arguments import parse_and_validate

    blocks = [dict(b) for b in BLOCKS]
    blocks[2] = {"attention": {"n_heads_in_group": 3}, "ffn": {}}
    config = _config(tmp_path, blocks)
    flags = _flags("unused", config, 1)
    with pytest.raises(SystemExit):
        parse_and_validate(flags, prog="pretrain_gpt.py")
    err = capsys.readouterr().err.strip()
    assert err == (f"pretrain_gpt.py: error: {config}: block_configs[2].attention."
                   f"n_heads_in_group: --num-attention-heads (4) must be a multiple of it (3)")
    with pytest.raises(SystemExit):
        parse_and_validate(_flags("unused", str(tmp_path / "missing.json"), 1),
                           prog="pretrain_gpt.py")
    assert "--heterogeneous-layers-config-path " + str(tmp_path / "missing.json") + \
        ": cannot read it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_and_validate(_flags("unused", _config(tmp_path), 1, ["--num-experts", "2"]),
                           prog="pretrain_gpt.py")
    assert "is not built with --num-experts" in capsys.readouterr().err


@pytest.mark.slow
def test_pp2_equals_one_process(tmp_path):
    """Stages hold layers of different shapes; the blocks follow the global layer number."""
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    config = _config(tmp_path)
    one = _run(_flags(corpus, config, 4))
    two = _run(_flags(corpus, config, 4, ["--pipeline-model-parallel-size", "2"]), tp=2)
    torch.testing.assert_close(torch.tensor([loss for _, loss in two["losses"]]),
                               torch.tensor([loss for _, loss in one["losses"]]),
                               rtol=1e-5, atol=1e-5)
