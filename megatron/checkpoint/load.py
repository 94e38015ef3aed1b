"""Save and load checkpoints in Megatron's layout (``--ckpt-format torch``), atomically and safely.

This module is the entry point: :func:`save_checkpoint`, :class:`AsyncCheckpointSaver`,
:func:`load_checkpoint`, :func:`load_args_from_checkpoint`, :func:`load_model_weights` and every
name of the modules below are reached as ``megatron.checkpoint.load.<name>``. It holds the loading;
the rest is split by concern:

* :mod:`megatron.checkpoint.layout`: the folder and file names of Megatron-LM's layout
  (FORMATS.md section 6), the tracker, the saved sizes, reading one rank's file;
* :mod:`megatron.checkpoint.saved_args`: the ``args`` a checkpoint records and the checks a load
  makes of them (model-shape flags, expert-TP layouts the torch format cannot hold);
* :mod:`megatron.checkpoint.save`: the atomic save (staging folder, rename, tracker), the
  crash-test hook ``MEGATRON_TEST_CRASH_AT``, ``--async-save``, the RNG states;
* :mod:`megatron.checkpoint.experts` (a checkpoint saved at another expert-parallel size) and
  :mod:`megatron.checkpoint.torch_dist` (``--ckpt-format torch_dist``).

Reading: ``torch.load(weights_only=True)`` with a short allow-list of plain types and
Megatron-LM's own classes read as inert stand-ins (:mod:`megatron.checkpoint.safe_unpickle`), so a
checkpoint from a stranger cannot run code and one written by Megatron-LM opens; every key and
shape is checked before anything is copied into the model, so a failed load never leaves a
half-loaded model. A checkpoint written by the conversion tool without optimizer or RNG states
resumes training with fresh ones, and says so.
"""

import argparse
import dataclasses
import os
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.checkpoint.config import CheckpointConfig
# Re-exported: other code and the tests reach every name below as ``checkpointing.<name>``
# (the torch_dist and EP modules and the tests also the private ones).
from megatron.checkpoint.saved_args import (  # noqa: F401
    _ARG_LABELS, CHECKPOINT_ARGS, SHAPE_ARGS, _check_args, _expert_tp_size, _plain_args,
    _refuse_torch_load, _refuse_torch_save, _shape_value, checkpoint_args, megatron_args)
from megatron.checkpoint.layout import (  # noqa: F401
    _MAX_TRACKER_BYTES, CHECKPOINT_VERSION, REPLACED_SUFFIX, STAGING_PREFIX, TRACKER_FILENAME,
    CheckpointError, _is_dist, _iteration_dir, _my_file, _peek_args, _rank_dir_name_of,
    _rank_file_in, _verify_zip_checksums, checkpoint_dir_name, checkpoint_file, expert_ranks,
    load_state_file, rank_dir_name, read_tracker, saved_layout, saved_sizes)
from megatron.checkpoint.save import (  # noqa: F401
    CRASH_ENV, CRASH_POINTS, AsyncCheckpointSaver, _InFlight, _KillMidFile, _all_ok,
    _begin_save, _collect_state, _copy_to_cpu, _crash_counts, _crash_lock, _crash_spec,
    _finish_save, _fsync_dir, _global_rank, _model_state, _publish, _raise_if_failed,
    _rng_state, _set_rng_state, _staging_root, _write_state, check_save_dir,
    clean_interrupted_saves, crash_point, save_checkpoint)
from megatron.training.train_state import TrainState

CONVERSION_TOOL = "tools/checkpoint/convert.py"


