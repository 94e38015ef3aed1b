"""Save and load checkpoints in Megatron's layout (``--ckpt-format torch``), atomically and safely.

Layout (FORMATS.md section 6)::

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/mp_rank_{tp:02d}/model_optim_rng.pt            (PP = 1)
    SAVE/iter_0000100/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   (PP > 1)
    SAVE/iter_0000100/mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}/...       (EP > 1, Megatron-LM's)

With expert parallelism the ranks whose expert-data-parallel rank is 0 write, each its dense
parameters and its expert-parallel rank's experts under local numbers (Megatron-LM's legacy
rule); a checkpoint saved at another EP loads through :mod:`megatron.checkpointing_ep`.

Writing: every file of an iteration goes into ``iter_XXXXXXX.tmp/`` and is fsynced; once every
rank has reported success, rank 0 renames the folder into place and only then replaces the
tracker file (also through a rename). A crash at any point leaves the previous checkpoint and
tracker intact. Reading: ``torch.load(weights_only=True)`` with a short allow-list of plain types
and Megatron-LM's own classes read as inert stand-ins (:mod:`megatron.safe_unpickle`), so a
checkpoint from a stranger cannot run code and one written by Megatron-LM opens; every key and
shape is checked before anything is copied into the model, so a failed load never leaves a
half-loaded model.

What survives what: a process killed at any point of a save (the test hook
``MEGATRON_TEST_CRASH_AT``, below, kills it at each named point) leaves the tracker naming a
complete checkpoint. The next start with the same ``--save`` removes the unfinished staging folder
and tracker temporary file, and puts back an iteration folder that was being replaced (see
:func:`clean_interrupted_saves`); ``--load`` ignores such leftovers.

``--async-save`` (:class:`AsyncCheckpointSaver`): at the iteration boundary every rank copies its
state to CPU memory (collectives run here, on the main thread), then a background thread writes
the copy into the staging folder with the same protocol while training goes on. The ranks agree
that every file is complete at a later iteration boundary, with one all-reduce per iteration while
a save is in flight (a background thread never runs a collective); only then does rank 0 rename
the folder and replace the tracker. At most one save is in flight: the next save, the end of
training and every exit wait for it. An error of a writer is raised on every rank at that
boundary, naming the file.
"""

import argparse
import copy
import dataclasses
import os
import random
import re
import shutil
import zipfile
import signal
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron import safe_unpickle
from megatron.checkpoint_config import CheckpointConfig, torch_format_expert_tp_error
from megatron.core import device
from megatron.training_state import TrainState

CHECKPOINT_VERSION = 3.0
TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
# A tracker holds an iteration number; anything longer is not one (and int() refuses > 4300 digits).
_MAX_TRACKER_BYTES = 1024
STAGING_PREFIX = ".tmp_"     # SAVE/.tmp_iter_0000100/iter_0000100/...: a save being written
REPLACED_SUFFIX = ".old"     # SAVE/iter_0000100.old: the folder a new save of 100 replaces
CRASH_ENV = "MEGATRON_TEST_CRASH_AT"
# The points of a save at which MEGATRON_TEST_CRASH_AT can kill the process, in order.
CRASH_POINTS = ("before_files", "during_file", "after_file", "before_rename", "replacing_old",
                "after_rename", "before_tracker", "after_tracker")
CONVERSION_TOOL = "tools/checkpoint/convert.py"

# Flags that fix the shape of the saved tensors: a checkpoint cannot be loaded if they differ.
SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "max_position_embeddings",
              "position_embedding_type", "padded_vocab_size", "swiglu", "normalization",
              "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights",
              "bert_binary_head", "qk_layernorm")
