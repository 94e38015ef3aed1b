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