def _locate(load_dir: str, args, pstate) -> Optional[Tuple[str, int, bool]]:
    tracked = read_tracker(load_dir)
    if tracked is None:
        if args.exit_on_missing_checkpoint:
            raise CheckpointError(f"--load {load_dir}: no {TRACKER_FILENAME}; "
                                  "exiting (--exit-on-missing-checkpoint)")
        if dist.get_rank() == 0:
            print(f"NOTE: no checkpoint in --load {load_dir}; starting from scratch", flush=True)
        return None
    iteration, release = tracked
    if args.ckpt_step is not None:
        iteration, release = args.ckpt_step, False
    iter_dir = _iteration_dir(load_dir, iteration, release)
    if not os.path.isdir(iter_dir):
        raise CheckpointError(f"{iter_dir}: missing (named by {TRACKER_FILENAME} or --ckpt-step)")
    if _is_dist(iter_dir):
        return iter_dir, iteration, release  # torch_dist: any saved layout loads
    _refuse_torch_load(args, pstate, None, iter_dir)
    saved_tp, saved_pp, saved_ep = saved_sizes(iter_dir)
    if (saved_tp, saved_pp) != (pstate.tp_size, pstate.pp_size):
        raise CheckpointError(
            f"{iter_dir} was saved with tensor-model-parallel size {saved_tp} x "
            f"pipeline-model-parallel size {saved_pp}, but this run uses {pstate.tp_size} x "
            f"{pstate.pp_size}; run with --tensor-model-parallel-size {saved_tp} "
            f"--pipeline-model-parallel-size {saved_pp}, or convert it first: python "
            f"{CONVERSION_TOOL} --model-type {getattr(args, 'checkpoint_model_type', 'GPT')} "
            f"--loader megatron --saver megatron --load-dir "
            f"{load_dir} --save-dir NEW_DIR --target-tensor-parallel-size {pstate.tp_size} "
            f"--target-pipeline-parallel-size {pstate.pp_size}")
    ep_rank, ep_size, _ = expert_ranks(pstate)
    if saved_ep != ep_size:
        # Another expert-parallel size: checkpointing_ep assembles this rank's state.
        return _EPReshard(iter_dir, saved_ep), iteration, release
    path = _rank_file_in(iter_dir, pstate.tp_rank, pstate.pp_rank, pstate.pp_size, ep_rank,
                         ep_size)
    return path, iteration, release


@dataclasses.dataclass(frozen=True)
class _EPReshard:
    """Where :func:`_locate` found a torch-format checkpoint saved at another EP."""
    iter_dir: str
    saved_ep: int


def _read_rank_state(located, model_chunks, args, pstate) -> Tuple[dict, str]:
    """This rank's checkpoint state and the file (or folder) errors name."""
    if isinstance(located, _EPReshard):
        from megatron.checkpoint import experts as checkpointing_ep

        return checkpointing_ep.load_resharded(located.iter_dir, located.saved_ep,
                                               model_chunks, args, pstate)
    return load_state_file(located), located


def _shapes(tree, prefix="") -> Dict[str, tuple]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_shapes(value, name + "."))
        elif isinstance(value, torch.Tensor):
            out[name] = tuple(value.shape)
    return out


def _check_model_state(model_chunks, state: dict, path: str) -> List[dict]:
    """Every chunk's saved tensors, checked against the model's keys and shapes."""
    if len(model_chunks) == 1:
        saved = [state.get("model")]
    else:
        saved = [state.get(f"model{i}") for i in range(len(model_chunks))]
    for i, (chunk, tree) in enumerate(zip(model_chunks, saved)):
        if tree is None:
            raise CheckpointError(f"{path}: no model state for model chunk {i}")
        if not isinstance(tree, dict):
            raise CheckpointError(f"{path}: the model state of chunk {i} is a "
                                  f"{type(tree).__name__}, not a dict of tensors")
        want = _shapes(chunk.state_dict_for_save_checkpoint())
        have = _shapes(tree)
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        wrong = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        if missing or extra or wrong:
            detail = []
            if missing:
                detail.append(f"missing {missing[:5]}")
            if extra:
                detail.append(f"unexpected {extra[:5]}")
            if wrong:
                detail.append("shape mismatch " + ", ".join(
                    f"{k}: checkpoint {have[k]} vs model {want[k]}" for k in wrong[:5]))
            raise CheckpointError(f"{path}: model state does not fit the model: "
                                  + "; ".join(detail))
    return saved