# How a SHAPE_ARGS entry is named in an error when its dest is not its flag's name.
_ARG_LABELS = {"bert_binary_head": "the BERT binary head (--bert-no-binary-head removes it)"}
# Also taken from the checkpoint with --use-checkpoint-args.
CHECKPOINT_ARGS = SHAPE_ARGS + ("seq_length", "group_query_attention", "rotary_percent",
                                "rotary_base", "apply_residual_connection_post_layernorm",
                                "openai_gelu", "norm_epsilon", "tokenizer_type",
                                # Same shapes, different function: the weights mean nothing
                                # without them.
                                "apply_layernorm_1p", "squared_relu", "rotary_interleaved",
                                "rotary_seq_len_interpolation_factor",
                                "apply_query_key_layer_scaling",
                                "vocab_size", "null_tokenizer_eod_id",
                                "make_vocab_size_divisible_by",
                                "tensor_model_parallel_size", "pipeline_model_parallel_size")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the path and the problem."""


def checkpoint_dir_name(iteration: int, release: bool = False) -> str:
    return "release" if release else f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                  ep_size: int = 1) -> str:
    """Megatron-LM's rank folder: ``mp_rank_{tp:02d}``, ``_{pp:03d}`` appended when PP > 1 and
    ``_{ep:03d}`` when EP > 1 (so ``mp_rank_00_001`` is pipeline stage 1 or expert rank 1;
    :func:`saved_sizes` tells them apart)."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep_size == 1 else f"{name}_{ep_rank:03d}"


def _rank_file_in(iter_dir: str, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                  ep_size: int = 1) -> str:
    return os.path.join(iter_dir, rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size),
                        "model_optim_rng.pt")


def checkpoint_file(root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int,
                    release: bool = False, ep_rank: int = 0, ep_size: int = 1) -> str:
    return _rank_file_in(os.path.join(root, checkpoint_dir_name(iteration, release)), tp_rank,
                         pp_rank, pp_size, ep_rank, ep_size)


def expert_ranks(pstate) -> Tuple[int, int, int]:
    """``(ep_rank, ep_size, expert_dp_rank)`` of this rank (``(0, 1, dp x cp rank)`` without
    expert parallelism)."""
    from megatron.core.collectives import get_group_rank, get_group_size

    ep_group = getattr(pstate, "ep_group", None)
    edp_group = getattr(pstate, "expert_dp_group", None)
    if ep_group is None:
        return 0, 1, pstate.dp_cp_rank
    return get_group_rank(ep_group), get_group_size(ep_group), get_group_rank(edp_group)


def _expert_tp_size(args, pstate) -> Optional[int]:
    """This run's expert-TP size when its experts are split otherwise than by TP (None for a
    dense model, or experts split by TP)."""
    layout = getattr(pstate, "layout", None)
    if not getattr(args, "num_experts", None) or layout is None:
        return None
    return None if layout.expert_tp_size == layout.tp_size else layout.expert_tp_size


def _refuse_torch_save(args, pstate) -> None:
    """The torch format cannot hold experts split otherwise than by TP (see
    :func:`megatron.checkpoint_config.torch_format_expert_tp_error`); every rank raises
    alike, before anything is written."""
    etp = _expert_tp_size(args, pstate)
    if etp is not None:
        raise CheckpointError(torch_format_expert_tp_error(pstate.tp_size, etp,
                                                           "--ckpt-format torch cannot save"))


def _refuse_torch_load(args, pstate, saved, path: str) -> None:
    """A torch-format checkpoint neither loads into a run whose experts are split otherwise
    than by TP, nor was written by one (its ``saved`` args say so: Megatron-LM's own)."""
    etp = _expert_tp_size(args, pstate)
    if etp is not None:
        raise CheckpointError(torch_format_expert_tp_error(
            pstate.tp_size, etp, f"{path}: a --ckpt-format torch checkpoint cannot load at",
            f"load it at --expert-tensor-parallel-size {pstate.tp_size} and write it with "
            "--ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR, then --load NEW_DIR"))
    saved_tp = getattr(saved, "tensor_model_parallel_size", None)
    saved_etp = getattr(saved, "expert_tensor_parallel_size", None)
    if getattr(saved, "num_experts", None) and saved_etp not in (None, saved_tp):
        raise CheckpointError(torch_format_expert_tp_error(
            saved_tp, saved_etp, f"{path}: a --ckpt-format torch checkpoint saved at",
            "its expert tensors cannot be told apart; save it with --ckpt-format torch_dist"))


