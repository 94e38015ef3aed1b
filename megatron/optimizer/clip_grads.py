"""Gradient norm, clipping and zero counting over a model split across tensor and pipeline ranks.

Each model-parallel rank holds part of the model. The global norm must count every parameter of
the full model exactly once:

* a tensor-parallel shard (``param.tensor_model_parallel`` is True) is counted on every TP rank,
  since each rank holds a different slice;
* a parameter replicated across TP ranks (layer norms, biases of row-parallel layers, position
  embeddings) is counted on TP rank 0 only;
* the copy of a tied word embedding on the last pipeline stage (``param.shared`` is True) is not
  counted at all: the first stage counts the original.

Local sums are then all-reduced over the model-parallel group (TP x PP of one data-parallel
replica). Gradients are already averaged over data-parallel ranks, so no DP reduction happens here.

Experts (``param.allreduce`` is False) follow their own layout: within a pipeline stage the
``tp * cp * dp`` ranks are re-cut into ``expert_tp * ep * expert_dp``. An expert's parameter is
counted with the same rule at the *expert*-TP rank (an expert's replicated bias counts on
expert-TP rank 0), and the experts' part is summed over the expert model-parallel group alone
(expert TP x EP x PP: the ranks that hold one copy of every expert shard), never over the
model-parallel group as well. With world 4, ``tp = 2``, ``expert_tp = 1``, ``ep = 2``::

    tensor-parallel / model-parallel groups:   [0, 1] [2, 3]
    expert-parallel groups:                     [0, 1] [2, 3]
    expert model-parallel groups:               [0, 1] [2, 3]
    expert-tensor-parallel groups:              [0] [1] [2] [3]   (every rank expert-TP rank 0)

Rank 1 holds whole experts, other than rank 0's, and counts their biases although it is TP rank
1; summing over the model-parallel group and then the expert-parallel group would count every
expert twice. Where the two groups hold the same ranks (as here, and with the default expert
layout: ``ep = 1``, ``expert_tp = tp``) the experts are summed with the dense parameters in one
reduction (:func:`experts_apart`); with the default layout that is exactly the computation of a
model without experts.

Fully sharded data parallelism (``--use-torch-fsdp2``): a gradient is then a ``DTensor`` holding
this rank's shard of the data-parallel average. Its local part is what this rank counts, and the
sums are first combined over ``shard_group`` (the data-parallel group the shards are spread
over), then over the model-parallel group as above, so the norm equals the unsharded one.

Nothing here reads module-level process-group getters: the caller passes ``tp_rank`` (this rank's
index in its tensor-parallel group) and ``model_parallel_group``, and for the experts
``expert_tp_rank`` and ``expert_model_parallel_group``. A group of None means there is nothing
to reduce over (a single rank).
"""

import math
from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.distributed.torch_fsdp2 import local_tensor
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

Params = Union[torch.Tensor, Iterable[torch.Tensor]]


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for the duplicate copy of a tied embedding (``param.shared``), True otherwise."""
    return not getattr(param, "shared", False)


def is_expert_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to this rank's experts (Megatron's ``allreduce = False``):
    the ranks of the expert-parallel group hold different experts."""
    return not getattr(param, "allreduce", True)


def param_counts_here(param: torch.Tensor, *, tp_rank: int,
                      expert_tp_rank: Optional[int] = None, weight_shard_rank: int = 0) -> bool:
    """Whether ``param`` counts in the whole model's norm on this rank: not the ``shared`` copy
    of a tied embedding, and a TP shard or on TP rank 0; an expert's parameter is judged at
    ``expert_tp_rank`` (None: ``tp_rank``, the default expert layout) instead. With weight
    shards (``weight_shard_rank``: this rank's place in its weight-shard group) a parameter
    that is not a weight shard (``weight_shards``) is a copy on every rank of the group and
    counts on its rank 0 only."""
    if is_expert_parallel(param) and expert_tp_rank is not None:
        tp_rank = expert_tp_rank
    if weight_shard_rank != 0 and getattr(param, "weight_shards", 1) == 1:
        return False
    return param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param, tp_rank)


