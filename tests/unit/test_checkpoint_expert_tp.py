"""The torch format refuses experts split otherwise than by TP, in one line naming the flags.

Megatron's torch format names rank folders ``mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}`` by the
tensor and expert ranks only: with ``--expert-tensor-parallel-size`` != TP two ranks would
write one folder (or no folder would hold some expert pieces). Saving, loading into such a run,
loading a file whose saved args say so, and converting that file are all refused before
anything is written or loaded.
"""

import argparse
import os
import types

import pytest
import torch

from megatron.training import checkpointing
from megatron.checkpoint.config import CheckpointConfig
from megatron.convert import megatron_io
from megatron.convert.schema import ConversionError
from megatron.core.config import ConfigError

FLAGS = (r"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp}: its "
         r"rank folders are named by tensor and expert rank only")


def _flags(etp, tp):
    return FLAGS.format(etp=etp, tp=tp)


def test_config_refuses_writing_the_torch_format():
    for config in (CheckpointConfig(ckpt_format="torch", save="out"),
                   CheckpointConfig(ckpt_format="torch_dist", load="in", save="out",
                                    ckpt_convert_format="torch", ckpt_convert_save="conv")):
        with pytest.raises(ConfigError, match=r"^--ckpt-(convert-)?format torch cannot save "
                           + _flags(1, 2) + r".*; use --ckpt-format torch_dist$"):
            config.check_expert_tensor_parallel(2, 1)
    torch_format = dict(ckpt_format="torch")
    CheckpointConfig(save="out", **torch_format).check_expert_tensor_parallel(2, 2)  # etp = tp
    CheckpointConfig(save="out", **torch_format).check_expert_tensor_parallel(2, None)  # dense
    CheckpointConfig(load="in", **torch_format).check_expert_tensor_parallel(2, 1)  # no save
    CheckpointConfig(save="out", ckpt_format="torch_dist").check_expert_tensor_parallel(1, 2)
    CheckpointConfig(save="out").check_expert_tensor_parallel(2, 1)   # the default: torch_dist


def _pstate(tp=1, etp=1):
    return types.SimpleNamespace(tp_size=tp, tp_rank=0, pp_size=1, pp_rank=0, dp_rank=0,
                                 dp_cp_rank=0, ep_group=None,
                                 layout=types.SimpleNamespace(tp_size=tp, expert_tp_size=etp))


def _args(**fields):
    base = dict(ckpt_format="torch", num_experts=4, save=None, load=None, ckpt_step=None,
                exit_on_missing_checkpoint=False, finetune=False, no_load_optim=False,
                no_load_rng=False)
    return argparse.Namespace(**dict(base, **fields))


@pytest.mark.parametrize("async_save", [False, True])
def test_torch_save_at_expert_tp_is_refused_before_writing(tmp_path, async_save):
    args = _args(save=str(tmp_path / "save"))
    with pytest.raises(checkpointing.CheckpointError, match=r"^--ckpt-format torch cannot save "
                       + _flags(2, 1)):
        if async_save:
            checkpointing.AsyncCheckpointSaver().save(1, [], None, None, args,
                                                      _pstate(tp=1, etp=2))
        else:
            checkpointing.save_checkpoint(1, [], None, None, args, _pstate(tp=1, etp=2))
    assert not os.path.exists(tmp_path / "save")


def _torch_checkpoint(root, etp, tp=1):
    """A torch-format folder (one rank file) whose saved args hold ``etp`` under ``tp``."""
    saved = argparse.Namespace(num_experts=4, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                               expert_tensor_parallel_size=etp, num_layers=1)
    path = checkpointing.checkpoint_file(str(root), 1, 0, 0, 1)
    os.makedirs(os.path.dirname(path))
    torch.save({"args": saved, "iteration": 1, "model": {"language_model": {}}}, path)
    with open(os.path.join(root, checkpointing.TRACKER_FILENAME), "w") as f:
        f.write("1")
    return str(root)


def test_torch_checkpoint_does_not_load_into_a_run_at_expert_tp(tmp_path):
    load = _torch_checkpoint(tmp_path, etp=1)
    with pytest.raises(checkpointing.CheckpointError,
                       match=r"iter_0000001: a --ckpt-format torch checkpoint cannot load at "
                       + _flags(2, 1) + r".*--ckpt-convert-format torch_dist"):
        checkpointing.load_checkpoint([], None, None, _args(load=load), _pstate(tp=1, etp=2))


@pytest.mark.parametrize("weights_only", [False, True])
def test_torch_checkpoint_saved_at_expert_tp_is_refused(tmp_path, weights_only):
    """Megatron-LM's own torch-format file of a run at expert TP 2 under TP 1."""
    load = _torch_checkpoint(tmp_path, etp=2)
    match = (r"model_optim_rng.pt: a --ckpt-format torch checkpoint saved at " + _flags(2, 1)
             + r".*save it with --ckpt-format torch_dist")
    with pytest.raises(checkpointing.CheckpointError, match=match):
        if weights_only:
            checkpointing.load_model_weights([], _args(load=load), _pstate())
        else:
            checkpointing.load_checkpoint([], None, None, _args(load=load), _pstate())


def test_converter_refuses_a_torch_source_saved_at_expert_tp(tmp_path):
    load = _torch_checkpoint(tmp_path, etp=2)
    with pytest.raises(ConversionError, match=r"iter_0000001: a --ckpt-format torch checkpoint "
                       r"saved at " + _flags(2, 1)):
        megatron_io._Source(load, None)