def _my_file(root: str, iteration: int, pstate) -> str:
    """This rank's file under ``root`` (a staging or a checkpoint folder)."""
    ep_rank, ep_size, _ = expert_ranks(pstate)
    return checkpoint_file(root, iteration, pstate.tp_rank, pstate.pp_rank, pstate.pp_size,
                           ep_rank=ep_rank, ep_size=ep_size)


def _iteration_dir(load_dir: str, iteration: int, release: bool) -> str:
    """The folder of ``iteration``; its ``.old`` copy when a save replacing it was interrupted
    (the next start with this folder as --save puts it back; see clean_interrupted_saves)."""
    iter_dir = os.path.join(load_dir, checkpoint_dir_name(iteration, release))
    if not os.path.isdir(iter_dir) and os.path.isdir(iter_dir + REPLACED_SUFFIX):
        return iter_dir + REPLACED_SUFFIX
    return iter_dir


def read_tracker(load_dir: str) -> Optional[Tuple[int, bool]]:
    """``(iteration, release)`` from the tracker file, or None if there is none."""
    path = os.path.join(load_dir, TRACKER_FILENAME)
    if not os.path.lexists(path):
        return None
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: exists but is not a regular file")
    with open(path, "rb") as f:
        raw = f.read(_MAX_TRACKER_BYTES + 1)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not UTF-8 text (starts {raw[:20]!r})") from None
    if text == "release":
        return 0, True
    if len(raw) > _MAX_TRACKER_BYTES or not re.fullmatch(r"\d+", text):
        raise CheckpointError(f"{path}: expected an iteration number or 'release', "
                              f"found {text[:40]!r}")
    return int(text), False


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_args(args, config: Optional[CheckpointConfig] = None,
                    train_state: Optional[TrainState] = None) -> argparse.Namespace:
    """The flags a save or a load works with, and that a save records as the checkpoint's
    ``args``: a copy of ``args``, with the fields of ``config`` in place of the checkpoint flags
    of the same names (so a conversion saves elsewhere, or a finetuning start loads another
    folder, and the run's flags stay as parsed), and with the training position of
    ``train_state`` under Megatron's keys (``consumed_train_samples``,
    ``consumed_valid_samples``)."""
    fields = dict(vars(args))
    if config is not None:
        fields.update(dataclasses.asdict(config))
    if train_state is not None:
        fields.update(train_state.saved_args_fields())
    return argparse.Namespace(**fields)


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


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


_crash_counts: Dict[str, int] = {}
_crash_lock = threading.Lock()