def get_grads_for_norm(parameters: Params, *, tp_rank: int,
                       expert_tp_rank: Optional[int] = None,
                       weight_shard_rank: int = 0) -> List[torch.Tensor]:
    """The ``.grad`` of each parameter that contributes to the global norm on this rank
    (:func:`param_counts_here`)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [local_tensor(p.grad.detach()) for p in parameters if p.grad is not None
            and param_counts_here(p, tp_rank=tp_rank, expert_tp_rank=expert_tp_rank,
                                  weight_shard_rank=weight_shard_rank)]


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def _ranks(group) -> Optional[List[int]]:
    """The global ranks of ``group``; None for a group of one rank (or None)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    return dist.get_process_group_ranks(group)


def same_ranks(group_a, group_b) -> bool:
    """Whether two groups (None: this rank alone) hold the same ranks."""
    return group_a is group_b or _ranks(group_a) == _ranks(group_b)


def experts_apart(model_parallel_group, expert_model_parallel_group) -> bool:
    """Whether the experts' part of a norm or zero count needs a reduction of its own: the
    expert model-parallel group holds other ranks than the model-parallel group.

    It depends on the groups only, never on this rank's TP or expert-TP rank, so that every
    rank of a group makes the same collectives."""
    return not same_ranks(model_parallel_group, expert_model_parallel_group)


def _local_power_sum(grads: List[torch.Tensor], norm_type: float, where) -> torch.Tensor:
    """``[1]``: the sum of ``|g|^p`` over ``grads`` (the max of ``|g|`` for the max-norm)."""
    grads = [g.detach().float() for g in grads]
    local_norms = torch._foreach_norm(grads, norm_type) if grads else []
    if not local_norms:
        return torch.zeros(1, device=where)
    stacked = torch.stack(local_norms)
    if norm_type == math.inf:
        return stacked.max().reshape(1)
    return stacked.pow(norm_type).sum().reshape(1)


def get_grad_norm_fp32(grads_for_norm: Params, norm_type: float = 2.0,
                       model_parallel_group=None, *, expert_grads: Optional[Params] = None,
                       expert_model_parallel_group=None, shard_group=None,
                       weight_shard_group=None, expert_weight_shard_group=None) -> float:
    """The ``norm_type``-norm of the gradients of the whole model, computed in fp32.

    Args:
        grads_for_norm: this rank's gradients to count (see :func:`get_grads_for_norm`).
        norm_type: p of the p-norm; ``math.inf`` for the max-norm.
        model_parallel_group: group over which the local parts are combined (TP x PP).
        expert_grads: when the experts are counted apart (:func:`experts_apart`), this
            rank's expert gradients to count (:func:`get_grads_for_norm` at the expert-TP
            rank), kept out of ``grads_for_norm``; their part is combined over
            ``expert_model_parallel_group`` alone.
        expert_model_parallel_group: the expert model-parallel group (expert TP x EP x PP).
        shard_group: with fully sharded data parallelism, the group the gradients are sharded
            over; the local parts are combined over it before ``model_parallel_group``.
        weight_shard_group: the dense weight-shard group (``--tensor-parallel-num-weight-shards``;
            ``grads_for_norm`` then counts its copies on the group's rank 0 only, see
            :func:`param_counts_here`); the local parts are combined over it first as well.
        expert_weight_shard_group: the experts' weight-shard group
            (``--expert-tensor-parallel-num-weight-shards``): ``expert_grads`` are combined over
            it before ``expert_model_parallel_group``.

    Returns:
        The total norm as a Python float (identical on every rank of the groups).
    """
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads = [local_tensor(g) for g in grads_for_norm]
    norm_type = float(norm_type)
    where = grads[0].device if grads else device.current_device()
    if norm_type <= 0.0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    # Sum of |g|^p over this rank's tensors, then over the group; the p-th root at the end.
    total = _local_power_sum(grads, norm_type, where)
    _all_reduce(total, op, weight_shard_group)
    _all_reduce(total, op, shard_group)
    _all_reduce(total, op, model_parallel_group)
    if expert_grads is not None:
        expert = _local_power_sum(list(expert_grads), norm_type, where)
        _all_reduce(expert, op, expert_weight_shard_group)
        _all_reduce(expert, op, expert_model_parallel_group)
        total = torch.maximum(total, expert) if norm_type == math.inf else total + expert
    if norm_type == math.inf:
        return float(total.item())
    return float(total.item()) ** (1.0 / norm_type)


