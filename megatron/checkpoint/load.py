"""Load checkpoints of either format into a run, checking everything before anything changes.

:func:`load_checkpoint` (training: model, optimizer, scheduler, RNG states, the run's position),
:func:`load_model_weights` (inference and evaluation) and :func:`load_args_from_checkpoint`
(``--use-checkpoint-args``). A ``torch``-format folder saved at this run's tensor and pipeline
sizes loads rank file by rank file, one saved at another expert-parallel size through
:mod:`megatron.checkpoint.experts`; a ``torch_dist`` folder loads at any layout through
:mod:`megatron.checkpoint.torch_dist`; ``fsdp_dtensor`` and ``torch_dcp`` folders load into fully
sharded runs (:mod:`megatron.checkpoint.fsdp_dtensor`, :mod:`megatron.checkpoint.torch_dcp`).

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

from megatron.checkpoint import (distrib_optim_file, experts, fsdp_dtensor, integrity,
                                 mcore_torch, non_persistent, torch_dcp, torch_dist)
from megatron.checkpoint.config import CheckpointConfig
from megatron.core.msc import is_msc_url
from megatron.checkpoint.dist.reader import is_dist_checkpoint
from megatron.checkpoint.layout import (TRACKER_FILENAME, CheckpointError, expert_ranks,
                                        iteration_dir, load_state_file, rank_file_in, read_tracker,
                                        saved_sizes)
from megatron.checkpoint.router_bias import (fill_zero_router_bias, note_zero_router_bias,
                                           optimizer_refusal)
from megatron.checkpoint.saved_args import (CHECKPOINT_ARGS, MOE_CHECKPOINT_ARGS, MP_ARGS,
                                            OTHER_CHECKPOINT_ARGS, RUN_FIRST_ARGS,
                                            TOKENIZER_MODEL_ARGS,
                                            check_args, checkpoint_args, megatron_args,
                                            refuse_torch_load)
from megatron.checkpoint.state import main_values_of, set_rng_state_snapshot
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
    iter_dir = iteration_dir(load_dir, iteration, release)
    if not os.path.isdir(iter_dir):
        raise CheckpointError(f"{iter_dir}: missing (named by {TRACKER_FILENAME} or --ckpt-step)")
    if getattr(args, "verify_integrity", False):
        integrity.verify(iter_dir)
    if is_dist_checkpoint(iter_dir):
        return iter_dir, iteration, release  # torch_dist: any saved layout loads
    refuse_torch_load(args, pstate, None, iter_dir)
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
        # Another expert-parallel size: experts.py assembles this rank's state.
        return _EPReshard(iter_dir, saved_ep), iteration, release
    path = rank_file_in(iter_dir, pstate.tp_rank, pstate.pp_rank, pstate.pp_size, ep_rank,
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
        return experts.load_resharded(located.iter_dir, located.saved_ep,
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


def _check_model_state(model_chunks, state: dict, path: str) -> Tuple[List[dict], List[str]]:
    """Every chunk's saved tensors, checked against the model's keys and shapes, and the router
    biases an older checkpoint lacks, filled with zeros (:mod:`megatron.checkpoint.router_bias`)."""
    if len(model_chunks) == 1:
        saved = [state.get("model")]
    else:
        saved = [state.get(f"model{i}") for i in range(len(model_chunks))]
    filled = []
    for i, (chunk, tree) in enumerate(zip(model_chunks, saved)):
        if tree is None:
            raise CheckpointError(f"{path}: no model state for model chunk {i}")
        if not isinstance(tree, dict):
            raise CheckpointError(f"{path}: the model state of chunk {i} is a "
                                  f"{type(tree).__name__}, not a dict of tensors")
        template = chunk.state_dict_for_save_checkpoint()
        if mcore_torch.is_mcore_state(tree):
            tree = saved[i] = mcore_torch.to_model_names(
                template, tree, mla=any(mcore_torch.is_mla_name(n) for n in _shapes(template)))
        filled += fill_zero_router_bias(template, tree)
        want = _shapes(template)
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
    note_zero_router_bias(path, filled)
    return saved, filled


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
    picked = _pick_non_persistent(args)
    if picked is not None:
        kind, iteration, folder, holder = picked
        if kind == "global":
            inner = argparse.Namespace(**vars(args))
            inner.load, inner.non_persistent_ckpt_type = folder, None
            return _load(model_chunks, optimizer, opt_param_scheduler, inner, pstate,
                         train_state)
        state, path = non_persistent.fetch_local(folder, iteration, holder)
        return _apply_rank_state(state, path, iteration, False, model_chunks, optimizer,
                                 opt_param_scheduler, args, pstate, train_state, folder)
    located = _locate(args.load, args, pstate)
    if located is None:
        return 0
    path, iteration, release = located
    if not isinstance(path, _EPReshard) and torch_dcp.is_torch_dcp_checkpoint(path):
        return _load_torch_dcp(path, iteration, release, model_chunks, optimizer,
                               opt_param_scheduler, args, pstate, train_state)
    if not isinstance(path, _EPReshard) and fsdp_dtensor.is_fsdp_dtensor_checkpoint(path):
        return _load_fsdp_dtensor(path, iteration, release, model_chunks, optimizer,
                                  opt_param_scheduler, args, pstate, train_state)
    if not isinstance(path, _EPReshard) and is_dist_checkpoint(path):
        return _load_dist(path, iteration, release, model_chunks, optimizer, opt_param_scheduler,
                          args, pstate, train_state)
    state, path = _read_rank_state(path, model_chunks, args, pstate)
    return _apply_rank_state(state, path, iteration, release, model_chunks, optimizer,
                             opt_param_scheduler, args, pstate, train_state, args.load)


def _pick_non_persistent(args) -> Optional[tuple]:
    """``(kind, iteration, folder, holders)`` of the newest complete non-persistent checkpoint
    when it is at least as new as the persistent one in --load, else None; says which it took.
    Collective for local checkpoints (every rank decides from the same inventory)."""
    kind = getattr(args, "non_persistent_ckpt_type", None)
    if kind not in ("global", "local") or args.ckpt_step is not None:
        return None
    tracked = read_tracker(args.load)
    persistent = -1 if tracked is None else tracked[0]
    holder = None
    if kind == "global":
        folder = non_persistent.global_dir(args, args.load)
        found = read_tracker(folder) if os.path.isdir(folder) else None
        newest = -1 if found is None or found[1] else found[0]
    else:
        folder = args.non_persistent_local_ckpt_dir
        newest, holder = non_persistent.newest_local(folder)
    if newest < 0:
        return None
    where = ("none" if tracked is None else f"iteration {persistent}")
    if newest < persistent:
        if dist.get_rank() == 0:
            print(f"NOTE: the {kind} non-persistent checkpoint in {folder} (iteration {newest}) "
                  f"is older than the persistent one in --load {args.load} ({where}); resuming "
                  "from the persistent one", flush=True)
        return None
    if dist.get_rank() == 0:
        print(f"NOTE: resuming from the {kind} non-persistent checkpoint in {folder} at "
              f"iteration {newest} (persistent checkpoint in --load {args.load}: {where})",
              flush=True)
    return kind, newest, folder, holder


def _apply_rank_state(state: dict, path: str, iteration: int, release: bool, model_chunks,
                      optimizer, opt_param_scheduler, args, pstate,
                      train_state: Optional[TrainState], where: str) -> int:
    """Check one rank's torch-format state against the run, then load it; ``where`` is the
    folder the success line names."""
    saved_args = state.get("args")
    refuse_torch_load(args, pstate, saved_args, path)
    check_args(saved_args, args, path)
    mcore_names = any(mcore_torch.is_mcore_state(state.get(key)) for key in state
                      if key == "model" or key.startswith("model"))
    trees, filled = _check_model_state(model_chunks, state, path)
    restore_training = not (args.finetune or release)
    load_optim, load_rng = _converted_parts(state, path, restore_training, args)
    if load_optim and mcore_names and "optimizer" in state:
        raise CheckpointError(
            f"{path}: a Megatron-Core model saved with --ckpt-format torch: its optimizer state "
            "lists the parameters in Megatron-Core's module order, which is not mapped here; "
            "pass --no-load-optim (the weights load, Adam starts afresh) or --finetune, or "
            "resume from a --ckpt-format torch_dist save of the run")
    if load_optim and filled:
        raise CheckpointError(optimizer_refusal(path, filled))
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
        optimizer.load_state_dict(_optimizer_state(state, path, model_chunks, optimizer, args))
        opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        # Fresh optimizer over the loaded weights (fp32 main copies must follow the model, or
        # with --load-main-params-from-ckpt take the checkpoint's values themselves).
        optimizer.reload_model_params(
            main_values_of(model_chunks, trees) if args.load_main_params_from_ckpt else None)
        if (restore_training and not args.no_load_optim and "conversion" in state
                and "opt_param_scheduler" in state):
            # A converted checkpoint keeps the learning-rate schedule's position.
            opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    if load_rng:
        rng = state["rng_state"]
        set_rng_state_snapshot(rng[pstate.dp_rank] if len(rng) == pstate.dp_size else rng[0])
    if not restore_training:
        iteration = 0
    elif train_state is not None:
        train_state.restore_from_saved_args(saved_args)
        train_state.rerun_checkpoint = state.get("rerun_state_machine")
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {where} at iteration {iteration}",
              flush=True)
    return iteration


def _optimizer_state(state: dict, path: str, model_chunks, optimizer, args):
    """The file's optimizer state; Megatron-LM's distributed optimizer keeps its tensors in the
    ``distrib_optim.pt`` beside the file, read here into this project's layout."""
    saved = state["optimizer"]
    if not distrib_optim_file.has_megatron_layout(saved, optimizer, path):
        return saved
    return distrib_optim_file.project_state(
        saved, path, model_chunks, optimizer, state.get("args"),
        legacy=getattr(args, "ckpt_convert_update_legacy_dist_opt_format", False))


