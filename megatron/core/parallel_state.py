"""The parallel layout: every degree of parallelism, the process groups it implies, their getters.

Ranks are assigned in Megatron's order ``tp-cp-ep-dp-pp``: the tensor-parallel rank varies
fastest, then the context-parallel rank, then the data-parallel rank, then the pipeline stage
(expert parallelism is folded into the data x context ranks, below), so::

    global rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

World 16, ``tp = 2``, ``cp = 2``, ``pp = 2`` (so ``dp = 16 / (2 * 2 * 2) = 2``)::

    global rank:  0 1 2 3 4 5 6 7 | 8 9 10 11 12 13 14 15
    tp rank:      0 1 0 1 0 1 0 1 | 0 1  0  1  0  1  0  1
    cp rank:      0 0 1 1 0 0 1 1 | 0 0  1  1  0  0  1  1
    dp rank:      0 0 0 0 1 1 1 1 | 0 0  0  0  1  1  1  1
    pp rank:      0 0 0 0 0 0 0 0 | 1 1  1  1  1  1  1  1

    tensor-parallel groups:      [0, 1] [2, 3] [4, 5] [6, 7] [8, 9] [10, 11] [12, 13] [14, 15]
    context-parallel groups:     [0, 2] [1, 3] [4, 6] [5, 7] [8, 10] [9, 11] [12, 14] [13, 15]
    data-parallel groups:        [0, 4] [1, 5] [2, 6] [3, 7] [8, 12] [9, 13] [10, 14] [11, 15]
    data x context groups:       [0, 2, 4, 6] [1, 3, 5, 7] [8, 10, 12, 14] [9, 11, 13, 15]
    pipeline groups:             [0, 8] [1, 9] ... [7, 15]
    model-parallel groups:       [0, 1, 8, 9] [2, 3, 10, 11] [4, 5, 12, 13] [6, 7, 14, 15]
    embedding groups:            the first and last rank of each pipeline group (or the
                                 stages ``embedding_stages`` names: [0, 1] gives [0, 8] ...)

The ranks of one context-parallel group hold the same weights and read the same samples, each
keeping its own part of every sequence; gradients are therefore averaged over data x context
ranks, and the data loader's rank and size are the data-parallel ones. Without context
parallelism (``cp = 1``) this is Megatron's classic layout: with 16 ranks, ``tp = 2`` and
``pp = 4``, the data-parallel groups are ``[0, 2] [1, 3] [4, 6] [5, 7] ...`` and the pipeline
groups ``[0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]``.

**Experts ("parallel folding").** Mixture-of-experts layers use a second layout over the same
ranks of each pipeline stage, ``etp-ep-edp-pp`` (expert tensor parallel fastest, then expert
parallel, then expert data parallel), so the ``tp * cp * dp`` ranks of a stage are re-cut into
``expert_tp * ep * expert_dp``; attention keeps its own layout. With world 8, ``tp = 2``,
``cp = 2``, ``ep = 2``, ``expert_tp = 1`` (one stage, ``dp = 2``, ``expert_dp = 4``)::

    expert-tensor-parallel groups:  [0] [1] ... [7]
    expert-parallel groups:         [0, 1] [2, 3] [4, 5] [6, 7]
    expert-data-parallel groups:    [0, 2, 4, 6] [1, 3, 5, 7]
    expert model-parallel groups:   [0, 1] [2, 3] [4, 5] [6, 7]   (expert tp x ep x pp)

:func:`initialize_model_parallel` builds one :class:`ParallelState` holding every group this rank
belongs to. Core code receives the layout or the group it needs as an argument; the module-level
getters below exist for the training harness and for users' scripts.

**The other order** (``--use-tp-pp-dp-mapping``, Megatron's ``tp-cp-ep-pp-dp``) puts the pipeline
stage before the data-parallel rank: ``rank = tp_rank + tp * (cp_rank + cp * (pp_rank + pp *
dp_rank))``, so the stages of one model copy sit on neighbouring ranks. World 8, ``tp = 2``,
``pp = 2`` (``dp = 2``)::

    tensor-parallel groups:      [0, 1] [2, 3] [4, 5] [6, 7]
    pipeline groups:             [0, 2] [1, 3] [4, 6] [5, 7]
    data-parallel groups:        [0, 4] [1, 5] [2, 6] [3, 7]
    model-parallel groups:       [0, 1, 2, 3] [4, 5, 6, 7]

The experts follow the same order (``etp-ep-pp-edp``), which keeps their pipeline groups equal to
attention's only when ``expert_tp * ep = tp * cp``; other expert layouts are refused with it.

**Hierarchical context parallelism** (``--hierarchical-context-parallel-sizes a n``, for
``--cp-comm-type a2a+p2p``) cuts each context-parallel group into inner all-to-all groups of
``a`` neighbouring cp ranks and outer rings of the cp ranks ``a`` apart. World 8, ``tp = 2``,
``cp = 4``, sizes ``2 2`` (context-parallel groups ``[0, 2, 4, 6] [1, 3, 5, 7]``)::

    cp all-to-all (inner) groups:   [0, 2] [4, 6] [1, 3] [5, 7]
    cp ring (outer) groups:         [0, 4] [2, 6] [1, 5] [3, 7]
"""