def _converted_parts(state: dict, path: str, restore_training: bool, args) -> Tuple[bool, bool]:
    """Whether to load the optimizer and the RNG states.

    A checkpoint written by the conversion tool (a ``conversion`` entry) has no optimizer or RNG
    state when its layout changed: training resumes from it with fresh Adam moments and freshly
    seeded RNGs, and says so, instead of asking for --no-load-optim / --no-load-rng.
    """
    load_optim = restore_training and not args.no_load_optim
    load_rng = restore_training and not args.no_load_rng
    conversion = state.get("conversion")
    if conversion is None:
        return load_optim, load_rng
    dropped = []
    if load_optim and "optimizer" not in state:
        load_optim = False
        dropped.append("optimizer state (Adam moments start from zero)")
    if load_rng and "rng_state" not in state:
        load_rng = False
        dropped.append("RNG states (seeded from --seed)")
    if dropped and dist.get_rank() == 0:
        print(f"NOTE: {path} was converted from tensor x pipeline layout "
              f"{conversion.get('from_layout')}; it has no " + " and no ".join(dropped),
              flush=True)
    return load_optim, load_rng


def load_checkpoint(model_chunks, optimizer, opt_param_scheduler, args, pstate, *,
                    train_state: Optional[TrainState] = None,
                    config: Optional[CheckpointConfig] = None) -> int:
    """Load ``--load`` into model, optimizer, scheduler and RNGs; returns the iteration (0 when
    there is no checkpoint, and for ``--finetune`` or a release checkpoint).

    Args:
        train_state: given, it takes the iteration and the position the checkpoint records
            (consumed samples, the loss-spike window); with ``--finetune`` or a release
            checkpoint only the iteration, 0.
        config: checkpoint options to use instead of the flags of the same names in ``args``.
    """
    args = checkpoint_args(args, config)
    iteration = _load(model_chunks, optimizer, opt_param_scheduler, args, pstate, train_state)
    if train_state is not None:
        train_state.iteration = iteration
    return iteration


def _load(model_chunks, optimizer, opt_param_scheduler, args, pstate,
          train_state: Optional[TrainState]) -> int:
    """:func:`load_checkpoint` with ``args`` as the load sees them (config applied)."""
    if not args.load:
        return 0
    located = _locate(args.load, args, pstate)
    if located is None:
        return 0
    path, iteration, release = located
    if not isinstance(path, _EPReshard) and _is_dist(path):
        return _load_dist(path, iteration, release, model_chunks, optimizer, opt_param_scheduler,
                          args, pstate, train_state)
    state, path = _read_rank_state(path, model_chunks, args, pstate)
    saved_args = state.get("args")
    _refuse_torch_load(args, pstate, saved_args, path)
    _check_args(saved_args, args, path)
    trees = _check_model_state(model_chunks, state, path)
    restore_training = not (args.finetune or release)
    load_optim, load_rng = _converted_parts(state, path, restore_training, args)
    if load_optim:
        for key in ("optimizer", "opt_param_scheduler"):
            if key not in state:
                raise CheckpointError(f"{path}: has no {key} state (saved with --no-save-optim?); "
                                      "pass --no-load-optim or --finetune")
    if load_rng and "rng_state" not in state:
        raise CheckpointError(f"{path}: has no RNG state (saved with --no-save-rng?); "
                              "pass --no-load-rng")

    for chunk, tree in zip(model_chunks, trees):
        chunk.load_state_dict(tree, strict=True)
    if load_optim:
        # Every DP rank read the same, unsharded file: a distributed optimizer takes its shard.
        optimizer.load_state_dict(state["optimizer"])
        opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        # Fresh optimizer over the loaded weights (fp32 main copies must follow the model).
        optimizer.reload_model_params()
        if (restore_training and not args.no_load_optim and "conversion" in state
                and "opt_param_scheduler" in state):
            # A converted checkpoint keeps the learning-rate schedule's position.
            opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        rng = state["rng_state"]
        _set_rng_state(rng[pstate.dp_rank] if len(rng) == pstate.dp_size else rng[0])
    if not restore_training:
        iteration = 0
    elif train_state is not None:
        train_state.restore_from_saved_args(saved_args)
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {iteration}",
              flush=True)
    return iteration


