"""--ckpt-format torch_dcp outside a fully sharded run is refused in one line, as Megatron-LM
refuses it (its argument checks: --use-torch-fsdp2, tensor and pipeline size 1); the folder is
told apart from fsdp_dtensor's by its model keys."""

import pytest

from megatron.checkpoint import fsdp_dtensor, torch_dcp
from megatron.checkpoint.dist import TensorShard
from megatron.checkpoint.dist.writer import save_shards
from megatron.training.arguments import ArgumentsError, parse_args, validate_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 10 "
        "--ckpt-format torch_dcp").split()


def _validate(extra, world_size):
    args = parse_args(argv=BASE + extra)
    args.world_size = world_size
    return validate_args(args)


@pytest.mark.parametrize("extra, world, seen", [
    ([], 1, "got no --use-torch-fsdp2, tensor size 1, pipeline size 1"),
    (["--use-torch-fsdp2", "--tensor-model-parallel-size", "2"], 2,
     "got --use-torch-fsdp2, tensor size 2, pipeline size 1"),
    (["--use-torch-fsdp2", "--pipeline-model-parallel-size", "2"], 2,
     "got --use-torch-fsdp2, tensor size 1, pipeline size 2"),
])
def test_refused_outside_fsdp2_at_tensor_and_pipeline_size_1(extra, world, seen):
    with pytest.raises(ArgumentsError) as err:
        _validate(extra, world)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("--ckpt-format torch_dcp: --ckpt-format torch_dcp is written and "
                              "read only with --use-torch-fsdp2")
    assert seen in message


def test_accepted_under_fsdp2_at_data_parallel_size_2():
    args = _validate(["--use-torch-fsdp2"], 2)
    assert args.ckpt_format == "torch_dcp"


def test_folder_is_told_apart_from_fsdp_dtensor(tmp_path):
    import torch

    def write(name, key):
        path = str(tmp_path / name)
        save_shards(path, [TensorShard(key, torch.ones(2, 2), (2, 2), (0, 0))], backend=False)
        return path

    dcp = write("dcp", "model.embedding.word_embeddings.weight")
    fsdp = write("fsdp", "model.module.embedding.word_embeddings.weight")
    assert torch_dcp.is_torch_dcp_checkpoint(dcp)
    assert not torch_dcp.is_torch_dcp_checkpoint(fsdp)
    assert fsdp_dtensor.is_fsdp_dtensor_checkpoint(fsdp)
    assert not torch_dcp.is_torch_dcp_checkpoint(str(tmp_path / "missing"))