def _load_dist(iter_dir, iteration, release, model_chunks, optimizer, opt_param_scheduler,
               args, pstate, train_state: Optional[TrainState]) -> int:
    common = torch_dist.load_checkpoint(iter_dir, iteration, release, model_chunks, optimizer,
                                        opt_param_scheduler, args, pstate)
    if args.finetune or release:
        iteration = 0
    elif train_state is not None:
        train_state.restore_from_saved_args(common.get("args"))
        train_state.rerun_checkpoint = common.get("rerun_state_machine")
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {iteration} "
              "(torch_dist)", flush=True)
    return iteration


def _load_fsdp_dtensor(iter_dir, iteration, release, model_chunks, optimizer,
                       opt_param_scheduler, args, pstate,
                       train_state: Optional[TrainState]) -> int:
    saved = fsdp_dtensor.load_checkpoint(iter_dir, iteration, release, model_chunks, optimizer,
                                         opt_param_scheduler, args, pstate)
    if args.finetune or release:
        iteration = 0
    elif train_state is not None:
        train_state.restore_from_saved_args(saved)
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {iteration} "
              f"({fsdp_dtensor.FORMAT})", flush=True)
    return iteration


def _load_torch_dcp(iter_dir, iteration, release, model_chunks, optimizer, opt_param_scheduler,
                    args, pstate, train_state: Optional[TrainState]) -> int:
    saved = torch_dcp.load_checkpoint(iter_dir, iteration, release, model_chunks, optimizer,
                                      opt_param_scheduler, args, pstate)
    if args.finetune or release:
        iteration = 0
    elif train_state is not None:
        train_state.restore_from_saved_args(saved)
    if dist.get_rank() == 0:
        print(f"  successfully loaded checkpoint from {args.load} at iteration {iteration} "
              f"({torch_dcp.FORMAT})", flush=True)
    return iteration


