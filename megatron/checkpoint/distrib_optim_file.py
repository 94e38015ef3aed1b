"""Megatron-LM's ``distrib_optim.pt``: the distributed optimizer's state beside a torch-format file.

With ``--ckpt-format torch`` and ``--use-distributed-optimizer`` Megatron-LM writes, next to each
(TP, PP) rank's ``model_optim_rng.pt`` (whose ``optimizer`` entry then holds only the param
groups and the loss scaler), a ``distrib_optim.pt``: the fp32 main parameters and Adam moments,
gathered on data-parallel rank 0 and stored flat, in the order of its gradient buffers::

    {"buckets_coalesced": True,
     0: {(param dtype, grad dtype): {"param": [n], "exp_avg": [n], "exp_avg_sq": [n],
                                     "numel_unpadded": n}},     (older files: key torch.float32)
     1: ...}                                                      one entry per gradient buffer

A model chunk has one gradient buffer per parameter dtype (in the order the dtypes first occur in
``named_parameters()``), buffers numbered chunk by chunk. A buffer lays its parameters out in
reverse ``named_parameters()`` order; each parameter starts at a multiple of 64 elements
(:data:`PARAM_ALIGN`; files written before Megatron-LM aligned parameters pack them back to back,
and are recognised by their length). A bucket closes once it holds at least the bucket size
(``--ddp-bucket-size``, default ``max(4e7, 1e6 x DP)``; only with ``--overlap-grad-reduce`` and
only in the first virtual-pipeline chunk: otherwise one bucket per buffer); a word embedding tied
across pipeline stages (``shared_embedding``) gets a bucket of its own, the bucket before it
closing at its aligned start. The flat tensors are
the buckets' contents up to their last parameter's end, concatenated: a bucket's padding to the
data-parallel size is dropped, the gaps that align parameters inside a bucket are kept. So the
file does not depend on the data-parallel size it was written at.

Files written before Megatron-LM coalesced the buckets (Feb 2024) hold, per key, a list of one
tensor per bucket and no ``buckets_coalesced``; Megatron-LM reads them with
``--ckpt-convert-update-legacy-dist-opt-format``, and so does this project: the list, joined, is
the flat tensor. A ``list`` at the top (Megatron-LM's chained optimizer) holds one such dict per
optimizer; a dense model has one.

:func:`read_param_state` turns a file into this project's ``param_state`` (per param group, per
parameter, tensors of the parameter's shape), which :class:`DistributedOptimizer` loads at any
data-parallel size. Saving does the reverse (:func:`split_for_save`): the torch-format writer of
a distributed optimizer puts the param groups (and the loss scaler) in ``model_optim_rng.pt``, as
Megatron-LM's ``DistributedOptimizer.state_dict()`` does, and the tensors in ``distrib_optim.pt``
in the current (coalesced) layout, zeros in the gaps, as Megatron-LM's
``save_parameter_state()`` writes them. The ``torch`` format has no ``param_state_sharding_type``
(that key belongs to ``torch_dist``'s optimizer state). Where this reader could not place the
tensors (experts in buffers of their own, an optimizer other than Adam), the state stays whole
in ``model_optim_rng.pt`` (this project's earlier layout, which still loads: its ``optimizer``
entry holds ``param_state``).
"""

import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.checkpoint.layout import CheckpointError
from megatron.checkpoint.safe_unpickle import torch_load

FILE_NAME = "distrib_optim.pt"
KEYS = ("param", "exp_avg", "exp_avg_sq")
PARAM_ALIGN = 64
# Megatron-Core's bucket size when --overlap-grad-reduce is on and --ddp-bucket-size is not given.
DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK = 40_000_000, 1_000_000


def file_beside(model_file: str) -> str:
    """The ``distrib_optim.pt`` in the folder of a rank's ``model_optim_rng.pt``."""
    return os.path.join(os.path.dirname(model_file), FILE_NAME)


