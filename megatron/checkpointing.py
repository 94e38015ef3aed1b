"""Save and load checkpoints in Megatron's layout (``--ckpt-format torch``), atomically and safely.

Layout (FORMATS.md section 6)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/mp_rank_{tp:02d}/model_optim_rng.pt            (PP = 1)
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   (PP > 1)

Writing: every file of an iteration goes into ``iter_XXXXXXX.tmp/`` and is fsynced; once every
rank has reported success, rank 0 renames the folder into place and only then replaces the
tracker file (also through a rename). A crash at any point leaves the previous checkpoint and
tracker intact. Reading: ``torch.load(weights_only=True)`` with a short allow-list of plain types,
so a checkpoint from a stranger cannot run code; every key and shape is checked before anything is
copied into the model, so a failed load never leaves a half-loaded model.
"""

import argparse
import os
import random
import re
import shutil
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import device

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CONVERSION_TOOL = "tools/checkpoint/convert.py"

# Flags that fix the shape of the saved tensors: a checkpoint cannot be loaded if they differ.
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "max_position_embeddings",
              "position_embedding_type", "padded_vocab_size", "swiglu", "normalization",
              "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights")
# Also taken from the checkpoint with --use-checkpoint-args.
CHECKPOINT_ARGS = SHAPE_ARGS + ("seq_length", "group_query_attention", "rotary_percent",
                                "rotary_base", "apply_residual_connection_post_layernorm",
                                "openai_gelu", "norm_epsilon", "tokenizer_type",
                                "vocab_size", "make_vocab_size_divisible_by",
                                "tensor_model_parallel_size", "pipeline_model_parallel_size")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the path and the problem."""


def _allow_list():
    """Types a checkpoint may hold besides tensors and builtin containers."""
    allowed = [argparse.Namespace]
    # Checkpoints written by Megatron-LM hold numpy RNG states as arrays.
    try:
        from numpy.core.multiarray import _reconstruct  # noqa: PLC0415
    except ImportError:  # numpy >= 2 moved it
        from numpy._core.multiarray import _reconstruct  # noqa: PLC0415
    allowed += [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    return allowed


def checkpoint_dir_name(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def checkpoint_file(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    release: bool = False) -> str:
    rank_dir = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(root, checkpoint_dir_name(iteration, release), rank_dir,
                        "model_optim_rng.pt")


def read_tracker(load_dir: str) -> Optional[Tuple[int, bool]]:
    """``(iteration, release)`` from the tracker file, or None if there is none."""
    path = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    if not re.fullmatch(r"\d+", text):
        raise CheckpointError(f"{path}: expected an iteration number or 'release', "
                              f"found {text[:40]!r}")
    return int(text), False


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain_args(args) -> argparse.Namespace:
    plain = (type(None), bool, int, float, str, list, tuple, dict, torch.dtype)
    return argparse.Namespace(**{k: v for k, v in vars(args).items() if isinstance(v, plain)})


def _rng_state() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "random_rng_state": random.getstate(),
        # numpy's key array is stored as a tensor so the file loads with weights_only=True.
        "np_rng_state": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": device.rng_state(),
        "rng_tracker_states": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["random_rng_state"])
    kind, keys, pos, has_gauss, cached = state["np_rng_state"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_rng_state"])
    device.set_rng_state(state.get("cuda_rng_state"))
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _all_ok(ok: bool) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device.current_device())
    dist.all_reduce(flag)
    return int(flag.item()) == 0


def check_save_dir(save_dir: str) -> None:
    """Fail at start-up, not after hours of training, when --save cannot be written."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise CheckpointError(f"--save {save_dir} is not writable: {err.strerror}") from None


def _model_state(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].state_dict_for_save_checkpoint()}
    return {f"model{i}": m.state_dict_for_save_checkpoint() for i, m in enumerate(model_chunks)}


def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                    pstate) -> str:
    """Write the checkpoint of ``iteration`` under ``args.save``; returns its folder."""
    save_dir = args.save
    final_dir = os.path.join(save_dir, checkpoint_dir_name(iteration))
    tmp_root = os.path.join(save_dir, ".tmp_" + checkpoint_dir_name(iteration))
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp_root, ignore_errors=True)
        os.makedirs(tmp_root, exist_ok=True)
    dist.barrier()

    rng_states = None
    if not args.no_save_rng:
        rng_states = [None] * pstate.dp_size
        dist.all_gather_object(rng_states, _rng_state(), group=pstate.dp_group)

    # Every DP rank asks: the distributed optimizer gathers its shards to DP rank 0 (a
    # collective), and finishes any parameter all-gather still overlapping, so the model is whole.
    finish_param_sync = getattr(optimizer, "finish_param_sync", None)
    if finish_param_sync is not None:
        finish_param_sync()
    optimizer_state = None if args.no_save_optim else optimizer.state_dict()

    ok, error = True, ""
    if pstate.dp_rank == 0:
        state = {"args": _plain_args(args), "checkpoint_version": CHECKPOINT_VERSION,
                 "iteration": iteration}
        state.update(_model_state(model_chunks))
        if not args.no_save_optim:
            state["optimizer"] = optimizer_state
            state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        if rng_states is not None:
            state["rng_state"] = rng_states
        # tmp_root plays the role of SAVE: the iteration folder inside it is renamed at the end.
        path = checkpoint_file(tmp_root, iteration, pstate.tp_rank, pstate.pp_rank,
                               pstate.pp_size)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            ok, error = False, f"{path}: {err.strerror}"
    if not _all_ok(ok):
        if rank == 0:
            shutil.rmtree(tmp_root, ignore_errors=True)
        raise CheckpointError(f"saving iteration {iteration} to {save_dir} failed"
                              + (f": {error}" if error else " on another rank"))

    if rank == 0:
        staged = os.path.join(tmp_root, checkpoint_dir_name(iteration))
        old = final_dir + ".old"
        if os.path.exists(final_dir):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final_dir, old)
        os.replace(staged, final_dir)
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp_root, ignore_errors=True)
        _fsync_dir(save_dir)
        tracker = os.path.join(save_dir, TRACKER_FILENAME)
        with open(tracker + ".tmp", "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker + ".tmp", tracker)
        _fsync_dir(save_dir)
        print(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}",
              flush=True)
    dist.barrier()
    return final_dir