import dataclasses
import datetime
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist

from megatron.core.context_parallel import ContextParallelError, hierarchical_cp_groups
from megatron.core.tensor_parallel.weight_shards import weight_shards_per_tp_rank


DEFAULT_ORDER = "tp-cp-ep-dp-pp"
TP_PP_DP_ORDER = "tp-cp-ep-pp-dp"  # --use-tp-pp-dp-mapping
ORDERS = (DEFAULT_ORDER, TP_PP_DP_ORDER)


class LayoutError(ValueError):
    """Parallel degrees that do not fit the world size; the message names the flags."""


@dataclass(frozen=True)
class RankLayout:
    """The parallel degrees of a run and every group of every kind, as lists of global ranks.

    Built by :func:`compute_rank_layout` (no processes needed); ``vp_size`` is the number of
    virtual pipeline stages per rank (None: no interleaving). ``sequence_parallel`` travels with
    the layout to the model builders.
    """

    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    tp_groups: List[List[int]]
    dp_groups: List[List[int]]
    pp_groups: List[List[int]]
    model_parallel_groups: List[List[int]]
    embedding_groups: List[List[int]]
    position_embedding_groups: List[List[int]]
    cp_size: int = 1
    ep_size: int = 1
    expert_tp_size: int = 1
    expert_dp_size: int = 1
    vp_size: Optional[int] = None
    sequence_parallel: bool = False
    cp_groups: List[List[int]] = dataclasses.field(default_factory=list)
    dp_cp_groups: List[List[int]] = dataclasses.field(default_factory=list)
    ep_groups: List[List[int]] = dataclasses.field(default_factory=list)
    expert_tp_groups: List[List[int]] = dataclasses.field(default_factory=list)
    expert_dp_groups: List[List[int]] = dataclasses.field(default_factory=list)
    expert_model_parallel_groups: List[List[int]] = dataclasses.field(default_factory=list)
    order: str = DEFAULT_ORDER
    hierarchical_cp_sizes: Optional[Tuple[int, ...]] = None
    cp_a2a_groups: List[List[int]] = dataclasses.field(default_factory=list)
    cp_p2p_groups: List[List[int]] = dataclasses.field(default_factory=list)
    weight_shards: int = 1
    weight_shard_groups: List[List[int]] = dataclasses.field(default_factory=list)
    weight_shard_dp_groups: List[List[int]] = dataclasses.field(default_factory=list)
    expert_weight_shards: int = 1
    expert_weight_shard_groups: List[List[int]] = dataclasses.field(default_factory=list)
    expert_weight_shard_dp_groups: List[List[int]] = dataclasses.field(default_factory=list)

    def rank_coordinates(self, rank: int) -> dict:
        """``{"tp": .., "cp": .., "dp": .., "pp": ..}`` of a global rank."""
        return {name: _find(getattr(self, f"{name}_groups"), rank).index(rank)
                for name in ("tp", "cp", "dp", "pp")}