@dataclass
class BufferSlots:
    """One gradient buffer: its parameters in buffer order and each one's first element in the
    flat tensors; ``numel_unpadded``: the flat tensors' length."""

    params: List[torch.nn.Parameter]
    offsets: List[int]
    numel_unpadded: int


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flat_offsets(numels: Sequence[int], bucket_size: Optional[int], align: int,
                 own_bucket: Sequence[bool] = ()):
    """``(offsets, total)``: where each parameter (sizes in buffer order) starts in the flat
    tensors, and their length. Every bucket starts at a multiple of 128 in Megatron-LM's buffer,
    so alignment inside a bucket is alignment relative to the bucket's start. A parameter with
    ``own_bucket`` set (a word embedding tied across pipeline stages) gets a bucket of its own:
    the open bucket closes at the parameter's aligned start (the alignment gap stays in it)."""
    offsets, flat, rel = [], 0, 0
    alone = list(own_bucket) + [False] * (len(numels) - len(own_bucket))
    for numel, own in zip(numels, alone):
        rel = _round_up(rel, align)
        if own and rel > 0:
            flat, rel = flat + rel, 0
        offsets.append(flat + rel)
        rel += numel
        if own or (bucket_size is not None and rel >= bucket_size):
            flat, rel = flat + rel, 0
    return offsets, flat + rel


def writer_bucket_size(saved_args, chunk_index: int) -> Optional[int]:
    """The bucket size Megatron-LM used for chunk ``chunk_index`` of the run that saved
    ``saved_args`` (None: one bucket)."""
    if chunk_index > 0 or not getattr(saved_args, "overlap_grad_reduce", False):
        return None
    size = getattr(saved_args, "ddp_bucket_size", None)
    if size is None:
        dp = int(getattr(saved_args, "data_parallel_size", 1) or 1)
        size = max(DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE_PER_DP_RANK * dp)
    return int(size)


def unplaceable(name: str, param: torch.nn.Parameter) -> str:
    """Why ``param`` has no place in ``distrib_optim.pt`` as read here; "" when it has."""
    if not getattr(param, "allreduce", True):
        return f"expert parameters ({name}) live in gradient buffers of their own"
    return ""


def own_bucket_flags(params: Sequence[torch.nn.Parameter]) -> List[bool]:
    """Which parameters Megatron-LM's distributed optimizer gives a bucket of their own: the
    word embedding tied across pipeline stages (``shared_embedding``)."""
    return [bool(getattr(p, "shared_embedding", False)) for p in params]


def buffer_params(chunk: torch.nn.Module, where: str) -> List[List[torch.nn.Parameter]]:
    """A chunk's trainable parameters, one list per gradient buffer, in buffer order."""
    by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
    for name, param in chunk.named_parameters():
        if not param.requires_grad:
            continue
        why = unplaceable(name, param)
        if why:
            raise CheckpointError(f"{where}: {why}; a {FILE_NAME} of such a model is not read "
                                  "here (use --ckpt-format torch_dist)")
        by_dtype.setdefault(param.dtype, []).append(param)
    return [params[::-1] for params in by_dtype.values()]


def buffer_slots(model_chunks, saved_args, align: int, where: str) -> List[BufferSlots]:
    """Every gradient buffer of ``model_chunks`` as Megatron-LM lays it out."""
    out = []
    for index, chunk in enumerate(model_chunks):
        for params in buffer_params(chunk, where):
            offsets, total = flat_offsets([p.numel() for p in params],
                                          writer_bucket_size(saved_args, index), align,
                                          own_bucket_flags(params))
            out.append(BufferSlots(params, offsets, total))
    return out


def _load_file(path: str):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: not found")
    try:
        state = torch_load(path, what=path)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or damaged file, named
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200]})") from None
    if isinstance(state, (list, tuple)):
        present = [s for s in state if s is not None]
        if len(present) != 1:
            raise CheckpointError(f"{path}: holds the state of {len(present)} optimizers; a "
                                  "dense model has one")
        state = present[0]
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict of gradient buffers, found "
                              f"{type(state).__name__}")
    return state


def _flat_tensor(value, path: str, name: str, legacy: bool) -> torch.Tensor:
    """The flat tensor of ``name`` (``buffer b dtype d 'key'``); a legacy file's list joined."""
    if legacy:
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(t, torch.Tensor) for t in value):
            raise CheckpointError(f"{path}: {name} is {type(value).__name__}, not the legacy "
                                  "list of per-bucket tensors; drop "
                                  "--ckpt-convert-update-legacy-dist-opt-format")
        value = torch.cat([t.reshape(-1) for t in value]) if value else torch.zeros(0)
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise CheckpointError(f"{path}: {name} is not a flat tensor "
                              f"({type(value).__name__} {getattr(value, 'shape', '')})")
    return value


