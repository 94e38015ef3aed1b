"""A model chunk's state to and from ``torch_dist`` shards, at any layout.

Saving (every rank, its own chunks)::

    items = []
    for vp_rank, chunk in enumerate(model_chunks):
        layout = chunk_layout(config, pstate, vp_rank if len(model_chunks) > 1 else None)
        items += model_shards(chunk.state_dict_for_save_checkpoint(), layout)
    items += extra_state_objects(layout, num_local_layers)     # per chunk (empty entries)
    items += common_objects(common_state if rank == 0 else None, rng_states,
                            pp_rank, pp_size, tp_rank, tp_size)  # rng: DP rank 0 of each
    save_shards(iter_dir, items)                               # collective

Loading (any rank, any layout; no process group needed)::

    reader = DistCheckpointReader(iter_dir)
    for vp_rank, chunk in enumerate(model_chunks):
        layout = chunk_layout(config, pstate, vp_rank if len(model_chunks) > 1 else None)
        chunk.load_state_dict(load_model_state(
            reader, chunk.state_dict_for_save_checkpoint(), layout))

The state is the nested dict ``state_dict_for_save_checkpoint`` returns (legacy names, layers
numbered within the chunk); :mod:`megatron.checkpoint.dist.keys` maps it.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from megatron.checkpoint.dist.keys import (OPTIMIZER_STATE_PREFIX, ChunkLayout, Placement,
                                           LAYER_NAME, MTP_PREFIX, extra_state_keys,
                                           heterogeneous_extra_state_modules, is_expert_key,
                                           per_layer_prefix,
                                           is_per_layer_key, mla_attention_modules,
                                           mtp_extra_state_keys, object_key, per_layer_keys,
                                           placements, stored_key)
from megatron.checkpoint.dist.reader import DistCheckpointError, DistCheckpointReader
from megatron.checkpoint.dist.writer import ObjectShard, TensorShard
from megatron.model.module import flatten_state_dict


def chunk_layout(config, pstate, vp_rank: Optional[int] = None,
                 num_experts: Optional[int] = None, moe_layer_freq=1) -> ChunkLayout:
    """The :class:`ChunkLayout` of this rank's model chunk ``vp_rank`` (None without virtual
    stages): ``config`` the model's ``TransformerConfig`` (layers, uneven first / last stages,
    ``swiglu``), ``pstate`` its ``ParallelState`` (or any object with ``tp_rank``, ``tp_size``,
    ``pp_rank``, ``pp_size``, ``virtual_pp_size`` and optionally ``dp_rank`` / ``dp_cp_rank``);
    ``num_experts``: ``--num-experts`` of an MoE model; with an ``ep_group`` (expert
    parallelism) rank e of it holds experts ``e * E / ep ...`` and its ``expert_dp_group`` rank
    0 writes them. The experts are split by ``pstate.expert_tp_rank`` and
    ``pstate.layout.expert_tp_size`` (``--expert-tensor-parallel-size``; without them, by TP).

    The ranks of a data x context-parallel group hold the same weights: only its rank 0
    writes them (``dp_cp_rank`` is the rank in that group; without context parallelism it is
    the data-parallel rank). ``moe_layer_freq``: ``--moe-layer-freq`` of an MoE model; an
    integer above 1 or a list gives per-layer keys (:func:`~megatron.checkpoint.dist.keys.
    per_layer_keys`), as in Megatron-Core."""
    from megatron.model.transformer import get_num_layers_and_offset

    blocks = getattr(config, "heterogeneous_blocks", None)
    vp_size = getattr(pstate, "virtual_pp_size", None)
    _, offset = get_num_layers_and_offset(config, pstate.pp_size, pstate.pp_rank, vp_size,
                                          vp_rank if vp_size is not None else None)
    dp_rank = getattr(pstate, "dp_cp_rank", getattr(pstate, "dp_rank", 0))
    tp_rank = getattr(pstate, "tp_rank", 0)
    expert_offset, expert_dp_rank = 0, dp_rank
    expert_tp_rank, expert_tp_size = tp_rank, pstate.tp_size
    ep_group = getattr(pstate, "ep_group", None)
    if num_experts and ep_group is not None:
        from megatron.core.collectives import get_group_rank, get_group_size

        expert_offset = get_group_rank(ep_group) * (num_experts // get_group_size(ep_group))
        expert_dp_rank = get_group_rank(pstate.expert_dp_group)
    if num_experts and hasattr(pstate, "layout"):
        expert_tp_rank, expert_tp_size = pstate.expert_tp_rank, pstate.layout.expert_tp_size
    return ChunkLayout(num_layers=config.num_layers, layer_offset=offset,
                       tp_rank=tp_rank, tp_size=pstate.tp_size,
                       dp_rank=dp_rank,
                       swiglu=config.swiglu or getattr(config, "quick_geglu", False),
                       num_experts=num_experts,
                       expert_offset=expert_offset, expert_dp_rank=expert_dp_rank,
                       expert_tp_rank=expert_tp_rank, expert_tp_size=expert_tp_size,
                       per_layer=(bool(num_experts) and per_layer_keys(moe_layer_freq)
                                  or bool(blocks)),
                       mla=getattr(config, "multi_latent_attention", False), blocks=blocks,
                       mla_q_lora_rank=(getattr(config, "q_lora_rank", None)
                                        if getattr(config, "multi_latent_attention", False)
                                        else None))


def _lead(tensor: torch.Tensor, place: Placement) -> torch.Tensor:
    """``tensor`` with the placement's stacked axes (size 1) in front."""
    return tensor.view((1,) * int(place.stacked) + tuple(tensor.shape))