def check_degrees(world_size: int, tp_size: int = 1, cp_size: int = 1, pp_size: int = 1,
                  ep_size: int = 1, expert_tp_size: Optional[int] = None,
                  vp_size: Optional[int] = None, order: str = DEFAULT_ORDER) -> int:
    """The one check of the parallel degrees against the world size; returns the
    data-parallel size.

    Flag validation calls it for its messages before any process group exists, and
    :func:`compute_rank_layout` calls it again, so the two cannot disagree.

    Raises:
        LayoutError: naming the flags and their values.
    """
    expert_tp_size = tp_size if expert_tp_size is None else expert_tp_size
    for flag, value in (("--tensor-model-parallel-size", tp_size),
                        ("--context-parallel-size", cp_size),
                        ("--pipeline-model-parallel-size", pp_size),
                        ("--expert-model-parallel-size", ep_size),
                        ("--expert-tensor-parallel-size", expert_tp_size)):
        if value < 1:
            raise LayoutError(f"{flag} must be >= 1, got {value}")
    model = tp_size * cp_size * pp_size
    if world_size % model:
        sizes = [f"--tensor-model-parallel-size ({tp_size})"]
        if cp_size > 1:
            sizes.append(f"--context-parallel-size ({cp_size})")
        sizes.append(f"--pipeline-model-parallel-size ({pp_size})")
        raise LayoutError(f"world size ({world_size}) is not divisible by {' x '.join(sizes)} "
                          f"= {model}")
    stage = world_size // pp_size
    if stage % (expert_tp_size * ep_size):
        raise LayoutError(
            f"the {stage} ranks of a pipeline stage (tensor {tp_size} x context {cp_size} x "
            f"data {world_size // model}) are not divisible by --expert-tensor-parallel-size "
            f"({expert_tp_size}) x --expert-model-parallel-size ({ep_size}) = "
            f"{expert_tp_size * ep_size}")
    if vp_size is not None and (vp_size < 1 or pp_size < 2):
        raise LayoutError(f"virtual pipeline stages ({vp_size}) need "
                          f"--pipeline-model-parallel-size >= 2, got {pp_size}")
    folded = ep_size > 1 or expert_tp_size != tp_size  # a layout of the experts' own
    if (order != DEFAULT_ORDER and pp_size > 1 and folded
            and expert_tp_size * ep_size != tp_size * cp_size):
        # Ranks numbered pipeline before data: the experts' pipeline groups match attention's
        # only when both cut a stage into the same number of data-parallel copies.
        raise LayoutError(
            f"--use-tp-pp-dp-mapping with pipeline parallelism needs "
            f"--expert-tensor-parallel-size ({expert_tp_size}) x --expert-model-parallel-size "
            f"({ep_size}) = --tensor-model-parallel-size ({tp_size}) x "
            f"--context-parallel-size ({cp_size})")
    return world_size // model


def _groups_of(sizes: dict, order: List[str], dims: List[str]) -> List[List[int]]:
    """The groups in which only the coordinates ``dims`` vary, ranks numbered in ``order``
    (first name fastest). Members ascend, groups ascend by their first member (Megatron's
    listing order)."""
    strides, stride = {}, 1
    for name in order:
        strides[name] = stride
        stride *= sizes[name]
    groups = {}
    for rank in range(stride):
        key = tuple(rank // strides[n] % sizes[n] for n in order if n not in dims)
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values(), key=lambda g: g[0])


def _order_names(order: str) -> List[str]:
    names = order.split("-")
    if order not in ORDERS:
        raise LayoutError(f"rank order must be one of {', '.join(ORDERS)}, got {order!r}")
    return names