def _buffers_of(state: dict, path: str, legacy: bool) -> List[Dict[str, torch.Tensor]]:
    """Per gradient buffer, in order: ``{key: flat tensor}`` (and the recorded length)."""
    if legacy and "buckets_coalesced" in state:
        raise CheckpointError(f"{path}: is in the current (coalesced) layout; drop "
                              "--ckpt-convert-update-legacy-dist-opt-format")
    if not legacy and "buckets_coalesced" not in state:
        raise CheckpointError(f"{path}: has no 'buckets_coalesced' entry: it is in the legacy "
                              "per-bucket layout; pass "
                              "--ckpt-convert-update-legacy-dist-opt-format to read it")
    indices = sorted(k for k in state if isinstance(k, int))
    if indices != list(range(len(indices))):
        raise CheckpointError(f"{path}: gradient buffer entries {indices} are not 0..n-1")
    out = []
    for b in indices:
        by_dtype = state[b]
        if not isinstance(by_dtype, dict) or len(by_dtype) != 1:
            raise CheckpointError(f"{path}: buffer {b} should hold one dtype entry, found "
                                  f"{list(by_dtype) if isinstance(by_dtype, dict) else by_dtype}")
        (dtype, entry), = by_dtype.items()
        missing = [k for k in KEYS if k not in entry]
        if missing:
            raise CheckpointError(f"{path}: buffer {b} {dtype} lacks {missing}")
        flats = {k: _flat_tensor(entry[k], path, f"buffer {b} {dtype} '{k}'", legacy)
                 for k in KEYS}
        flats["numel_unpadded"] = entry.get("numel_unpadded")
        flats["name"] = f"buffer {b} {dtype}"
        out.append(flats)
    return out


def _matching_slots(model_chunks, saved_args, flats, path: str) -> List[BufferSlots]:
    """The layout (aligned parameters, else packed ones) whose lengths are the file's."""
    tried = []
    for align in (PARAM_ALIGN, 1):
        slots = buffer_slots(model_chunks, saved_args, align, path)
        if len(slots) != len(flats):
            raise CheckpointError(f"{path}: holds {len(flats)} gradient buffers, this model "
                                  f"has {len(slots)}")
        if all(s.numel_unpadded == f[k].numel() for s, f in zip(slots, flats) for k in KEYS):
            return slots
        tried.append([s.numel_unpadded for s in slots])
    for i, f in enumerate(flats):
        for k in KEYS:
            if f[k].numel() != tried[0][i]:
                raise CheckpointError(
                    f"{path}: {f['name']} '{k}' has {f[k].numel()} elements, this model's "
                    f"buffer needs {tried[0][i]} ({tried[1][i]} in files without parameter "
                    "alignment): truncated, or saved from another model")
    raise CheckpointError(f"{path}: tensor lengths match no layout of this model ({tried})")


def read_param_state(path: str, model_chunks, model_param_groups, saved_args,
                     legacy: bool = False) -> List[List[dict]]:
    """``param_state[g][i]`` = ``{"param", "exp_avg", "exp_avg_sq"}`` (fp32, the parameter's
    shape) of parameter ``i`` of group ``g`` of ``model_param_groups``, from a
    ``distrib_optim.pt`` written for these ``model_chunks`` by a run with ``saved_args``."""
    flats = _buffers_of(_load_file(path), path, legacy)
    slots = _matching_slots(model_chunks, saved_args, flats, path)
    per_param = {}
    for buf, flat in zip(slots, flats):
        for param, offset in zip(buf.params, buf.offsets):
            per_param[param] = {
                k: flat[k][offset:offset + param.numel()].to(torch.float32).reshape(param.shape)
                .clone() for k in KEYS}
    missing = [i for group in model_param_groups for i, p in enumerate(group)
               if p not in per_param]
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} optimized parameters are in no gradient "
                              "buffer of the model")
    return [[per_param[p] for p in group] for group in model_param_groups]


def is_megatron_layout(saved_optimizer) -> bool:
    """Whether a torch-format file's ``optimizer`` entry is Megatron-LM's distributed optimizer
    state: param groups only (without their ``params``), the tensors in ``distrib_optim.pt``."""
    if isinstance(saved_optimizer, list) and len(saved_optimizer) == 1:
        saved_optimizer = saved_optimizer[0]
    if not isinstance(saved_optimizer, dict) or "param_state" in saved_optimizer:
        return False
    groups = saved_optimizer.get("optimizer", {}).get("param_groups")
    return isinstance(groups, list) and "state" not in saved_optimizer["optimizer"] and all(
        isinstance(g, dict) and "params" not in g for g in groups)