def _saved_args_in(load_dir: str, what: str, verify: bool = False) -> argparse.Namespace:
    """The args saved in the checkpoint ``load_dir``'s tracker names, in this project's
    conventions (:func:`megatron_args`); ``what`` names the flag that asked, for errors;
    ``verify`` (--verify-integrity) checks the folder's files first."""
    tracked = read_tracker(load_dir)
    if tracked is None:
        raise CheckpointError(f"{what}: no {TRACKER_FILENAME} in {load_dir}")
    iteration, release = tracked
    iter_dir = iteration_dir(load_dir, iteration, release)
    if verify and os.path.isdir(iter_dir):
        integrity.verify(iter_dir)
    if fsdp_dtensor.is_fsdp_dtensor_checkpoint(iter_dir):
        saved = megatron_args(fsdp_dtensor.saved_args(iter_dir))
    elif is_dist_checkpoint(iter_dir):
        saved = megatron_args(torch_dist.saved_args(iter_dir))
    else:
        _, saved_pp, saved_ep = saved_sizes(iter_dir)
        saved = megatron_args(load_state_file(rank_file_in(iter_dir, 0, 0, saved_pp, 0,
                                                            saved_ep)).get("args"))
    if saved is None:
        raise CheckpointError(f"{iter_dir}: the checkpoint holds no args")
    return saved