def compute_rank_layout(world_size: int, tp_size: int = 1, pp_size: int = 1, *,
                        cp_size: int = 1, ep_size: int = 1,
                        expert_tp_size: Optional[int] = None, vp_size: Optional[int] = None,
                        sequence_parallel: bool = False,
                        order: str = DEFAULT_ORDER,
                        hierarchical_cp_sizes: Optional[Sequence[int]] = None,
                        num_weight_shards: Optional[int] = None,
                        expert_num_weight_shards: Optional[int] = None,
                        embedding_stages: Optional[Sequence[int]] = None) -> RankLayout:
    """Megatron's rank assignment as plain lists, checked for consistency.

    ``embedding_stages``: the pipeline stages whose ranks form each embedding group (the
    stages holding a word-embedding table kept in step); None: the first and the last. A
    standalone MTP stage without the embedding adds its own (its copy of the table).

    ``order`` is Megatron's ``tp-cp-ep-dp-pp`` (the default) or ``tp-cp-ep-pp-dp``
    (``--use-tp-pp-dp-mapping``: the pipeline stage varies before the data-parallel rank).
    ``hierarchical_cp_sizes``: ``--hierarchical-context-parallel-sizes`` (inner, outer), whose
    product must be ``cp_size``.
    ``num_weight_shards``: ``--tensor-parallel-num-weight-shards`` (None: no weight shards);
    see :func:`_weight_shard_groups`. ``expert_num_weight_shards``:
    ``--expert-tensor-parallel-num-weight-shards`` (None: none); see
    :func:`_expert_weight_shard_groups`.
    ``expert_tp_size`` defaults to ``tp_size`` (Megatron's default). Raises
    :class:`LayoutError` naming the flags when the degrees do not fit ``world_size``.
    """
    names = _order_names(order)
    expert_tp_size = tp_size if expert_tp_size is None else expert_tp_size
    dp_size = check_degrees(world_size, tp_size, cp_size, pp_size, ep_size, expert_tp_size,
                            vp_size, order)
    expert_dp_size = world_size // pp_size // (expert_tp_size * ep_size)
    dense = {"tp": tp_size, "cp": cp_size, "ep": 1, "dp": dp_size, "pp": pp_size}
    expert = {"tp": expert_tp_size, "cp": 1, "ep": ep_size, "dp": expert_dp_size,
              "pp": pp_size}

    def groups(dims, sizes=dense):
        return _groups_of(sizes, names, dims)

    pp_groups = groups(["pp"])
    model_parallel_groups = groups(["tp", "pp"])
    if ep_size == 1 and expert_tp_size == tp_size:  # the experts share attention's layout
        expert_groups = dict(ep_groups=[[r] for r in range(world_size)],
                             expert_tp_groups=groups(["tp"]),
                             expert_dp_groups=groups(["cp", "dp"]),
                             expert_model_parallel_groups=model_parallel_groups)
    else:
        # expert tp x ep x pp for each expert-dp position: the ranks that together hold one
        # copy of every expert (what the experts' part of the gradient norm is summed over).
        expert_groups = dict(ep_groups=groups(["ep"], expert),
                             expert_tp_groups=groups(["tp"], expert),
                             expert_dp_groups=groups(["dp"], expert),
                             expert_model_parallel_groups=groups(["tp", "ep", "pp"], expert))
    cp_groups = groups(["cp"])
    hierarchical = _hierarchical_groups(cp_groups, hierarchical_cp_sizes)
    return RankLayout(
        world_size, tp_size, pp_size, dp_size, groups(["tp"]), groups(["dp"]), pp_groups,
        # tp x pp for each (cp, dp) position: the ranks that together hold one copy of the model.
        model_parallel_groups,
        _embedding_groups(pp_groups, embedding_stages),
        [[g[0]] for g in pp_groups],
        cp_size=cp_size, ep_size=ep_size, expert_tp_size=expert_tp_size,
        expert_dp_size=expert_dp_size, vp_size=vp_size, sequence_parallel=sequence_parallel,
        cp_groups=cp_groups, dp_cp_groups=groups(["cp", "dp"]), order=order,
        **expert_groups, **hierarchical,
        **_weight_shard_groups(groups(["dp"]), tp_size, cp_size, order, num_weight_shards),
        **_expert_weight_shard_groups(expert_groups["expert_dp_groups"], expert_tp_size,
                                      cp_size, order, expert_num_weight_shards),
    )


def _embedding_groups(pp_groups: List[List[int]],
                      stages: Optional[Sequence[int]]) -> List[List[int]]:
    if stages is None:
        return [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups]
    return [[g[s] for s in sorted(set(stages))] for g in pp_groups]


def _weight_shard_groups(dp_groups: List[List[int]], tp_size: int, cp_size: int, order: str,
                         num_weight_shards: Optional[int]) -> dict:
    """The RankLayout fields of weight shards (``--tensor-parallel-num-weight-shards N``).

    The ``g = N / tp`` ranks of a weight-shard group are ``g`` neighbouring ranks of one
    data-parallel group (Megatron's order ``tp-gtp-dp-pp``: the shard rank varies right after
    the tensor-parallel rank); the weight-shard data-parallel group is the data-parallel ranks
    holding the same rows (every ``g``-th). World 8, ``tp = 2``, ``N = 4`` (``g = 2``,
    data-parallel groups ``[0, 2, 4, 6] [1, 3, 5, 7]``)::

        weight-shard groups:                 [0, 2] [4, 6] [1, 3] [5, 7]
        weight-shard data-parallel groups:   [0, 4] [2, 6] [1, 5] [3, 7]
    """
    flag = "--tensor-parallel-num-weight-shards"
    if num_weight_shards is None:
        return {}
    try:
        g = weight_shards_per_tp_rank(tp_size, num_weight_shards, flag)
    except ValueError as err:
        raise LayoutError(str(err)) from None
    if cp_size > 1 or order != DEFAULT_ORDER:
        raise LayoutError(f"{flag} is not supported with --context-parallel-size > 1 or "
                          "--use-tp-pp-dp-mapping")
    dp_size = len(dp_groups[0])
    if dp_size % g:
        raise LayoutError(f"{flag} ({num_weight_shards}) / --tensor-model-parallel-size "
                          f"({tp_size}) = {g} weight shards must divide the data-parallel "
                          f"size ({dp_size})")
    return dict(weight_shards=g,
                weight_shard_groups=[d[i:i + g] for d in dp_groups for i in range(0, dp_size, g)],
                weight_shard_dp_groups=[d[k::g] for d in dp_groups for k in range(g)])