def _crash_spec(name: str) -> Optional[int]:
    """The COUNT of ``MEGATRON_TEST_CRASH_AT`` when it names point ``name`` on this rank."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return None
    m = re.fullmatch(r"([a-z_]+)(?::(\d+))?(?:@(\d+))?", spec.strip())
    if m is None or m.group(1) not in CRASH_POINTS:
        raise CheckpointError(f"{CRASH_ENV}={spec!r}: expected POINT[:COUNT][@RANK] with POINT "
                              f"one of {', '.join(CRASH_POINTS)}")
    if m.group(1) != name or (m.group(3) is not None and int(m.group(3)) != _global_rank()):
        return None
    return int(m.group(2) or 1)


def crash_point(name: str) -> None:
    """Test hook: SIGKILL this process the COUNT-th time it reaches save point ``name``.

    ``MEGATRON_TEST_CRASH_AT=POINT[:COUNT][@RANK]`` names one of :data:`CRASH_POINTS`; COUNT
    (default 1) counts the times this process reached the point; with ``@RANK`` only that global
    rank dies. The tests use it to prove that a process killed anywhere inside a save loses
    nothing. Unset, it costs one environment lookup per point.
    """
    count = _crash_spec(name)
    if count is None:
        return
    with _crash_lock:
        _crash_counts[name] = _crash_counts.get(name, 0) + 1
        hit = _crash_counts[name] == count
    if hit:
        print(f"{CRASH_ENV}: killing rank {_global_rank()} at {name}:{count}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class _KillMidFile:
    """A file that reaches the ``during_file`` crash point after its first write: the process
    then dies with part of the checkpoint file on disk."""

    def __init__(self, f):
        self._f = f
        self._writes = 0

    def write(self, data):
        self._writes += 1
        if self._writes == 2:
            self._f.flush()
            crash_point("during_file")
        return self._f.write(data)

    def flush(self):
        self._f.flush()


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


def clean_interrupted_saves(save_dir: str) -> List[str]:
    """Tidy what a save killed midway left in ``save_dir``; returns one line per change.

    Rank 0 calls it at start-up, before anything is loaded or saved. Staging folders
    (``.tmp_iter_*``), the tracker's temporary file and write probes are deleted. An
    ``iter_*.old`` folder (the previous copy of an iteration being saved again) is deleted when
    its replacement is in place, else renamed back, since the tracker may name it.
    """
    if not os.path.isdir(save_dir):
        return []
    done = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        base = name[:-len(REPLACED_SUFFIX)] if name.endswith(REPLACED_SUFFIX) else None
        if name.startswith(STAGING_PREFIX + "iter_") or name.startswith(".write_test_") \
                or name == TRACKER_FILENAME + ".tmp":
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            done.append(f"removed {name}, left by an interrupted save")
        elif base is not None and re.fullmatch(r"iter_\d{7}", base):
            if os.path.isdir(os.path.join(save_dir, base)):
                shutil.rmtree(path, ignore_errors=True)
                done.append(f"removed {name}, already replaced by {base}")
            else:
                os.replace(path, os.path.join(save_dir, base))
                done.append(f"restored {base} from {name} (the save replacing it was "
                            "interrupted)")
    if done:
        _fsync_dir(save_dir)
    return done


def _model_state(model_chunks) -> dict:
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].state_dict_for_save_checkpoint()}
    return {f"model{i}": m.state_dict_for_save_checkpoint() for i, m in enumerate(model_chunks)}


def _staging_root(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, STAGING_PREFIX + checkpoint_dir_name(iteration))


def _begin_save(save_dir: str, iteration: int) -> str:
    """Rank 0 empties the staging folder of ``iteration``; every rank waits for it."""
    tmp_root = _staging_root(save_dir, iteration)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp_root, ignore_errors=True)
        os.makedirs(tmp_root, exist_ok=True)
    dist.barrier()
    return tmp_root


def _collect_state(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                   pstate) -> Optional[dict]:
    """This rank's checkpoint (None on data- or context-parallel ranks > 0, with expert
    parallelism on expert-data-parallel ranks > 0: they write no file).

    Every rank takes part: the data-parallel ranks' RNG states are gathered, and a distributed
    optimizer gathers its shards to DP rank 0 and finishes any parameter all-gather still
    overlapping, so the model is whole. The tensors returned are the live ones, not copies.
    """
    rng_states = None
    if not args.no_save_rng:
        rng_states = [None] * pstate.dp_size
        dist.all_gather_object(rng_states, _rng_state(), group=pstate.dp_group)
    finish_param_sync = getattr(optimizer, "finish_param_sync", None)
    if finish_param_sync is not None:
        finish_param_sync()
    optimizer_state = None if args.no_save_optim else optimizer.state_dict()
    _, ep_size, expert_dp_rank = expert_ranks(pstate)
    if ep_size > 1:
        # Megatron-LM: the expert-data-parallel rank 0 of each expert-parallel rank writes.
        if expert_dp_rank != 0:
            return None
    elif pstate.dp_rank != 0 or pstate.cp_rank != 0:  # context-parallel ranks hold copies too
        return None
    state = {"args": _plain_args(args), "checkpoint_version": CHECKPOINT_VERSION,
             "iteration": iteration}
    state.update(_model_state(model_chunks))
    if not args.no_save_optim:
        state["optimizer"] = optimizer_state
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if rng_states is not None:
        state["rng_state"] = rng_states
    return state


def _write_state(state: dict, path: str) -> str:
    """Write one rank's file and fsync it; returns "" or what went wrong, naming the file."""
    crash_point("before_files")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(state, _KillMidFile(f) if _crash_spec("during_file") else f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        return f"{path}: {err.strerror}"
    except Exception as err:  # noqa: BLE001 - reported on every rank, not only this one
        return f"{path}: {type(err).__name__}: {err}"
    crash_point("after_file")
    return ""


def _publish(save_dir: str, iteration: int) -> None:
    """Rank 0: move the staged folder into place, then point the tracker at it (renames)."""
    name = checkpoint_dir_name(iteration)
    tmp_root = _staging_root(save_dir, iteration)
    final_dir = os.path.join(save_dir, name)
    old = final_dir + REPLACED_SUFFIX
    crash_point("before_rename")
    if os.path.exists(final_dir):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
        crash_point("replacing_old")
    os.replace(os.path.join(tmp_root, name), final_dir)
    crash_point("after_rename")
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(tmp_root, ignore_errors=True)
    _fsync_dir(save_dir)
    tracker = os.path.join(save_dir, TRACKER_FILENAME)
    with open(tracker + ".tmp", "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    crash_point("before_tracker")
    os.replace(tracker + ".tmp", tracker)
    _fsync_dir(save_dir)
    crash_point("after_tracker")
    print(f"  successfully saved checkpoint at iteration {iteration:7d} to {save_dir}",
          flush=True)


def _raise_if_failed(error: str, what: str) -> None:
    """Collective: every rank raises, naming each failing rank's file, if any rank failed."""
    if _all_ok(not error):
        return
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    detail = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
    raise CheckpointError(f"{what} failed: {detail}")


def _finish_save(save_dir: str, iteration: int, error: str) -> None:
    """Collective: publish the staged save if every rank's file was written, else raise."""
    try:
        _raise_if_failed(error, f"saving iteration {iteration} to {save_dir}")
    except CheckpointError:
        if dist.get_rank() == 0:
            shutil.rmtree(_staging_root(save_dir, iteration), ignore_errors=True)
        raise
    publish_error = ""
    if dist.get_rank() == 0:
        try:
            _publish(save_dir, iteration)
        except OSError as err:
            publish_error = f"{err.filename}: {err.strerror}"
    _raise_if_failed(publish_error, f"publishing iteration {iteration} in {save_dir}")


def save_checkpoint(iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
                    pstate, *, train_state: Optional[TrainState] = None,
                    config: Optional[CheckpointConfig] = None) -> str:
    """Write the checkpoint of ``iteration`` under ``--save``; returns its folder.

    Collective. The files go to the staging folder; once every rank's file is written and
    fsynced, rank 0 renames the folder into place and then replaces the tracker. With
    ``--ckpt-format torch_dist`` see :mod:`megatron.checkpointing_dist`.

    Args:
        train_state: the run's position, saved in the checkpoint's ``args`` under Megatron's
            keys; None saves none (a checkpoint of weights made outside training).
        config: checkpoint options to use instead of the flags of the same names in ``args``.
    """
    args = checkpoint_args(args, config, train_state)
    if getattr(args, "ckpt_format", "torch") == "torch_dist":
        from megatron import checkpointing_dist

        return checkpointing_dist.save_checkpoint(iteration, model_chunks, optimizer,
                                                  opt_param_scheduler, args, pstate)
    _refuse_torch_save(args, pstate)
    tmp_root = _begin_save(args.save, iteration)
    state = _collect_state(iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
    error = ""
    if state is not None:
        error = _write_state(state, _my_file(tmp_root, iteration, pstate))
    _finish_save(args.save, iteration, error)
    return os.path.join(args.save, checkpoint_dir_name(iteration))


def _copy_to_cpu(obj, memo: Optional[dict] = None):
    """A deep copy of a checkpoint state with every tensor copied to CPU memory (a tensor that
    appears twice is copied once), so training may change the originals while it is written."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            copied = obj.detach().to("cpu", copy=True)
            if isinstance(obj, torch.nn.Parameter):
                copied = torch.nn.Parameter(copied, requires_grad=obj.requires_grad)
            memo[id(obj)] = copied
        return memo[id(obj)]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # same type and attributes (a state dict's ``_metadata``)
        for key, value in obj.items():
            out[key] = _copy_to_cpu(value, memo)
        return out
    if isinstance(obj, list):
        return [_copy_to_cpu(v, memo) for v in obj]
    if type(obj) is tuple:  # noqa: E721 - named tuples are deep-copied below
        return tuple(_copy_to_cpu(v, memo) for v in obj)
    if isinstance(obj, argparse.Namespace):
        return argparse.Namespace(**{k: _copy_to_cpu(v, memo) for k, v in vars(obj).items()})
    return copy.deepcopy(obj)


class _InFlight:
    """One background save: its iteration, where it goes, its writer thread and its error."""

    def __init__(self, iteration: int, save_dir: str):
        self.iteration = iteration
        self.save_dir = save_dir
        self.thread: Optional[threading.Thread] = None
        self.error = ""

    def write(self, state: dict, path: str) -> None:
        try:
            self.error = _write_state(state, path)
        except BaseException as err:  # noqa: BLE001 - raised on the main thread at a boundary
            self.error = f"{path}: {type(err).__name__}: {err}"

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class AsyncCheckpointSaver:
    """``--async-save``: checkpoints written by a background thread while training goes on.

    :meth:`save` copies this rank's state to CPU at the iteration boundary and starts the
    writer; :meth:`poll`, at every later boundary, publishes the save once every rank's file is
    complete; :meth:`wait` blocks until it is (the next save, the end of training and every exit
    call it). All three are collective: every rank calls them at the same iterations, so the
    ranks agree by an all-reduce on the main thread; writer threads run no collective.
    """

    def __init__(self):
        self._in_flight: Optional[_InFlight] = None

    @property
    def in_flight(self) -> Optional[int]:
        """The iteration whose save is being written, or None."""
        return None if self._in_flight is None else self._in_flight.iteration

    def save(self, iteration: int, model_chunks, optimizer, opt_param_scheduler, args,
             pstate, *, train_state: Optional[TrainState] = None,
             config: Optional[CheckpointConfig] = None) -> None:
        """Start the save of ``iteration``, as :func:`save_checkpoint` takes its arguments."""
        self.wait()
        args = checkpoint_args(args, config, train_state)
        if getattr(args, "ckpt_format", "torch") == "torch_dist":
            from megatron import checkpointing_dist

            self._in_flight = checkpointing_dist.start_async(
                iteration, model_chunks, optimizer, opt_param_scheduler, args, pstate)
            if dist.get_rank() == 0:
                print(f"  saving checkpoint at iteration {iteration:7d} to {args.save} in the "
                      "background (torch_dist)", flush=True)
            return
        _refuse_torch_save(args, pstate)
        tmp_root = _begin_save(args.save, iteration)
        state = _collect_state(iteration, model_chunks, optimizer, opt_param_scheduler, args,
                               pstate)
        job = _InFlight(iteration, args.save)
        if state is not None:
            path = _my_file(tmp_root, iteration, pstate)
            # Daemon: a process that dies leaves a staging folder, which the next start removes.
            job.thread = threading.Thread(target=job.write, args=(_copy_to_cpu(state), path),
                                          name=f"checkpoint-writer-{iteration}", daemon=True)
            job.thread.start()
        self._in_flight = job
        if dist.get_rank() == 0:
            print(f"  saving checkpoint at iteration {iteration:7d} to {args.save} in the "
                  "background", flush=True)

    def poll(self) -> None:
        """At an iteration boundary: publish the save in flight if every rank has written."""
        if self._in_flight is None:
            return
        busy = torch.tensor([int(self._in_flight.busy())], dtype=torch.int32,
                            device=device.current_device())
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        if not busy.item():
            self._finish()

    def wait(self) -> None:
        """Block until the save in flight is written on every rank, then publish it."""
        if self._in_flight is None:
            return
        if getattr(self._in_flight, "thread", None) is not None:
            self._in_flight.thread.join()
        self._finish()

    def _finish(self) -> None:
        job, self._in_flight = self._in_flight, None
        if hasattr(job, "finish"):  # a torch_dist save gathers its records, then publishes
            job.finish()
            return
        _finish_save(job.save_dir, job.iteration, job.error)


def saved_layout(iter_dir: str) -> Tuple[int, int]:
    """(TP, PP) sizes a checkpoint folder was saved with, from its ``mp_rank_*`` folders."""
    tp, pp, _ = saved_sizes(iter_dir)
    return tp, pp


def saved_sizes(iter_dir: str) -> Tuple[int, int, int]:
    """(TP, PP, EP) sizes a checkpoint folder was saved with, from its ``mp_rank_*`` folders.

    ``mp_rank_XX_YYY_ZZZ`` is (tp, pp, ep) and ``mp_rank_XX`` tp alone, but Megatron-LM names
    pipeline stage and expert-parallel rank alike when only one of them is > 1:
    ``mp_rank_00_001`` is stage 1 (PP > 1) or expert rank 1 (EP > 1). The saved ``args`` of
    the first rank's file decide (``pipeline_model_parallel_size`` /
    ``expert_model_parallel_size``); a file without them is read as pipeline stages, as before
    expert parallelism.
    """
    parts = []
    for name in os.listdir(iter_dir):
        m = re.fullmatch(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?", name)
        if m:
            parts.append(tuple(int(g) if g is not None else None for g in m.groups()))
    if not parts:
        raise CheckpointError(f"{iter_dir}: no mp_rank_* folders; not a checkpoint")
    lengths = {sum(g is not None for g in p) for p in parts}
    if len(lengths) > 1:
        raise CheckpointError(f"{iter_dir}: mixes mp_rank_* folder names of different forms "
                              f"({sorted(_rank_dir_name_of(p) for p in parts)[:4]}...)")
    tp = max(p[0] for p in parts) + 1
    if lengths == {1}:
        return tp, 1, 1
    if lengths == {3}:
        return tp, max(p[1] for p in parts) + 1, max(p[2] for p in parts) + 1
    second = max(p[1] for p in parts) + 1
    first_file = os.path.join(iter_dir, "mp_rank_00_000", "model_optim_rng.pt")
    saved = _peek_args(first_file)
    saved_ep = getattr(saved, "expert_model_parallel_size", 1) or 1
    saved_pp = getattr(saved, "pipeline_model_parallel_size", None)
    if saved_ep > 1 and (saved_pp or 1) == 1:
        return tp, 1, saved_ep   # a missing expert rank's file is named when it is read
    return tp, second, 1


def _rank_dir_name_of(parts) -> str:
    return "mp_rank_" + "_".join(f"{g:02d}" if i == 0 else f"{g:03d}"
                                 for i, g in enumerate(parts) if g is not None)


def _peek_args(path: str) -> Optional[argparse.Namespace]:
    """The saved ``args`` of a rank file, memory-mapped (the tensors are not read)."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (it tells pipeline stages from expert ranks)")
    try:
        try:
            state = safe_unpickle.torch_load(path, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            state = safe_unpickle.torch_load(path)  # legacy (non-zip) file
    except safe_unpickle.UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - any failure to read is reported with the path
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__})") from None
    return state.get("args") if isinstance(state, dict) else None


