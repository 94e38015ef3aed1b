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

Nothing here reads module-level process-group getters: the caller passes ``tp_rank`` (this rank's
index in its tensor-parallel group) and ``model_parallel_group``. ``model_parallel_group=None``
means there is nothing to reduce over (a single model-parallel rank).
"""

import math
from typing import Iterable, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core import device
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

Params = Union[torch.Tensor, Iterable[torch.Tensor]]


def param_is_not_shared(param: torch.Tensor) -> bool:
    """False for the duplicate copy of a tied embedding (``param.shared``), True otherwise."""
    return not getattr(param, "shared", False)


def get_grads_for_norm(parameters: Params, *, tp_rank: int) -> List[torch.Tensor]:
    """The ``.grad`` of each parameter that contributes to the global norm on this rank."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    return [p.grad.detach() for p in parameters
            if p.grad is not None and param_is_not_shared(p)
            and param_is_not_tensor_parallel_duplicate(p, tp_rank)]


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


def is_expert_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to this rank's experts (Megatron's ``allreduce = False``):
    the ranks of the expert-parallel group hold different experts."""
    return not getattr(param, "allreduce", True)


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
                       expert_parallel_group=None) -> float:
    """The ``norm_type``-norm of the gradients of the whole model, computed in fp32.

    Args:
        grads_for_norm: this rank's gradients to count (see :func:`get_grads_for_norm`).
        norm_type: p of the p-norm; ``math.inf`` for the max-norm.
        model_parallel_group: group over which the local parts are combined (TP x PP).
        expert_grads: with expert parallelism, this rank's expert gradients (kept out of
            ``grads_for_norm``); their part is combined over the model-parallel group and
            then over ``expert_parallel_group``, whose ranks hold different experts.
        expert_parallel_group: the expert-parallel group.

    Returns:
        The total norm as a Python float (identical on every rank of the groups).
    """
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    grads = list(grads_for_norm)
    norm_type = float(norm_type)
    where = grads[0].device if grads else device.current_device()
    if norm_type <= 0.0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type}")
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    # Sum of |g|^p over this rank's tensors, then over the group; the p-th root at the end.
    total = _local_power_sum(grads, norm_type, where)
    _all_reduce(total, op, model_parallel_group)
    if expert_grads is not None:
        expert = _local_power_sum(list(expert_grads), norm_type, where)
        _all_reduce(expert, op, model_parallel_group)
        _all_reduce(expert, op, expert_parallel_group)
        total = torch.maximum(total, expert) if norm_type == math.inf else total + expert
    if norm_type == math.inf:
        return float(total.item())
    return float(total.item()) ** (1.0 / norm_type)


def clip_grads_with_norm_fp32(parameters: Params, max_norm: float, total_norm: float) -> None:
    """Scale every ``param.grad`` by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    clip_coeff = float(max_norm) / (total_norm + 1.0e-6)
    if grads and clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def clip_grad_norm_fp32(parameters: Params, grads_for_norm: Params, max_norm: float,
                        norm_type: float = 2.0, model_parallel_group=None, *,
                        expert_grads: Optional[Params] = None,
                        expert_parallel_group=None) -> float:
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
        expert_grads / expert_parallel_group: see :func:`get_grad_norm_fp32`.

    Returns:
        The total norm before clipping.
    """
    total_norm = get_grad_norm_fp32(grads_for_norm, norm_type, model_parallel_group,
                                    expert_grads=expert_grads,
                                    expert_parallel_group=expert_parallel_group)
    clip_grads_with_norm_fp32(parameters, max_norm, total_norm)
    return total_norm


def count_zeros_fp32(parameters: Params, model_parallel_group=None, *, tp_rank: int,
                     expert_parallel_group=None) -> int:
    """Number of exactly-zero gradient entries in the whole model (``--log-num-zeros-in-grad``).

    Counts each parameter once across the model, with the same rule as the norm; with
    ``expert_parallel_group`` the experts' zeros are also summed over that group.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = list(parameters)
    parts = [(parameters, model_parallel_group, None)]
    if expert_parallel_group is not None:
        parts = [([p for p in parameters if not is_expert_parallel(p)], model_parallel_group,
                  None),
                 ([p for p in parameters if is_expert_parallel(p)], model_parallel_group,
                  expert_parallel_group)]
    count = 0
    for params, group, second_group in parts:
        grads = get_grads_for_norm(params, tp_rank=tp_rank)
        where = grads[0].device if grads else device.current_device()
        total = torch.zeros(1, dtype=torch.float64, device=where)
        for grad in grads:
            total += grad.numel() - torch.count_nonzero(grad)
        _all_reduce(total, dist.ReduceOp.SUM, group)
        _all_reduce(total, dist.ReduceOp.SUM, second_group)
        count += int(total.item())
    return count