def _expert_weight_shard_groups(expert_dp_groups: List[List[int]], expert_tp_size: int,
                                cp_size: int, order: str,
                                num_weight_shards: Optional[int]) -> dict:
    """The RankLayout fields of expert weight shards
    (``--expert-tensor-parallel-num-weight-shards N``), cut out of expert data parallelism.

    Megatron's expert order is ``etp-ep-egtp-edp-pp``: the ``g = N / expert_tp`` ranks of an
    expert weight-shard group are ``g`` neighbouring ranks of one expert-data-parallel group
    (``expert_tp * ep`` apart), and the expert weight-shard data-parallel group is the
    expert-data-parallel ranks holding the same rows (every ``g``-th). World 8, expert tp 1,
    ep 2, ``N = 2`` (expert-data-parallel groups ``[0, 2, 4, 6] [1, 3, 5, 7]``)::

        expert weight-shard groups:                [0, 2] [4, 6] [1, 3] [5, 7]
        expert weight-shard data-parallel groups:  [0, 4] [2, 6] [1, 5] [3, 7]
    """
    flag = "--expert-tensor-parallel-num-weight-shards"
    if num_weight_shards is None:
        return {}
    try:
        g = weight_shards_per_tp_rank(expert_tp_size, num_weight_shards, flag)
    except ValueError as err:
        raise LayoutError(str(err)) from None
    if cp_size > 1 or order != DEFAULT_ORDER:
        raise LayoutError(f"{flag} is not supported with --context-parallel-size > 1 or "
                          "--use-tp-pp-dp-mapping")
    edp_size = len(expert_dp_groups[0])
    if edp_size % g:
        raise LayoutError(f"{flag} ({num_weight_shards}) / --expert-tensor-parallel-size "
                          f"({expert_tp_size}) = {g} weight shards must divide the "
                          f"expert-data-parallel size ({edp_size})")
    return dict(expert_weight_shards=g,
                expert_weight_shard_groups=[d[i:i + g] for d in expert_dp_groups
                                            for i in range(0, edp_size, g)],
                expert_weight_shard_dp_groups=[d[k::g] for d in expert_dp_groups
                                               for k in range(g)])


def _hierarchical_groups(cp_groups: List[List[int]], sizes: Optional[Sequence[int]]) -> dict:
    """The RankLayout fields of hierarchical context parallelism (none without ``sizes``)."""
    if sizes is None:
        return {}
    inner, outer = [], []
    for ranks in cp_groups:
        try:
            a2a, p2p = hierarchical_cp_groups(ranks, list(sizes))
        except ContextParallelError as err:
            raise LayoutError(str(err)) from None
        inner += a2a
        outer += p2p
    return dict(hierarchical_cp_sizes=tuple(sizes), cp_a2a_groups=inner, cp_p2p_groups=outer)


