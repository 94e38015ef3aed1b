"""The fsdp_dtensor format's pieces that need no process group: names flattened exactly as
torch.distributed.checkpoint flattens them (torch's own function is the reference), the folder
told apart from torch_dist, and a byte entry that would run code refused before it runs."""

import argparse
import os

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from megatron.checkpoint import fsdp_dtensor
from megatron.checkpoint.dist import ObjectShard, TensorShard
from megatron.checkpoint.dist.reader import DistCheckpointReader
from megatron.checkpoint.dist.writer import save_shards
from megatron.checkpoint.layout import CheckpointError

TREE = {"args": argparse.Namespace(lr=0.1), "iteration": 3,
        "opt_param_scheduler": {"max_lr": 0.1, "num_steps": 24, "decay_style": "cosine"},
        "rng_state": {"(0, 1)": [{"random_rng_state": (3, (1, 2), None),
                                  "torch_rng_state": torch.arange(4, dtype=torch.uint8),
                                  "rng_tracker_states": {"model-parallel-rng": torch.ones(2)},
                                  "cuda_rng_state": None},
                                 {"random_rng_state": (3, (4,), None),
                                  "torch_rng_state": torch.zeros(4, dtype=torch.uint8),
                                  "rng_tracker_states": {}, "cuda_rng_state": None}]},
        "betas": [0.9, 0.95], "empty": {}}


def test_flattened_names_are_torch_dcp_names():
    ours = fsdp_dtensor.flatten(TREE)
    torch_names, _ = flatten_state_dict(TREE)
    assert sorted(ours) == sorted(torch_names)
    assert "rng_state.(0, 1).0.rng_tracker_states.model-parallel-rng" in ours
    assert ours["betas"] == [0.9, 0.95]


def _write(path, items):
    save_shards(str(path), items, backend=False)
    return str(path)


def test_round_trip_rebuilds_the_tree_and_tells_the_format(tmp_path):
    items = fsdp_dtensor._objects(fsdp_dtensor.flatten(TREE), True)
    items.append(TensorShard("model.module.embedding.word_embeddings.weight",
                             torch.ones(2, 3), (2, 3), (0, 0)))
    path = _write(tmp_path / "iter_0000003", items)
    assert fsdp_dtensor.is_fsdp_dtensor_checkpoint(path)
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    reader = DistCheckpointReader(path)
    rng = fsdp_dtensor.read_tree(reader, "rng_state.(0, 1)")
    assert isinstance(rng, list) and len(rng) == 2
    assert torch.equal(rng[0]["torch_rng_state"], torch.arange(4, dtype=torch.uint8))
    assert rng[0]["random_rng_state"] == (3, (1, 2), None)
    assert fsdp_dtensor.read_tree(reader, "opt_param_scheduler") == TREE["opt_param_scheduler"]
    assert fsdp_dtensor.saved_args(path).lr == 0.1


def test_torch_dist_folder_is_not_taken_for_fsdp_dtensor(tmp_path):
    path = str(tmp_path / "iter_0000001")
    save_shards(path, [TensorShard("embedding.word_embeddings.weight", torch.ones(2, 2), (2, 2),
                                   (0, 0))])
    assert not fsdp_dtensor.is_fsdp_dtensor_checkpoint(path)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_byte_entry_that_would_run_code_is_refused(tmp_path):
    path = _write(tmp_path / "iter_0000001", [ObjectShard("args", _RunsCode(), listed=False)])
    with pytest.raises(CheckpointError, match=r"iter_0000001: byte entry .args.: refusing .*system"):
        fsdp_dtensor.saved_args(path)


# -- the converter's view of the folder --------------------------------------------------------

FC1 = "decoder.layers.1.mlp.linear_fc1.weight"


def _halves_folder(tmp_path, args):
    """A folder as two FSDP ranks write a SwiGLU fc1: each half stored in two row chunks."""
    w, v = torch.arange(24.).reshape(4, 6), -torch.arange(24.).reshape(4, 6)
    items = [ObjectShard("args", args, listed=False)]
    for name, half in (("weight_w", w), ("weight_v", v)):
        for start in (0, 2):
            items.append(TensorShard(f"model.module.decoder.layers.1.mlp.linear_fc1.{name}",
                                     half[start:start + 2].clone(), (4, 6), (start, 0)))
    items.append(TensorShard("model.module.decoder.final_layernorm.weight", torch.ones(6),
                             (6,), (0,)))
    items.append(TensorShard("optimizer.state.module.module.module.decoder.final_layernorm."
                             "weight.exp_avg", torch.ones(6), (6,), (0,)))
    return _write(tmp_path / "iter_0000002", items), w, v


def test_converter_view_joins_swiglu_halves_under_torch_dist_keys(tmp_path):
    from megatron.convert.fsdp_io import open_fsdp

    path, w, v = _halves_folder(tmp_path, argparse.Namespace(num_layers=2, num_experts=None))
    view, common = open_fsdp(path)
    assert common["args"].num_layers == 2
    assert view.tensor_keys() == ["decoder.final_layernorm.weight", FC1]
    assert FC1 in view and FC1 + "_w" not in view
    assert view.shape(FC1) == (8, 6)
    assert torch.equal(view.read(FC1), torch.cat([w, v]))
    assert torch.equal(view.read(FC1, (3, 2), (2, 3)), torch.cat([w, v])[3:5, 2:5])


def test_converter_refuses_a_mixture_of_experts_in_one_line(tmp_path, capsys):
    from tools.checkpoint.convert import main

    _halves_folder(tmp_path / "ckpt", argparse.Namespace(num_layers=2, num_experts=4))
    with open(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt", "w") as f:
        f.write("2")
    with pytest.raises(SystemExit) as exit_:
        main(["--model-type", "GPT", "--load-dir", str(tmp_path / "ckpt"),
              "--save-dir", str(tmp_path / "out")])
    assert exit_.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "a mixture of experts (--num-experts 4)" in err and "cannot be converted" in err
    assert not os.path.exists(tmp_path / "out")