def load_args_from_checkpoint(args) -> argparse.Namespace:
    """--use-checkpoint-args: take the flags that give the weights their meaning from the
    checkpoint in --load, as Megatron does.

    A flag is taken only where the checkpoint recorded a value (a converted checkpoint may name
    no tokenizer, say). The model's sizes and the sequence length (:data:`RUN_FIRST_ARGS`) are
    taken only when this run gives none: a run's own ``--seq-length`` stays (a longer context
    from a shorter-context checkpoint), and a size that differs from the file's is refused on
    load, naming the flag. The rest (:data:`CHECKPOINT_ARGS`, the mixture-of-experts routing,
    the multi-token prediction depth, the dropout rates, the tiktoken pattern) always comes from
    the file. Also the tokenizer type and model file unless
    --no-use-tokenizer-model-from-checkpoint-args, and the tensor, pipeline and expert parallel
    sizes only with --use-mp-args-from-checkpoint-args."""
    if not args.load:
        raise CheckpointError("--use-checkpoint-args needs --load")
    if is_msc_url(args.load):
        raise CheckpointError(f"--use-checkpoint-args with --load {args.load}: the flags are read "
                              "before the msc:// checkpoint is downloaded; give the model flags, "
                              "or a local copy of the checkpoint as --load")
    saved = _saved_args_in(args.load, "--use-checkpoint-args",
                           getattr(args, "verify_integrity", False))
    names = list(CHECKPOINT_ARGS) + list(MOE_CHECKPOINT_ARGS) + list(OTHER_CHECKPOINT_ARGS)
    if args.use_tokenizer_model_from_checkpoint_args:
        names += TOKENIZER_MODEL_ARGS
    if args.use_mp_args_from_checkpoint_args:
        names += MP_ARGS
    from megatron.training.arguments import flag_names_and_defaults

    _, flags, defaults = flag_names_and_defaults()
    run_first = set(RUN_FIRST_ARGS) | {MP_ARGS[-1]}
    replaced = []
    for name in names:
        value, mine = getattr(saved, name, None), getattr(args, name, None)
        if value is None or (name in run_first and mine is not None):
            continue
        if name in flags and mine != defaults.get(name) and mine != value:
            replaced.append(f"{flags[name]} {mine} -> {value}")
        setattr(args, name, value)
    if replaced and getattr(args, "rank", 0) == 0:
        print(f"NOTE: --use-checkpoint-args: the checkpoint in --load {args.load} sets "
              f"{', '.join(replaced)} over this run's flags, as Megatron does", flush=True)
    if getattr(saved, "num_experts", None) is None:
        args.moe_ffn_hidden_size = None  # a dense checkpoint: no expert size of the run's
    return args