@dataclass(frozen=True)
class ModelGroups:
    """What a model's layers need of the layout: their process groups and sequence parallelism.

    Model constructors take this one object instead of a group argument each; it is built by
    :meth:`ParallelState.model_groups` (or by hand in a test). A None group means that
    dimension is not split (one rank), never the whole job.

    Attributes:
        tp_group / tp_size: the tensor-parallel group and its size.
        sequence_parallel: activations outside the tensor-parallel regions split over
            ``tp_group`` along the sequence (``--sequence-parallel``).
        cp_group: the context-parallel group (None: whole sequences on this rank).
        ep_group: the expert-parallel group of the MoE layers (None: every expert here).
        expert_tp_group: the group each expert is split over (None: ``tp_group``).
        hierarchical_cp_groups: (inner all-to-all, outer ring) subgroups of ``cp_group`` for
            ``--cp-comm-type a2a+p2p``, or None.
        dp_group: the data-parallel group (without context parallelism; None: one rank), over
            which ``--moe-router-load-balancing-type global_aux_loss`` counts token choices.
        weight_shard_group: the group the dense linear weights are cut over along their rows
            (``--tensor-parallel-num-weight-shards``; None: no weight shards).
        expert_weight_shard_group: the group the routed experts' weights are cut over along
            their rows (``--expert-tensor-parallel-num-weight-shards``; None: none).
    """

    tp_group: object = None
    tp_size: int = 1
    sequence_parallel: bool = False
    cp_group: object = None
    ep_group: object = None
    expert_tp_group: object = None
    hierarchical_cp_groups: Optional[Tuple[object, object]] = None
    dp_group: object = None
    weight_shard_group: object = None
    expert_weight_shard_group: object = None

    @classmethod
    def of(cls, pstate, sequence_parallel: Optional[bool] = None) -> "ModelGroups":
        """The groups of ``pstate``: a :class:`ParallelState`, or any object with
        ``tp_group`` and ``tp_size`` (a test's or the converter's one-rank stand-in, whose
        missing groups mean one rank). ``sequence_parallel`` overrides the layout's (None keeps
        it; generation turns it off)."""
        if sequence_parallel is None:
            sequence_parallel = bool(getattr(pstate, "sequence_parallel", False))
        return cls(tp_group=pstate.tp_group, tp_size=pstate.tp_size,
                   sequence_parallel=sequence_parallel,
                   cp_group=getattr(pstate, "cp_group", None),
                   ep_group=getattr(pstate, "ep_group", None),
                   expert_tp_group=getattr(pstate, "expert_tp_group", None),
                   hierarchical_cp_groups=getattr(pstate, "hierarchical_cp_groups", None),
                   dp_group=getattr(pstate, "dp_group", None),
                   weight_shard_group=getattr(pstate, "weight_shard_group", None),
                   expert_weight_shard_group=getattr(pstate, "expert_weight_shard_group", None))