def saved_layout(iter_dir: str) -> Tuple[int, int]:
    """(TP, PP) sizes a checkpoint folder was saved with, from its ``mp_rank_*`` folders."""
    tps, pps = set(), set()
    for name in os.listdir(iter_dir):
        m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?", name)
        if m:
            tps.add(int(m.group(1)))
            pps.add(int(m.group(2)) if m.group(2) is not None else 0)
    if not tps:
        raise CheckpointError(f"{iter_dir}: no mp_rank_* folders; not a checkpoint")
    return max(tps) + 1, max(pps) + 1


def load_state_file(path: str) -> dict:
    """``torch.load`` one rank's file safely; errors name the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    try:
        with torch.serialization.safe_globals(_allow_list()):
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to read is reported with the path
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            raise CheckpointError(
                f"{path}: refusing to load; the file holds objects other than tensors and plain "
                f"data, which could run code ({str(err).splitlines()[0][:200]})") from None
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200] if str(err) else ''})") from None
    if not isinstance(state, dict) or "iteration" not in state:
        raise CheckpointError(f"{path}: not a model_optim_rng checkpoint (no 'iteration' key)")
    return state


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
    iter_dir = os.path.join(load_dir, checkpoint_dir_name(iteration, release))
    if not os.path.isdir(iter_dir):
        raise CheckpointError(f"{iter_dir}: missing (named by {TRACKER_FILENAME} or --ckpt-step)")
    saved_tp, saved_pp = saved_layout(iter_dir)
    if (saved_tp, saved_pp) != (pstate.tp_size, pstate.pp_size):
        raise CheckpointError(
            f"{iter_dir} was saved with tensor-model-parallel size {saved_tp} x "
            f"pipeline-model-parallel size {saved_pp}, but this run uses {pstate.tp_size} x "
            f"{pstate.pp_size}; run with --tensor-model-parallel-size {saved_tp} "
            f"--pipeline-model-parallel-size {saved_pp}, or convert it first: python "
            f"{CONVERSION_TOOL} --model-type GPT --loader megatron --saver megatron --load-dir "
            f"{load_dir} --save-dir NEW_DIR --target-tensor-parallel-size {pstate.tp_size} "
            f"--target-pipeline-parallel-size {pstate.pp_size}")
    path = checkpoint_file(load_dir, iteration, pstate.tp_rank, pstate.pp_rank, pstate.pp_size,
                           release)
    return path, iteration, release


def _check_args(saved, args, path: str) -> None:
    if saved is None:
        return
    diffs = [f"--{n.replace('_', '-')} (checkpoint {getattr(saved, n)!r}, "
             f"flags {getattr(args, n)!r})"
             for n in SHAPE_ARGS
             if hasattr(saved, n) and hasattr(args, n) and getattr(saved, n) != getattr(args, n)]
    if diffs:
        raise CheckpointError(f"{path}: the model shape differs from the flags: "
                              + "; ".join(diffs))


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


def load_checkpoint(model_chunks, optimizer, opt_param_scheduler, args, pstate) -> int:
    """Load ``args.load`` into model, optimizer, scheduler and RNGs; returns the iteration.

    Sets ``args.consumed_train_samples`` / ``args.consumed_valid_samples`` from the checkpoint
    (zero for ``--finetune`` or a release checkpoint).
    """
    args.consumed_train_samples = getattr(args, "consumed_train_samples", 0)
    args.consumed_valid_samples = getattr(args, "consumed_valid_samples", 0)
    if not args.load:
        return 0
    located = _locate(args.load, args, pstate)
    if located is None:
        return 0
    path, iteration, release = located
    state = load_state_file(path)
    saved_args = state.get("args")
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
    if restore_training:
        args.consumed_train_samples = getattr(saved_args, "consumed_train_samples", 0)
        args.consumed_valid_samples = getattr(saved_args, "consumed_valid_samples", 0)
    else:
        iteration = 0
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {iteration}",
              flush=True)
    return iteration


def load_args_from_checkpoint(args) -> argparse.Namespace:
    """--use-checkpoint-args: take the model-shape flags from the checkpoint in --load."""
    if not args.load:
        raise CheckpointError("--use-checkpoint-args needs --load")
    tracked = read_tracker(args.load)
    if tracked is None:
        raise CheckpointError(f"--use-checkpoint-args: no {TRACKER_FILENAME} in {args.load}")
    iteration, release = tracked
    iter_dir = os.path.join(args.load, checkpoint_dir_name(iteration, release))
    _, saved_pp = saved_layout(iter_dir)
    saved = load_state_file(checkpoint_file(args.load, iteration, 0, 0, saved_pp,
                                            release)).get("args")
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
    path, iteration, _ = _locate(args.load, args, pstate)
    state = load_state_file(path)
    _check_args(state.get("args"), args, path)
    trees = _check_model_state(model_chunks, state, path)
    for chunk, tree in zip(model_chunks, trees):
        chunk.load_state_dict(tree, strict=True)
    if dist.get_rank() == 0:
        print(f"  loaded model weights from {args.load} at iteration {iteration}", flush=True)
    return iteration