def null_tokenizer_eod_from_checkpoint(args) -> argparse.Namespace:
    """A NullTokenizer run that starts from a checkpoint (--load, else
    --pretrained-checkpoint) keeps the end-of-document id, and so the number of ids, that
    checkpoint was written with, unless --null-tokenizer-eod-id says otherwise: ``--vocab-size
    V`` meant V + 1 ids with the end of document V in Megatron's legacy tokenizer and in this
    project's older checkpoints, and means V ids with V - 1 today.

    Nothing changes without a checkpoint there yet (a fresh run), or when the checkpoint was
    not written for the same --vocab-size.
    """
    if (getattr(args, "tokenizer_type", None) != "NullTokenizer"
            or args.null_tokenizer_eod_id is not None):
        return args
    if is_msc_url(args.load) and getattr(args, "enable_msc", False):
        # An msc:// --load is read before its mirror is filled: its recorded args directly.
        import tempfile

        from megatron.checkpoint import object_storage

        with tempfile.TemporaryDirectory() as tmp:
            iter_dir = object_storage.fetch_common_files(args.load, tmp)
            if iter_dir is None:
                return args
            saved = megatron_args(torch_dist.saved_args(iter_dir))
    else:
        folders = [(args.load, "--load"),
                   (getattr(args, "pretrained_checkpoint", None), "--pretrained-checkpoint")]
        found = [(f, flag) for f, flag in folders
                 if f and not is_msc_url(f) and read_tracker(f) is not None]
        if not found:
            return args
        folder, flag = found[0]
        saved = _saved_args_in(folder, f"{flag} {folder}",
                               getattr(args, "verify_integrity", False))
    if (getattr(saved, "tokenizer_type", None) == "NullTokenizer"
            and getattr(saved, "vocab_size", None) == args.vocab_size):
        args.null_tokenizer_eod_id = getattr(saved, "null_tokenizer_eod_id", None)
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
    if not isinstance(path, _EPReshard) and torch_dcp.is_torch_dcp_checkpoint(path):
        torch_dcp.load_checkpoint(path, iteration, release, model_chunks, None, None, args,
                                  pstate, weights_only=True)
        if dist.get_rank() == 0:
            print(f"  loaded model weights from {args.load} at iteration {iteration}",
                  flush=True)
        return iteration
    if not isinstance(path, _EPReshard) and fsdp_dtensor.is_fsdp_dtensor_checkpoint(path):
        fsdp_dtensor.load_checkpoint(path, iteration, release, model_chunks, None, None, args,
                                     pstate, weights_only=True)
        if dist.get_rank() == 0:
            print(f"  loaded model weights from {args.load} at iteration {iteration}",
                  flush=True)
        return iteration
    if not isinstance(path, _EPReshard) and is_dist_checkpoint(path):
        torch_dist.load_checkpoint(path, iteration, release, model_chunks, None, None, args,
                                   pstate, weights_only=True)
        if dist.get_rank() == 0:
            print(f"  loaded model weights from {args.load} at iteration {iteration}",
                  flush=True)
        return iteration
    state, path = _read_rank_state(path, model_chunks, args, pstate)
    refuse_torch_load(args, pstate, state.get("args"), path)
    check_args(state.get("args"), args, path)
    trees, _ = _check_model_state(model_chunks, state, path)
    for chunk, tree in zip(model_chunks, trees):
        chunk.load_state_dict(tree, strict=True)
    if dist.get_rank() == 0:
        print(f"  loaded model weights from {args.load} at iteration {iteration}", flush=True)
    return iteration
