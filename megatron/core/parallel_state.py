"""Tensor, pipeline, data, model-parallel and embedding process groups.

Ranks are assigned in Megatron's order: tensor-parallel rank varies fastest, then data-parallel,
then pipeline-parallel. With ``world_size = 8``, ``tp = 2``, ``pp = 2`` (so ``dp = 2``)::

    global rank:   0  1  2  3  4  5  6  7
    tp rank:       0  1  0  1  0  1  0  1
    dp rank:       0  0  1  1  0  0  1  1
    pp rank:       0  0  0  0  1  1  1  1

    tensor-parallel groups:   [0, 1] [2, 3] [4, 5] [6, 7]
    data-parallel groups:     [0, 2] [1, 3] [4, 6] [5, 7]
    pipeline groups:          [0, 4] [1, 5] [2, 6] [3, 7]
    model-parallel groups:    [0, 1, 4, 5] [2, 3, 6, 7]     (tp x pp, one per dp rank)
    embedding groups:         [0, 4] [1, 5] [2, 6] [3, 7]   (first + last stage of each pipeline)
    position-embedding groups:[0] [1] [2] [3]               (first stage of each pipeline)

So the two GPUs of a tensor-parallel group are neighbours (same node, fastest link), and stage 0
holds ranks 0-3 while stage 1 holds ranks 4-7.

:func:`initialize_model_parallel` builds one :class:`ParallelState` holding every group this rank
belongs to. Core code receives the group it needs as an argument; the module-level getters below
exist for the training harness and for users' scripts.
"""

import datetime
from dataclasses import dataclass, field
from typing import List, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class RankLayout:
    """Every group of every kind for one world, as lists of global ranks (no processes needed)."""

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


def compute_rank_layout(world_size: int, tp_size: int = 1, pp_size: int = 1) -> RankLayout:
    """Megatron's rank assignment as plain lists, checked for consistency."""
    if tp_size < 1 or pp_size < 1:
        raise ValueError(f"parallel sizes must be >= 1, got tp={tp_size} pp={pp_size}")
    if world_size % (tp_size * pp_size) != 0:
        raise ValueError(
            f"world size ({world_size}) is not divisible by tensor-model-parallel size "
            f"({tp_size}) x pipeline-model-parallel size ({pp_size})"
        )
    dp_size = world_size // (tp_size * pp_size)
    ranks_per_stage = world_size // pp_size  # tp * dp

    tp_groups = [list(range(start, start + tp_size)) for start in range(0, world_size, tp_size)]
    dp_groups = []
    for stage in range(pp_size):
        base = stage * ranks_per_stage
        for tp_rank in range(tp_size):
            dp_groups.append(list(range(base + tp_rank, base + ranks_per_stage, tp_size)))
    pp_groups = [list(range(r, world_size, ranks_per_stage)) for r in range(ranks_per_stage)]
    model_parallel_groups = []
    for dp_rank in range(dp_size):
        group = []
        for stage in range(pp_size):
            start = stage * ranks_per_stage + dp_rank * tp_size
            group.extend(range(start, start + tp_size))
        model_parallel_groups.append(group)
    embedding_groups = [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups]
    position_embedding_groups = [[g[0]] for g in pp_groups]
    return RankLayout(
        world_size, tp_size, pp_size, dp_size, tp_groups, dp_groups, pp_groups,
        model_parallel_groups, embedding_groups, position_embedding_groups,
    )


@dataclass
class ParallelState:
    """The groups this rank belongs to, and its rank in each."""

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
    virtual_pp_rank: Optional[int] = field(default=None)

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
    def tp_rank(self) -> int:
        return self.tp_ranks.index(self.rank)

    @property
    def pp_rank(self) -> int:
        return self.pp_ranks.index(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.dp_ranks.index(self.rank)

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
) -> ParallelState:
    """Create every process group and remember this rank's ones.

    ``torch.distributed`` must already be initialised. Every rank must call this, since
    ``new_group`` is collective over the whole world even for groups a rank is not in.
    ``timeout`` (``--distributed-timeout-minutes``) bounds every collective of the new groups;
    without it they get torch's default (30 minutes on gloo), not the world group's.
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
    layout = compute_rank_layout(world_size, tensor_model_parallel_size,
                                 pipeline_model_parallel_size)

    def build(groups: List[List[int]]):
        mine = None
        for ranks in groups:
            handle = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = handle
        return mine

    tp_group = build(layout.tp_groups)
    pp_group = build(layout.pp_groups)
    dp_group = build(layout.dp_groups)
    mp_group = build(layout.model_parallel_groups)
    emb_group = build(layout.embedding_groups)
    pos_group = build(layout.position_embedding_groups)
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
    )
    return _STATE


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


# Megatron's getter names, for the harness and users' scripts.

def get_tensor_model_parallel_group():
    return get_parallel_state().tp_group


def get_pipeline_model_parallel_group():
    return get_parallel_state().pp_group


def get_data_parallel_group():
    return get_parallel_state().dp_group


def get_model_parallel_group():
    return get_parallel_state().model_parallel_group


def get_embedding_group():
    return get_parallel_state().embedding_group


def get_position_embedding_group():
    return get_parallel_state().position_embedding_group


def get_tensor_model_parallel_world_size() -> int:
    return get_parallel_state().tp_size


def get_tensor_model_parallel_rank() -> int:
    return get_parallel_state().tp_rank


def get_pipeline_model_parallel_world_size() -> int:
    return get_parallel_state().pp_size


def get_pipeline_model_parallel_rank() -> int:
    return get_parallel_state().pp_rank


def get_data_parallel_world_size() -> int:
    return get_parallel_state().dp_size


def get_data_parallel_rank() -> int:
    return get_parallel_state().dp_rank


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this rank's group."""
    return get_parallel_state().tp_ranks[0]


def get_pipeline_model_parallel_first_rank() -> int:
    return get_parallel_state().pp_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return get_parallel_state().pp_ranks[-1]


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


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    s = get_parallel_state()
    if s.rank not in s.embedding_ranks:
        return False
    if ignore_virtual:
        return True
    if s.rank == s.embedding_ranks[0]:
        return s.is_first_stage()
    return s.is_last_stage()


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return get_parallel_state().virtual_pp_size


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return get_parallel_state().virtual_pp_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    get_parallel_state().virtual_pp_rank = rank