def has_megatron_layout(saved_optimizer, optimizer, model_file: str = "") -> bool:
    """Whether ``saved_optimizer`` is in Megatron-LM's distributed optimizer layout
    (:func:`is_megatron_layout`) and this run's optimizer is the distributed one that reads it;
    with such a file and another optimizer, an error naming ``model_file``."""
    if not is_megatron_layout(saved_optimizer):
        return False
    if not hasattr(optimizer, "model_param_groups"):
        raise CheckpointError(f"{model_file}: its optimizer state was saved by the distributed "
                              f"optimizer (the tensors in {FILE_NAME}); pass "
                              "--use-distributed-optimizer to load it, or --no-load-optim")
    return True


def _group_key(group: dict):
    return (float(group.get("wd_mult", 1.0)), float(group.get("lr_mult", 1.0)))


def _ordered_groups(saved: List[dict], ours: List[dict], path: str) -> List[dict]:
    """``saved`` in the order of ``ours``: by (``wd_mult``, ``lr_mult``) where both sides name
    them and they tell the groups apart, else as saved."""
    if len(saved) != len(ours):
        raise CheckpointError(f"{path}: the optimizer has {len(saved)} param groups, this "
                              f"run's has {len(ours)}")
    keyed = all("wd_mult" in g and "lr_mult" in g for g in saved + ours)
    by_key = {_group_key(g): g for g in saved}
    if not keyed or len(by_key) != len(saved) or set(by_key) != {_group_key(g) for g in ours}:
        return [dict(g) for g in saved]
    return [dict(by_key[_group_key(g)]) for g in ours]


def project_state(saved_optimizer, model_file: str, model_chunks, optimizer, saved_args,
                  legacy: bool = False) -> dict:
    """Megatron-LM's distributed optimizer state of ``model_file`` (its ``optimizer`` entry
    and the ``distrib_optim.pt`` beside it) in the layout :class:`DistributedOptimizer` loads."""
    if isinstance(saved_optimizer, list):
        saved_optimizer = saved_optimizer[0]
    path = file_beside(model_file)
    param_state = read_param_state(path, model_chunks, optimizer.model_param_groups,
                                   saved_args, legacy)
    groups = _ordered_groups(saved_optimizer["optimizer"]["param_groups"],
                             optimizer.group_metadata(), model_file)
    out = {"optimizer": {"param_groups": groups}, "param_state": param_state}
    if "grad_scaler" in saved_optimizer:
        out["grad_scaler"] = saved_optimizer["grad_scaler"]
    return out


def megatron_layout_refusal(model_chunks, optimizer) -> str:
    """Why this run's distributed optimizer state cannot be written as ``distrib_optim.pt``
    (then it stays in ``model_optim_rng.pt``); "" when it can."""
    if getattr(getattr(optimizer, "config", None), "optimizer", "adam") != "adam":
        return (f"--optimizer {optimizer.config.optimizer} keeps other state than Adam's "
                "exp_avg / exp_avg_sq")
    if any(key[2] for key in getattr(optimizer, "grad_buffers", {})):
        return "expert parameters live in gradient buffers of their own"
    if any(getattr(chunk, "weight_shard_grad_buffers", None) for chunk in model_chunks):
        return "weight-sharded parameters live in gradient buffers of their own"
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            why = param.requires_grad and unplaceable(name, param)
            if why:
                return why
    return ""


def _grad_dtypes(optimizer) -> Dict[torch.nn.Parameter, torch.dtype]:
    """Each parameter's gradient buffer dtype (the second half of Megatron-LM's key)."""
    out = {}
    for (_, dtype, _), grad_buffer in getattr(optimizer, "grad_buffers", {}).items():
        for param in grad_buffer.param_index_map:
            out[param] = dtype
    return out


def coalesced_state(param_state, model_chunks, model_param_groups, saved_args,
                    grad_dtypes: Optional[Dict] = None) -> dict:
    """The ``distrib_optim.pt`` content of ``param_state`` (as :func:`read_param_state`
    returns it) for ``model_chunks`` saved with ``saved_args``: flat fp32 tensors per gradient
    buffer, parameters at their aligned offsets, zeros between them."""
    values = {p: entry for group, entries in zip(model_param_groups, param_state)
              for p, entry in zip(group, entries)}
    grad_dtypes = grad_dtypes or {}
    out, index = {"buckets_coalesced": True}, 0
    for chunk_index, chunk in enumerate(model_chunks):
        for params in buffer_params(chunk, "saving"):
            offsets, total = flat_offsets([p.numel() for p in params],
                                          writer_bucket_size(saved_args, chunk_index),
                                          PARAM_ALIGN, own_bucket_flags(params))
            entry = {k: torch.zeros(total, dtype=torch.float32) for k in KEYS}
            for param, offset in zip(params, offsets):
                if param not in values:
                    raise CheckpointError(f"saving {FILE_NAME}: a parameter of shape "
                                          f"{tuple(param.shape)} is in no param group")
                for k in KEYS:
                    entry[k][offset:offset + param.numel()] = \
                        values[param][k].detach().reshape(-1).to("cpu", torch.float32)
            entry["numel_unpadded"] = total
            dtype_key = (params[0].dtype, grad_dtypes.get(params[0], torch.float32))
            out[index] = {dtype_key: entry}
            index += 1
    return out