def clip_grads_with_norm_fp32(parameters: Params, max_norm: float, total_norm: float) -> None:
    """Scale every ``param.grad`` by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [local_tensor(p.grad.detach()) for p in parameters if p.grad is not None]
    clip_coeff = float(max_norm) / (total_norm + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def clip_grad_norm_fp32(parameters: Params, grads_for_norm: Params, max_norm: float,
                        norm_type: float = 2.0, model_parallel_group=None, *,
                        expert_grads: Optional[Params] = None,
                        expert_model_parallel_group=None, shard_group=None,
                        weight_shard_group=None, expert_weight_shard_group=None) -> float:
    """Clip the gradients of ``parameters`` so the whole model's norm is at most ``max_norm``.

    The norm is taken over ``grads_for_norm`` (each parameter counted once across the model,
    see :func:`get_grads_for_norm`); the clip coefficient is applied to the gradient of every
    parameter in ``parameters``, duplicates included, so replicas stay identical.

    Args:
        parameters: parameters whose ``.grad`` (fp32) is clipped in place.
        grads_for_norm: gradients that make up the norm on this rank.
        max_norm: ``--clip-grad``.
        norm_type: p of the p-norm; ``math.inf`` for the max-norm.
        model_parallel_group: group over which the norm is combined (TP x PP).
        expert_grads / expert_model_parallel_group / shard_group / weight_shard_group /
            expert_weight_shard_group: see :func:`get_grad_norm_fp32`.

    Returns:
        The total norm before clipping.
    """
    total_norm = get_grad_norm_fp32(grads_for_norm, norm_type, model_parallel_group,
                                    expert_grads=expert_grads,
                                    expert_model_parallel_group=expert_model_parallel_group,
                                    shard_group=shard_group,
                                    weight_shard_group=weight_shard_group,
                                    expert_weight_shard_group=expert_weight_shard_group)
    clip_grads_with_norm_fp32(parameters, max_norm, total_norm)
    return total_norm


def count_zeros_fp32(parameters: Params, model_parallel_group=None, *, tp_rank: int,
                     expert_tp_rank: Optional[int] = None,
                     expert_parameters: Optional[Params] = None,
                     expert_model_parallel_group=None, shard_group=None,
                     weight_shard_group=None, weight_shard_rank: int = 0,
                     expert_weight_shard_group=None, expert_weight_shard_rank: int = 0) -> int:
    """Number of exactly-zero gradient entries in the whole model (``--log-num-zeros-in-grad``).

    Counts each parameter once across the model, with the same rule as the norm
    (:func:`param_counts_here`).

    Args:
        parameters: this rank's parameters (experts among them unless counted apart).
        model_parallel_group: group over which their counts are summed (TP x PP).
        tp_rank: this rank's TP rank (replicated parameters count on TP rank 0).
        expert_tp_rank: the rank experts' parameters are judged at; None: ``tp_rank``.
        expert_parameters: when the experts are counted apart (:func:`experts_apart`), this
            rank's expert parameters, kept out of ``parameters``; their count is summed over
            ``expert_model_parallel_group`` alone.
        shard_group: with fully sharded data parallelism, the group the gradients are sharded
            over; the counts are summed over it first.
        weight_shard_group / weight_shard_rank: with dense weight shards, the weight-shard
            group (summed over first) and this rank's place in it (see
            :func:`param_counts_here`).
        expert_weight_shard_group / expert_weight_shard_rank: the same for the experts counted
            apart (``--expert-tensor-parallel-num-weight-shards``).
    """
    def local_count(params: Params, shard_rank: int = 0) -> torch.Tensor:
        grads = get_grads_for_norm(params, tp_rank=tp_rank, expert_tp_rank=expert_tp_rank,
                                   weight_shard_rank=shard_rank)
        where = grads[0].device if grads else device.current_device()
        total = torch.zeros(1, dtype=torch.float64, device=where)
        for grad in grads:
            total += grad.numel() - torch.count_nonzero(grad)
        return total

    total = local_count(parameters, weight_shard_rank)
    _all_reduce(total, dist.ReduceOp.SUM, weight_shard_group)
    _all_reduce(total, dist.ReduceOp.SUM, shard_group)
    _all_reduce(total, dist.ReduceOp.SUM, model_parallel_group)
    count = int(total.item())
    if expert_parameters is not None:
        experts = local_count(expert_parameters, expert_weight_shard_rank)
        _all_reduce(experts, dist.ReduceOp.SUM, expert_weight_shard_group)
        _all_reduce(experts, dist.ReduceOp.SUM, expert_model_parallel_group)
        count += int(experts.item())
    return count