def _piece(tensor: torch.Tensor, place: Placement) -> torch.Tensor:
    if place.local_rows is not None:
        tensor = tensor[place.local_rows[0]:place.local_rows[1]]
    return _lead(tensor, place)


def tensor_shards(name: str, tensor: torch.Tensor, layout: ChunkLayout,
                  prefix: str = "") -> List[TensorShard]:
    """The pieces this chunk writes of its local tensor ``name`` (legacy dotted name), keyed
    ``prefix + <Megatron-Core key>`` (``prefix``: e.g. ``optimizer.state.exp_avg.``)."""
    return [TensorShard(prefix + p.key, _piece(tensor, p), p.global_shape, p.global_offset)
            for p in placements(name, tuple(tensor.shape), layout) if p.written]


def model_shards(state: dict, layout: ChunkLayout) -> List[TensorShard]:
    """Every piece this chunk writes of its model state (nested or flat legacy names)."""
    shards = []
    for name, tensor in flatten_state_dict(state).items():
        if isinstance(tensor, torch.Tensor):
            shards += tensor_shards(name, tensor, layout)
    return shards


def optimizer_state_shards(name: str, moments: Dict[str, torch.Tensor],
                           layout: ChunkLayout) -> List[TensorShard]:
    """The pieces of one parameter's optimizer tensors (``{"exp_avg": t, "exp_avg_sq": t}``,
    each shaped like the local parameter ``name``), under Megatron-Core's keys
    ``optimizer.state.<state name>.<model key>`` (its non-distributed optimizer layout)."""
    shards = []
    for state_name, tensor in moments.items():
        shards += tensor_shards(name, tensor, layout, f"{OPTIMIZER_STATE_PREFIX}{state_name}.")
    return shards


def flat_boxes(shape: Tuple[int, ...], start: int, end: int) -> List[Tuple[Tuple[int, ...],
                                                                       Tuple[int, ...]]]:
    """Boxes ``(offset, sizes)`` of a tensor of ``shape`` that together hold exactly the
    elements ``start:end`` of its row-major flattening, in order; each box is itself a
    contiguous run of that flattening (at most two per dimension)."""
    shape = tuple(shape)
    if not 0 <= start <= end <= int(torch.Size(shape).numel()):
        raise ValueError(f"flat range {start}:{end} is outside a tensor of shape {list(shape)}")
    if start == end:
        return []
    if len(shape) == 1:
        return [((start,), (end - start,))]
    inner = int(torch.Size(shape[1:]).numel())
    first, last = start // inner, (end - 1) // inner
    if first == last:  # within one row: recurse into it
        return [((first,) + off, (1,) + size)
                for off, size in flat_boxes(shape[1:], start - first * inner,
                                            end - first * inner)]
    boxes = []
    if start % inner:  # the partial first row
        boxes += flat_boxes(shape, start, (first + 1) * inner)
        first += 1
    whole_end = last + 1 if end % inner == 0 else last
    if whole_end > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (whole_end - first,) + shape[1:]))
    if end % inner:  # the partial last row
        boxes += flat_boxes(shape, last * inner, end)
    return boxes


def _row_span(place: Placement, local_shape: Tuple[int, ...]) -> Tuple[int, int]:
    return place.local_rows if place.local_rows is not None else (0, local_shape[0])