# Keys Megatron-LM's param groups hold that this project's do not: Megatron-Core's distributed
# optimizer matches saved groups to its own by (wd_mult, lr_mult, is_expert_parallel,
# is_decoupled_lr), and its fused Adam reads bias_correction from each group.
MEGATRON_GROUP_KEYS = {"is_expert_parallel": False, "is_decoupled_lr": False,
                       "bias_correction": True}


def split_for_save(optimizer_state: dict, model_chunks, optimizer,
                   saved_args) -> Tuple[dict, dict]:
    """``(model_optim_rng.pt's optimizer entry, distrib_optim.pt's content)`` of this project's
    unsharded distributed optimizer state (DP rank 0's :meth:`state_dict`)."""
    groups = [{**MEGATRON_GROUP_KEYS, **{k: v for k, v in group.items() if k != "params"}}
              for group in optimizer_state["optimizer"]["param_groups"]]
    entry = {"optimizer": {"param_groups": groups}}
    if "grad_scaler" in optimizer_state:
        entry["grad_scaler"] = optimizer_state["grad_scaler"]
    content = coalesced_state(optimizer_state["param_state"], model_chunks,
                              optimizer.model_param_groups, saved_args, _grad_dtypes(optimizer))
    return entry, content


# Saved names of a word embedding tied across pipeline stages (``shared_embedding``): the first
# stage's table and the last stage's copy for the head.
TIED_EMBEDDING_NAMES = ("embedding.word_embeddings.weight", "word_embeddings_for_head.weight")


def _tied_over_stages(saved_args) -> bool:
    return int(getattr(saved_args, "pipeline_model_parallel_size", 1) or 1) > 1 and not getattr(
        saved_args, "untie_embeddings_and_output_weights", True)


def tree_param_state(model_file: str, order, dtypes, saved_args) -> list:
    """Per parameter of ``order`` (``(chunk, name, shape)`` of a rank's saved model trees, in
    the model's order; ``dtypes`` alike), ``{"param", "exp_avg", "exp_avg_sq"}`` read from the
    ``distrib_optim.pt`` beside ``model_file``, for readers without the model's modules (the
    converter). The buffers are laid out as for modules: per chunk, per dtype, reversed; with
    embeddings tied over pipeline stages, the tables named :data:`TIED_EMBEDDING_NAMES` in
    buckets of their own."""
    path = file_beside(model_file)
    content = _load_file(path)
    flats = _buffers_of(content, path, legacy="buckets_coalesced" not in content)
    tied = _tied_over_stages(saved_args)
    layout = []  # (chunk index, [(position in order, numel, own bucket)]) per buffer
    for chunk in sorted({c for c, _, _ in order}):
        by_dtype: Dict[torch.dtype, list] = {}
        for i, (c, name, shape) in enumerate(order):
            if c == chunk:
                own = tied and name.endswith(TIED_EMBEDDING_NAMES)
                by_dtype.setdefault(dtypes[i], []).append(
                    (i, int(torch.Size(shape).numel()), own))
        layout += [(chunk, members[::-1]) for members in by_dtype.values()]
    if len(layout) != len(flats):
        raise CheckpointError(f"{path}: holds {len(flats)} gradient buffers, the model files "
                              f"have {len(layout)}")
    out: list = [None] * len(order)
    for (chunk, members), flat in zip(layout, flats):
        for align in (PARAM_ALIGN, 1):
            offsets, total = flat_offsets([n for _, n, _ in members],
                                          writer_bucket_size(saved_args, chunk), align,
                                          [own for _, _, own in members])
            if total == flat["param"].numel():
                break
        else:
            raise CheckpointError(f"{path}: {flat['name']} has {flat['param'].numel()} "
                                  f"elements, the model's buffer needs {total}")
        for (i, numel, _), offset in zip(members, offsets):
            out[i] = {k: flat[k][offset:offset + numel].to(torch.float32)
                      .reshape(order[i][2]).clone() for k in KEYS}
    return out