@dataclass
class ParallelState:
    """The groups this rank belongs to, and its rank in each.

    ``dp_cp_group`` is the data x context-parallel group (what gradients are averaged over);
    without context parallelism it is the very same group as ``dp_group``.
    ``expert_model_parallel_group`` is expert-tp x ep x pp (Megatron's expert tensor, model and
    pipeline group); with the default expert layout (ep 1, expert-tp = tp) it is the very same
    group as ``model_parallel_group``.
    """

    layout: RankLayout
    rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    model_parallel_group: object
    embedding_group: object
    position_embedding_group: object
    tp_ranks: List[int]
    pp_ranks: List[int]
    dp_ranks: List[int]
    embedding_ranks: List[int]
    virtual_pp_size: Optional[int] = None
    virtual_pp_rank: Optional[int] = None
    cp_group: object = None
    dp_cp_group: object = None
    ep_group: object = None
    expert_tp_group: object = None
    expert_dp_group: object = None
    cp_ranks: List[int] = dataclasses.field(default_factory=list)
    dp_cp_ranks: List[int] = dataclasses.field(default_factory=list)
    expert_model_parallel_group: object = None
    expert_tp_ranks: List[int] = dataclasses.field(default_factory=list)
    hierarchical_cp_groups: Optional[Tuple[object, object]] = None
    weight_shard_group: object = None
    weight_shard_dp_group: object = None
    expert_weight_shard_group: object = None
    expert_weight_shard_dp_group: object = None

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def cp_size(self) -> int:
        return self.layout.cp_size

    @property
    def dp_cp_size(self) -> int:
        return self.layout.dp_size * self.layout.cp_size

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    @property
    def tp_rank(self) -> int:
        return self.tp_ranks.index(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.pp_ranks.index(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.dp_ranks.index(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.cp_ranks.index(self.rank) if self.cp_ranks else 0

    @property
    def dp_cp_rank(self) -> int:
        return self.dp_cp_ranks.index(self.rank) if self.dp_cp_ranks else self.dp_rank

    @property
    def expert_tp_rank(self) -> int:
        return self.expert_tp_ranks.index(self.rank) if self.expert_tp_ranks else self.tp_rank

    def for_virtual_stage(self, vp_rank: int) -> "ParallelState":
        """A copy of this state that answers for virtual pipeline stage ``vp_rank`` (the
        groups are shared; nothing here changes)."""
        return dataclasses.replace(self, virtual_pp_rank=vp_rank)

    def is_first_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.virtual_pp_size is not None and self.virtual_pp_rank != 0:
            return False
        return self.pp_rank == 0

    def is_last_stage(self, ignore_virtual: bool = False) -> bool:
        if not ignore_virtual and self.virtual_pp_size is not None:
            if self.virtual_pp_rank != self.virtual_pp_size - 1:
                return False
        return self.pp_rank == self.pp_size - 1


_STATE: Optional[ParallelState] = None


def _find(groups: List[List[int]], rank: int) -> List[int]:
    for g in groups:
        if rank in g:
            return g
    raise AssertionError(f"rank {rank} is in no group of {groups}")


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    timeout: Optional[datetime.timedelta] = None,
    *,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    sequence_parallel: bool = False,
    order: str = DEFAULT_ORDER,
    hierarchical_context_parallel_sizes: Optional[Sequence[int]] = None,
    num_weight_shards: Optional[int] = None,
    expert_num_weight_shards: Optional[int] = None,
    embedding_stages: Optional[Sequence[int]] = None,
) -> ParallelState:
    """Create every process group and remember this rank's ones.

    ``torch.distributed`` must already be initialised. Every rank must call this, since
    ``new_group`` is collective over the whole world even for groups a rank is not in.
    ``timeout`` (``--distributed-timeout-minutes``) bounds every collective of the new groups;
    without it they get torch's default (30 minutes on gloo), not the world group's.
    ``order`` is the rank order of :func:`compute_rank_layout`;
    ``hierarchical_context_parallel_sizes`` its ``hierarchical_cp_sizes``;
    ``num_weight_shards`` (``--tensor-parallel-num-weight-shards``) its ``num_weight_shards``;
    ``expert_num_weight_shards`` (``--expert-tensor-parallel-num-weight-shards``) its
    ``expert_num_weight_shards``; ``embedding_stages`` its ``embedding_stages``.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised")
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialised; "
                           "call destroy_model_parallel() first")
    if virtual_pipeline_model_parallel_size is not None and pipeline_model_parallel_size < 2:
        raise ValueError("virtual pipeline stages need pipeline-model-parallel size >= 2")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    layout = compute_rank_layout(
        world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
        cp_size=context_parallel_size, ep_size=expert_model_parallel_size,
        expert_tp_size=expert_tensor_parallel_size,
        vp_size=virtual_pipeline_model_parallel_size, sequence_parallel=sequence_parallel,
        order=order, hierarchical_cp_sizes=hierarchical_context_parallel_sizes,
        num_weight_shards=num_weight_shards, expert_num_weight_shards=expert_num_weight_shards,
        embedding_stages=embedding_stages)

    def build(groups: List[List[int]]):
        mine = None
        for ranks in groups:
            handle = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = handle
        return mine

    # The order of creation is fixed (every rank must create the same groups in the same order);
    # the groups that existed before context and expert parallelism come first.
    tp_group = build(layout.tp_groups)
    pp_group = build(layout.pp_groups)
    dp_group = build(layout.dp_groups)
    mp_group = build(layout.model_parallel_groups)
    emb_group = build(layout.embedding_groups)
    pos_group = build(layout.position_embedding_groups)
    # Degenerate groups reuse an existing handle, so a run without context or expert
    # parallelism creates exactly the groups it did before.
    cp_group = build(layout.cp_groups) if layout.cp_size > 1 else None
    dp_cp_group = build(layout.dp_cp_groups) if layout.cp_size > 1 else dp_group
    expert_groups = (layout.ep_groups, layout.expert_tp_groups, layout.expert_dp_groups)
    if layout.ep_groups == [[r] for r in range(world_size)] and \
            layout.expert_tp_groups == layout.tp_groups:
        ep_group, expert_tp_group, expert_dp_group = None, tp_group, dp_cp_group
        expert_mp_group = mp_group
    else:
        ep_group, expert_tp_group, expert_dp_group = (build(g) for g in expert_groups)
        expert_mp_group = (mp_group if layout.expert_model_parallel_groups
                           == layout.model_parallel_groups
                           else build(layout.expert_model_parallel_groups))
    hierarchical = None
    if layout.hierarchical_cp_sizes is not None:   # built last: other groups keep their order
        hierarchical = (build(layout.cp_a2a_groups), build(layout.cp_p2p_groups))
    _STATE = ParallelState(
        layout=layout, rank=rank, tp_group=tp_group, pp_group=pp_group, dp_group=dp_group,
        model_parallel_group=mp_group, embedding_group=emb_group,
        position_embedding_group=pos_group,
        tp_ranks=_find(layout.tp_groups, rank), pp_ranks=_find(layout.pp_groups, rank),
        dp_ranks=_find(layout.dp_groups, rank),
        # Middle pipeline stages hold no embedding and belong to no embedding group.
        embedding_ranks=next((g for g in layout.embedding_groups if rank in g), []),
        virtual_pp_size=virtual_pipeline_model_parallel_size,
        virtual_pp_rank=0 if virtual_pipeline_model_parallel_size is not None else None,
        cp_group=cp_group, dp_cp_group=dp_cp_group, ep_group=ep_group,
        expert_tp_group=expert_tp_group, expert_dp_group=expert_dp_group,
        cp_ranks=_find(layout.cp_groups, rank), dp_cp_ranks=_find(layout.dp_cp_groups, rank),
        expert_model_parallel_group=expert_mp_group,
        expert_tp_ranks=_find(layout.expert_tp_groups, rank),
        hierarchical_cp_groups=hierarchical,
        **_build_weight_shard_groups(layout, build),   # built last too
    )
    return _STATE


def _build_weight_shard_groups(layout: RankLayout, build) -> dict:
    """The ParallelState fields of the weight-shard groups: the dense ones, then the experts'
    (each pair only where its shards are on; ``build`` makes a list of groups and returns
    this rank's)."""
    groups = {}
    if layout.weight_shards > 1:
        groups.update(weight_shard_group=build(layout.weight_shard_groups),
                      weight_shard_dp_group=build(layout.weight_shard_dp_groups))
    if layout.expert_weight_shards > 1:
        groups.update(expert_weight_shard_group=build(layout.expert_weight_shard_groups),
                      expert_weight_shard_dp_group=build(layout.expert_weight_shard_dp_groups))
    return groups


def destroy_model_parallel() -> None:
    """Forget the groups (the process group itself stays up)."""
    global _STATE
    _STATE = None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialised; "
                           "call initialize_model_parallel() first")
    return _STATE


# Megatron's getter names that users' own scripts call (model and data providers, forward
# steps); the project's code is handed its groups instead. tests/distributed/test_parallel_state
# checks each against the layout's tables.

def get_tensor_model_parallel_group():
    return get_parallel_state().tp_group


def get_pipeline_model_parallel_group():
    return get_parallel_state().pp_group


def get_data_parallel_group(with_context_parallel: bool = False):
    s = get_parallel_state()
    return s.dp_cp_group if with_context_parallel else s.dp_group


def get_context_parallel_group():
    return get_parallel_state().cp_group


def get_context_parallel_world_size() -> int:
    return get_parallel_state().cp_size


def get_context_parallel_rank() -> int:
    return get_parallel_state().cp_rank






def get_expert_model_parallel_world_size() -> int:
    return get_parallel_state().layout.ep_size














def get_model_parallel_group():
    return get_parallel_state().model_parallel_group


def get_embedding_group():
    return get_parallel_state().embedding_group




def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().tp_size


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().pp_size


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().pp_rank


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    s = get_parallel_state()
    return s.dp_cp_size if with_context_parallel else s.dp_size


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    s = get_parallel_state()
    return s.dp_cp_rank if with_context_parallel else s.dp_rank


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    return get_parallel_state().tp_ranks[0]






def get_pipeline_model_parallel_next_rank() -> int:
    s = get_parallel_state()
    return s.pp_ranks[(s.pp_rank + 1) % s.pp_size]


def get_pipeline_model_parallel_prev_rank() -> int:
    s = get_parallel_state()
    return s.pp_ranks[(s.pp_rank - 1) % s.pp_size]


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    return get_parallel_state().is_first_stage(ignore_virtual)


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    return get_parallel_state().is_last_stage(ignore_virtual)




def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return get_parallel_state().virtual_pp_size


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return get_parallel_state().virtual_pp_rank