def _global_box(place: Placement, local_shape, rows: Tuple[int, int]) -> Tuple[tuple, tuple]:
    """Offset and sizes in ``place``'s global tensor of the local rows ``rows`` (inside the
    placement's own rows), all of every other dimension."""
    lo = _row_span(place, local_shape)[0]
    row_dim = int(place.stacked)
    offset = list(place.global_offset)
    offset[row_dim] += rows[0] - lo
    sizes = (1,) * row_dim + (rows[1] - rows[0],) + tuple(local_shape[1:])
    return tuple(offset), sizes


def range_shards(name: str, local_shape: Tuple[int, ...], start: int, values: torch.Tensor,
                 layout: ChunkLayout, prefix: str = "") -> List[TensorShard]:
    """The pieces of the elements ``start:start + len(values)`` of the local tensor ``name``
    (row-major flattening of ``local_shape``): what one data-parallel rank of the distributed
    optimizer holds of a parameter's state. Every DP rank (expert-DP rank, for an expert's)
    writes its own range (TP and expert-TP replicas and the tied head are still written
    once). ``local_shape`` is the local tensor's, so an expert's range is of its expert-TP
    piece, placed by ``layout``'s expert-TP rank."""
    local_shape = tuple(local_shape)
    values = values.reshape(-1)
    end = start + values.numel()
    places = placements(name, local_shape, dataclasses.replace(layout, dp_rank=0,
                                                               expert_dp_rank=0))
    shards = []
    for offset, size in flat_boxes(local_shape, start, end):
        flat_at = sum(o * int(torch.Size(local_shape[d + 1:]).numel())
                      for d, o in enumerate(offset))
        box = values[flat_at - start:flat_at - start + int(torch.Size(size).numel())]
        box = box.reshape(size)
        rows = (offset[0], offset[0] + size[0])
        for place in places:
            if not place.written:
                continue
            lo, hi = _row_span(place, local_shape)
            a, b = max(lo, rows[0]), min(hi, rows[1])
            if a >= b:
                continue
            g_off, g_size = _global_box(place, local_shape, (a, b))
            piece = box[a - rows[0]:b - rows[0]]
            row_dim = int(place.stacked)
            g_off = list(g_off)
            g_size = list(g_size)
            for d in range(1, len(local_shape)):  # the box's own offsets below the rows
                g_off[row_dim + d] += offset[d]
                g_size[row_dim + d] = size[d]
            piece = _lead(piece, place)
            shards.append(TensorShard(prefix + place.key, piece, place.global_shape,
                                      tuple(g_off)))
    return shards


def _shape_error(reader: DistCheckpointReader, key: str, place: Placement, name: str,
                 local_shape: Tuple[int, ...], layout: ChunkLayout) -> DistCheckpointError:
    """A saved tensor whose global shape is not the one this model implies: a different
    model (the layout only changes local shapes); names the split the local shape went by."""
    at = (f"expert TP {layout.expert_tp_size}" if is_expert_key(place.key)
          else f"TP {layout.tp_size}")
    return DistCheckpointError(
        f"{reader.path}: {key!r} has global shape {list(reader.shape(key))}; the model at {at} "
        f"needs {list(place.global_shape)} (for {name} of local shape {list(local_shape)})")


def _missing_error(reader: DistCheckpointReader, key: str, name: str,
                   layout: ChunkLayout) -> DistCheckpointError:
    """An absent key; when the file's layer tensors use the other layout (stacked vs.
    per-layer keys), says so and which ``--moe-layer-freq`` each needs."""
    message = f"{reader.path}: no {key!r} (for {name})"
    if "decoder.layers." not in key:
        return DistCheckpointError(message)
    saved_per_layer = any(is_per_layer_key(k) for k in reader.tensor_keys())
    if saved_per_layer != layout.per_layer:
        saved, wanted = (("per-layer keys (decoder.layers.<g>.*: --moe-layer-freq above 1 or "
                          "a list)", "stacked keys (decoder.layers.*: --moe-layer-freq 1)")
                         if saved_per_layer else
                         ("stacked keys (decoder.layers.*: --moe-layer-freq 1)",
                          "per-layer keys (decoder.layers.<g>.*: --moe-layer-freq above 1 or "
                          "a list)"))
        message += (f"; the checkpoint stores its layers under {saved}, this model's "
                    f"--moe-layer-freq needs {wanted}: run with the --moe-layer-freq it was "
                    "saved with")
    return DistCheckpointError(message)