def _load_dist(iter_dir, iteration, release, model_chunks, optimizer, opt_param_scheduler,
               args, pstate, train_state: Optional[TrainState]) -> int:
    from megatron.checkpoint import torch_dist as checkpointing_dist

    common = checkpointing_dist.load_checkpoint(iter_dir, iteration, release, model_chunks,
                                                optimizer, opt_param_scheduler, args, pstate)
    if args.finetune or release:
        iteration = 0
    elif train_state is not None:
        train_state.restore_from_saved_args(common.get("args"))
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {iteration} "
              "(torch_dist)", flush=True)
    return iteration


def load_args_from_checkpoint(args) -> argparse.Namespace:
    """--use-checkpoint-args: take the model-shape flags from the checkpoint in --load."""
    if not args.load:
        raise CheckpointError("--use-checkpoint-args needs --load")
    tracked = read_tracker(args.load)
    if tracked is None:
        raise CheckpointError(f"--use-checkpoint-args: no {TRACKER_FILENAME} in {args.load}")
    iteration, release = tracked
    iter_dir = _iteration_dir(args.load, iteration, release)
    if _is_dist(iter_dir):
        from megatron.checkpoint import torch_dist as checkpointing_dist

        saved = megatron_args(checkpointing_dist.saved_args(iter_dir))
    else:
        _, saved_pp, saved_ep = saved_sizes(iter_dir)
        saved = megatron_args(load_state_file(_rank_file_in(iter_dir, 0, 0, saved_pp, 0,
                                                            saved_ep)).get("args"))
    if saved is None:
        raise CheckpointError(f"{iter_dir}: the checkpoint holds no args")
    for name in CHECKPOINT_ARGS:
        if hasattr(saved, name):
            setattr(args, name, getattr(saved, name))
    return args


def load_model_weights(model_chunks, args, pstate) -> int:
    """Load only the model weights from ``args.load`` (inference, evaluation, generation).

    The optimizer, scheduler and RNG states in the checkpoint are ignored. Keys, shapes and the
    model-shape flags are checked as :func:`load_checkpoint` checks them. Returns the iteration.
    """
    if not args.load:
        raise CheckpointError("--load is required: the checkpoint to run")
    if read_tracker(args.load) is None:
        raise CheckpointError(f"--load {args.load}: no {TRACKER_FILENAME}; not a checkpoint "
                              "folder")
    path, iteration, release = _locate(args.load, args, pstate)
    if not isinstance(path, _EPReshard) and _is_dist(path):
        from megatron.checkpoint import torch_dist as checkpointing_dist

        checkpointing_dist.load_checkpoint(path, iteration, release, model_chunks, None, None,
                                           args, pstate, weights_only=True)
        if dist.get_rank() == 0:
            print(f"  loaded model weights from {args.load} at iteration {iteration}",
                  flush=True)
        return iteration
    state, path = _read_rank_state(path, model_chunks, args, pstate)
    _refuse_torch_load(args, pstate, state.get("args"), path)
    _check_args(state.get("args"), args, path)
    trees = _check_model_state(model_chunks, state, path)
    for chunk, tree in zip(model_chunks, trees):
        chunk.load_state_dict(tree, strict=True)
    if dist.get_rank() == 0:
        print(f"  loaded model weights from {args.load} at iteration {iteration}", flush=True)
    return iteration
