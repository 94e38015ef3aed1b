"""--config-logger-dir: the files Megatron's config logger writes, with its names, in one
process (megatron/core/config_logger.py). The 2-rank run is in
tests/functional/test_config_logger_run.py."""

import json
import os
import types
from collections import OrderedDict

import pytest
import torch

from megatron.core import config_logger
from megatron.core.config import ConfigError
from megatron.model import GPTModel
from megatron.model.bert_model import BertModel
from tests.unit.test_gpt_model import loss_and_grads, make_batch, make_config

RANK0 = "0_0_0_0_0"


def _state(tp_rank=0, dp_rank=0, cp_rank=0, pp_rank=0):
    """One process's layout, with the ranks the rank string reads."""
    return types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=tp_rank, dp_rank=dp_rank,
                                 cp_rank=cp_rank, pp_size=1, pp_rank=pp_rank,
                                 virtual_pp_size=None, virtual_pp_rank=None, ep_group=None)


def _gpt(directory="", seed=1234):
    torch.manual_seed(0)
    return GPTModel(make_config(config_logger_dir=str(directory)), _state(), init_seed=seed)


def test_rank_string_is_megatrons_tp_dp_cp_pp_ep():
    assert config_logger.rank_string(_state(tp_rank=1, dp_rank=2, cp_rank=3, pp_rank=4)) \
        == "1_2_3_4_0"
    # A minimal layout object (as the model tests build) counts its unknown ranks as 0.
    assert config_logger.rank_string(types.SimpleNamespace(tp_rank=1)) == "1_0_0_0_0"


def test_gpt_writes_its_arguments_weights_and_each_forward(tmp_path):
    model = _gpt(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [f"GPTModel.rank_{RANK0}.iter0.json",
                                            f"GPTModel_init_ckpt.rank_{RANK0}.iter0.pth"]
    with open(tmp_path / f"GPTModel.rank_{RANK0}.iter0.json") as f:
        args = json.load(f)
    assert {"config", "pstate", "pre_process", "post_process", "init_seed"} <= set(args)
    assert "self" not in args and "__class__" not in args
    config = args["config"]
    assert (config["num_layers"], config["hidden_size"], config["num_attention_heads"]) \
        == (2, 32, 4)
    assert config["params_dtype"] == "torch.float64"
    assert config["config_logger_dir"] == str(tmp_path)
    assert args["init_seed"] == 1234 and "tp_rank=0" in args["pstate"]

    weights = torch.load(tmp_path / f"GPTModel_init_ckpt.rank_{RANK0}.iter0.pth")
    assert isinstance(weights, OrderedDict) and weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())

    ids, pos, labels = make_batch()
    model(ids, pos, None, labels=labels)
    logits = model(ids, pos, None)                                          # [b, s, V]
    first = torch.load(tmp_path / f"input_and_logits.rank_{RANK0}.iter0.pth")
    second = torch.load(tmp_path / f"input_and_logits.rank_{RANK0}.iter1.pth")
    assert list(first) == ["input_ids", "position_ids", "attention_mask", "decoder_input",
                           "logits"]
    assert torch.equal(first["input_ids"], ids) and first["attention_mask"] is None
    assert first["decoder_input"].shape == (16, 2, 32)                      # [s, b, h]
    assert torch.equal(second["logits"].transpose(0, 1), logits)            # [s, b, V]


def test_the_count_goes_up_for_each_model_of_a_class(tmp_path):
    _gpt(tmp_path)
    _gpt(tmp_path)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".json"))
    assert names == [f"GPTModel.rank_{RANK0}.iter0.json", f"GPTModel.rank_{RANK0}.iter1.json"]


def test_bert_writes_its_arguments(tmp_path):
    BertModel(make_config(config_logger_dir=str(tmp_path)), _state(), num_tokentypes=2)
    assert os.listdir(tmp_path) == [f"BertModel.rank_{RANK0}.iter0.json"]
    with open(tmp_path / f"BertModel.rank_{RANK0}.iter0.json") as f:
        args = json.load(f)
    assert args["num_tokentypes"] == 2 and args["config"]["hidden_size"] == 32


def test_without_the_directory_nothing_is_written(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise AssertionError("written without --config-logger-dir")

    monkeypatch.setattr(config_logger, "log_config_to_disk", refuse)
    model = _gpt()
    ids, pos, labels = make_batch()
    model(ids, pos, None, labels=labels)


def test_losses_and_gradients_are_the_same_with_the_logger(tmp_path):
    batch = make_batch()
    want_loss, want_grads = loss_and_grads(_gpt(), batch)
    got_loss, got_grads = loss_and_grads(_gpt(tmp_path), batch)
    assert torch.equal(got_loss, want_loss)
    assert all(torch.equal(got_grads[k], want_grads[k]) for k in want_grads)


def test_the_directory_is_created(tmp_path):
    config_logger.check_config_logger_dir(str(tmp_path / "a" / "b"))
    assert os.listdir(tmp_path / "a" / "b") == []   # the write probe is gone


def test_an_unwritable_directory_stops_in_one_line_naming_flag_and_path(tmp_path):
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "logs")
    with pytest.raises(ConfigError) as err:
        config_logger.check_config_logger_dir(bad)
    message = str(err.value)
    assert message.startswith(f"--config-logger-dir {bad} is not writable") and "\n" not in message


def test_json_of_values_json_has_no_type_for():
    value = {"dtype": torch.bfloat16, "fn": torch.nn.functional.gelu, (1, 2): [1, (2, 3)],
             "module": torch.nn.Sequential(torch.nn.Linear(2, 2)), "none": None}
    out = json.loads(json.dumps(config_logger.jsonable(value)))
    assert out["dtype"] == "torch.bfloat16" and "gelu" in out["fn"]
    assert out["(1, 2)"] == [1, [2, 3]] and out["none"] is None
    assert out["module"] == {"0": "Linear(in_features=2, out_features=2, bias=True)"}


@pytest.mark.parametrize("flags, want", [([], ""), (["--config-logger-dir", "/x/logs"],
                                                    "/x/logs")])
def test_the_flag_reaches_the_model_config(flags, want):
    from megatron.training.arguments import build_configs, parse_args, validate_args

    args = parse_args(argv=("--num-layers 2 --hidden-size 16 --num-attention-heads 2 "
                            "--seq-length 8 --max-position-embeddings 8 "
                            "--micro-batch-size 1").split() + flags)
    args.world_size = 1
    args = validate_args(args)
    args.padded_vocab_size = 64
    assert build_configs(args).model.config_logger_dir == want