def read_local_rows(reader: DistCheckpointReader, name: str, local_shape: Tuple[int, ...],
                    rows: Tuple[int, int], layout: ChunkLayout, prefix: str = "",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``rows[0]:rows[1]`` (dim 0) of the local tensor ``name`` of ``local_shape`` at
    ``layout``: :func:`read_local` for a band of rows, so a distributed-optimizer rank reads
    about its own share of a parameter's state rather than all of it."""
    local_shape = tuple(local_shape)
    out = torch.empty((rows[1] - rows[0],) + local_shape[1:], dtype=dtype)
    for place in placements(name, local_shape, layout):
        key = stored_key(prefix + place.key, reader)
        if key not in reader:
            raise _missing_error(reader, key, name, layout)
        lo, hi = _row_span(place, local_shape)
        a, b = max(lo, rows[0]), min(hi, rows[1])
        if a >= b:
            continue
        target = out[a - rows[0]:b - rows[0]]
        g_off, g_size = _global_box(place, local_shape, (a, b))
        if place.key in VOCAB_ROW_KEYS and reader.shape(key) != place.global_shape:
            _read_vocab_rows(reader, key, target, dataclasses.replace(place, global_offset=g_off),
                             name)
            continue
        if reader.shape(key) != place.global_shape:
            raise _shape_error(reader, key, place, name, local_shape, layout)
        reader.read(key, g_off, g_size, out=_lead(target, place))
    return out


def extra_state_objects(layout: ChunkLayout, num_local_layers: int,
                        names: Optional[List[str]] = None, value=None) -> List[ObjectShard]:
    """The empty extra-state byte entries Megatron-Core keeps for each layer's linear modules
    (TransformerEngine state; ``None`` for plain layers), for this chunk's layers. ``names``
    (the chunk's flat state names) tell its MoE layers: those with a ``mlp.router.weight``.
    ``value``: what each entry holds (:func:`~megatron.checkpoint.dist.keys.
    extra_state_value` of the run's ``--transformer-impl``)."""
    dense = layout.writes_replicated
    if not dense and not layout.writes_expert_replicated:
        return []
    names = names or []
    if layout.blocks:
        return _heterogeneous_extra_state_objects(layout, names, value)
    items = []
    for local in range(num_local_layers):
        experts, shared, latent = None, False, False
        if any(n.endswith(f"layers.{local}.mlp.router.weight") for n in names):
            local_experts = {n.split(".local_experts.")[1].split(".")[0] for n in names
                             if f"layers.{local}.mlp.experts.local_experts." in n}
            experts = range(layout.expert_offset, layout.expert_offset + len(local_experts))
            shared = any(f"layers.{local}.mlp.shared_experts." in n for n in names)
            latent = any(f"layers.{local}.mlp.fc1_latent_proj." in n for n in names)
        if experts is None and not dense:
            continue
        if not layout.writes_expert_replicated:
            experts = range(0)
        attention = None
        if layout.mla:
            attention = mla_attention_modules(
                [n for n in names if f"layers.{local}.self_attention." in n] or
                ["self_attention.linear_q_proj.", "self_attention.linear_kv_down_proj.",
                 "self_attention.linear_kv_up_proj."])
        items += [ObjectShard(fqn, value) for fqn in extra_state_keys(
            layout.layer_offset + local, layout.num_layers, experts, layout.num_experts,
            shared, dense=dense, per_layer=layout.per_layer, attention_modules=attention,
            latent=latent)]
    return items + _mtp_extra_state_objects(layout, names, value)


def _heterogeneous_extra_state_objects(layout: ChunkLayout, names: List[str],
                                       value) -> List[ObjectShard]:
    """Per-layer extra-state entries of the linear modules each heterogeneous layer of the
    chunk has (a layer with both halves no-op has none, and no tensors either)."""
    local_layers = sorted({int(m.group(1)) for m in map(LAYER_NAME.fullmatch, names) if m})
    items = []
    for local in local_layers:
        number = layout.layer_offset + local
        items += [ObjectShard(object_key(f"{per_layer_prefix(number)}{module}._extra_state"),
                              value)
                  for module in heterogeneous_extra_state_modules(layout.blocks[number])]
    return items


def _mtp_extra_state_objects(layout: ChunkLayout, names: List[str],
                             value=None) -> List[ObjectShard]:
    """The extra-state entries of the multi-token prediction depths among ``names``."""
    items = []
    depths = sorted({int(n.split(".")[2]) for n in names if n.startswith(MTP_PREFIX)})
    for depth in depths:
        layer = f"{MTP_PREFIX}{depth}.transformer_layer.mlp."
        experts, shared = None, any(n.startswith(f"{layer}shared_experts.") for n in names)
        attention = None
        if layout.mla:
            attention = mla_attention_modules(
                [n for n in names
                 if n.startswith(f"{MTP_PREFIX}{depth}.transformer_layer.self_attention.")])
        if f"{layer}router.weight" in names:
            local = {n.split(".local_experts.")[1].split(".")[0] for n in names
                     if n.startswith(f"{layer}experts.local_experts.")}
            experts = range(layout.expert_offset, layout.expert_offset + len(local))
            if not layout.writes_expert_replicated:
                experts = range(0)
        elif not layout.writes_replicated:
            continue
        items += [ObjectShard(fqn, value) for fqn in mtp_extra_state_keys(
            depth, experts, layout.num_experts, dense=layout.writes_replicated,
            shared_expert=shared, attention_modules=attention)]
    return items


def common_objects(common_state: dict, rng_states: Optional[list] = None,
                   pp_rank: int = 0, pp_size: int = 1, tp_rank: int = 0,
                   tp_size: int = 1) -> List[ObjectShard]:
    """``common_state/shard_0_1`` (write it on global rank 0 only) and this rank's
    ``rng_state/shard_<pp>.<tp>_<PP>.<TP>`` (``rng_states``: one entry per DP rank, as
    Megatron keeps them; None: no RNG state)."""
    items = []
    if common_state is not None:
        items.append(ObjectShard(object_key("common_state"), common_state))
    if rng_states is not None:
        items.append(ObjectShard(object_key("rng_state", (pp_rank, tp_rank),
                                            (pp_size, tp_size)), rng_states))
    return items


# Tensors with a row per (padded) vocabulary entry: the padding depends on the TP size
# (--make-vocab-size-divisible-by x TP), so their saved row count may differ from this run's.
VOCAB_ROW_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _read_vocab_rows(reader: DistCheckpointReader, key: str, out: torch.Tensor,
                     place: Placement, name: str) -> None:
    """This rank's rows of a vocabulary table saved with another padding: the rows both
    paddings have are read; rows past the saved table (padding only) are zeros. Rows dropped
    are the saved table's extra padding, which no token id reaches."""
    saved = reader.shape(key)
    if tuple(saved[1:]) != tuple(place.global_shape[1:]):
        raise DistCheckpointError(
            f"{reader.path}: {key!r} has global shape {list(saved)}; the model needs rows of "
            f"{list(place.global_shape[1:])} (for {name})")
    start, rows = place.global_offset[0], out.shape[0]
    have = max(0, min(rows, saved[0] - start))
    out.zero_()
    if have:
        reader.read(key, (start,) + (0,) * (out.dim() - 1), (have,) + tuple(out.shape[1:]),
                    out=out[:have])


def read_local(reader: DistCheckpointReader, name: str, like: torch.Tensor,
               layout: ChunkLayout, prefix: str = "") -> torch.Tensor:
    """The local tensor ``name`` at ``layout``, read from the checkpoint into a new tensor of
    ``like``'s shape and dtype (any chunking, any saved layout; a vocabulary table may have
    been padded for another TP size).

    Raises:
        DistCheckpointError: the key is absent or its global shape differs from what the
            local shape at this layout implies (a different model).
    """
    out = torch.empty(like.shape, dtype=like.dtype)
    for place in placements(name, tuple(like.shape), layout):
        key = stored_key(prefix + place.key, reader)
        if key not in reader:
            raise _missing_error(reader, key, name, layout)
        if place.key in VOCAB_ROW_KEYS and reader.shape(key) != place.global_shape:
            _read_vocab_rows(reader, key, _piece(out, place), place, name)
            continue
        if reader.shape(key) != place.global_shape:
            raise _shape_error(reader, key, place, name, tuple(like.shape), layout)
        target = _piece(out, place)
        reader.read(key, place.global_offset, place.sizes(tuple(like.shape)), out=target)
    return out


def load_model_state(reader: DistCheckpointReader, template: dict,
                     layout: ChunkLayout, keep: frozenset = frozenset(),
                     zero: frozenset = frozenset()) -> dict:
    """``template`` (a chunk's state, nested as saved) with every tensor replaced by the
    checkpoint's values at ``layout``: ready for ``chunk.load_state_dict``. Tensors named in
    ``keep`` (dotted names the checkpoint lacks) keep the template's values, those in ``zero``
    become zeros."""

    def fill(node, prefix):
        if isinstance(node, dict):
            return {k: fill(v, f"{prefix}{k}.") for k, v in node.items()}
        if isinstance(node, torch.Tensor):
            if prefix[:-1] in zero:
                return torch.zeros_like(node)
            if prefix[:-1] in keep:
                return node.detach().clone()
            return read_local(reader, prefix[:-1], node, layout)
        return node

    return fill(template, "")