def _verify_zip_checksums(path: str) -> None:
    """Check the CRC-32 of every member of a zip-format checkpoint.

    torch writes them but its reader does not check them, so a flipped bit on disk would load as
    a silently different weight. Costs one extra read of the file; legacy (non-zip) files have
    no checksums to check.
    """
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as err:
        raise CheckpointError(f"{path}: corrupt zip archive ({err})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: corrupt: member {bad!r} fails its CRC-32 check "
                              "(the file changed after it was written)")


def load_state_file(path: str) -> dict:
    """``torch.load`` one rank's file safely; errors name the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing")
    _verify_zip_checksums(path)
    try:
        state = safe_unpickle.torch_load(path)
    except safe_unpickle.UnsafeCheckpointError as err:
        raise CheckpointError(str(err)) from None
    except Exception as err:  # noqa: BLE001 - any failure to read is reported with the path
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
        from megatron import checkpointing_ep

        return checkpointing_ep.load_resharded(located.iter_dir, located.saved_ep,
                                               model_chunks, args, pstate)
    return load_state_file(located), located


def megatron_args(saved: Optional[argparse.Namespace]) -> Optional[argparse.Namespace]:
    """A checkpoint's saved ``args`` in this project's conventions (a copy; None stays None).

    Megatron-LM writes some fields differently from the flags this project derives: without
    ``--group-query-attention`` it stores ``num_query_groups`` = 1 (here: the number of heads);
    older files spell rotary embeddings ``use_rotary_position_embeddings`` and the norm epsilon
    ``layernorm_epsilon``, and may lack ``kv_channels`` / ``ffn_hidden_size`` (derived from the
    hidden size); a ``NullTokenizer`` of Megatron-Core's tokenizers counts its end-of-document
    id within ``vocab_size`` (``null_tokenizer_eod_id`` is set to say so). Megatron's own classes (``model_type`` and other enums, read as
    :class:`~megatron.safe_unpickle.StandIn`) are dropped: they are not flags here.
    """
    if saved is None:
        return None
    fields = {k: v for k, v in vars(saved).items()
              if not safe_unpickle.stand_ins_in(v)}
    heads = fields.get("num_attention_heads")
    if heads and not fields.get("group_query_attention", False) and "num_query_groups" in fields:
        fields["num_query_groups"] = heads
    if fields.get("use_rotary_position_embeddings"):
        fields["position_embedding_type"] = "rope"
    if fields.get("norm_epsilon") is None and fields.get("layernorm_epsilon") is not None:
        fields["norm_epsilon"] = fields["layernorm_epsilon"]
    if (fields.get("tokenizer_type") == "NullTokenizer" and "null_tokenizer_pad_id" in fields
            and fields.get("null_tokenizer_eod_id") is None and fields.get("vocab_size")):
        # Megatron-Core's tokenizers (their arguments carry null_tokenizer_pad_id): the
        # vocabulary is --vocab-size ids, the last one the end of document.
        fields["null_tokenizer_eod_id"] = int(fields["vocab_size"]) - 1
    hidden = fields.get("hidden_size")
    if hidden and heads and fields.get("kv_channels") is None:
        fields["kv_channels"] = hidden // heads
    if hidden and fields.get("ffn_hidden_size") is None and not fields.get("swiglu"):
        fields["ffn_hidden_size"] = 4 * hidden
    return argparse.Namespace(**fields)


def _shape_value(ns, name: str):
    """The value of SHAPE_ARGS entry ``name`` that decides tensor shapes: a QKV bias is there
    with ``--add-qkv-bias`` or with the linear biases Megatron adds by default."""
    if name == "add_qkv_bias":
        return bool(getattr(ns, "add_qkv_bias", False) or getattr(ns, "add_bias_linear", True))
    return getattr(ns, name)


def _is_dist(iter_dir: str) -> bool:
    """Whether an iteration folder is in the torch_dist format (a DCP ``.metadata``)."""
    return os.path.isfile(os.path.join(iter_dir, ".metadata"))


def _check_args(saved, args, path: str, ignore=()) -> None:
    if saved is None:
        return
    saved = megatron_args(saved)
    diffs = [f"{_ARG_LABELS.get(n, '--' + n.replace('_', '-'))} "
             f"(checkpoint {_shape_value(saved, n)!r}, flags {_shape_value(args, n)!r})"
             for n in SHAPE_ARGS
             if n not in ignore and hasattr(saved, n) and hasattr(args, n)
             and _shape_value(saved, n) != _shape_value(args, n)]
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
    from megatron import checkpointing_dist

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
        from megatron import checkpointing_dist

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
        from megatron import checkpointing_dist

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
