"""Optimizer wrappers: fp32 training, and fp16/bf16 training on fp32 main parameters.

The training loop talks to one of two classes with Megatron's method names:

* :class:`FP32Optimizer` for an fp32 model: gradients are clipped and the torch optimizer steps
  on the model parameters directly.
* :class:`FullyShardedOptimizer` for an fp32 model sharded by FSDP2 (``--use-torch-fsdp2``):
  parameters, gradients and moments are ``DTensor`` shards; norms sum the shards over the
  data-parallel group; with ``--fp16`` a loss scaler unscales the shards and every rank skips
  an overflowing step; checkpoints hold whole tensors, gathered on save and re-sharded on
  load, so optimizer state moves freely between runs with and without FSDP2.
* :class:`Float16OptimizerWithFloat16Params` for a model held in fp16 or bf16: every half-precision
  parameter gets an fp32 "main" copy that the torch optimizer updates. Each step copies the model
  gradients into fp32 main gradients, unscales them and checks them for inf/nan (fp16), clips
  them, steps, and rounds the main parameters back into the model. Keeping the master weights in
  fp32 means updates smaller than half-precision resolution still accumulate.

Where gradients come from: with the data-parallel wrapper (``megatron/core/distributed``) every
parameter carries ``param.main_grad``, already averaged over data-parallel ranks, and
``param.grad`` is None; without it the gradient is ``param.grad``. ``use_main_grad`` picks one
(None: use ``main_grad`` on parameters that have it, else ``grad``).

Parameter attributes read here: ``tensor_model_parallel`` (a TP shard, set by the
tensor-parallel layers), ``shared`` (duplicate of a tied embedding; counted once in the norm),
``allreduce`` (False on the MoE experts, counted over the expert groups), ``sequence_parallel``.
They are copied onto the fp32 main parameters so the norm treats both alike.
"""

import logging
from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import apex_state
from .clip_grads import (clip_grad_norm_fp32, count_zeros_fp32, experts_apart, get_grads_for_norm,
                         is_expert_parallel)
from .config import OptimizerConfig
from .grad_scaler import MegatronGradScaler
from megatron.core import collectives, device
from megatron.core.distributed.torch_fsdp2 import gather_full, is_dtensor, local_tensor, shard_like

logger = logging.getLogger(__name__)

# Attributes that say how a parameter is split or shared; main params inherit them.
_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride",
                        "sequence_parallel", "shared", "allreduce", "muon_qkv_split",
                        "grad_norm_group", "weight_shards", "weight_shard_rank")

StepResult = Tuple[bool, Optional[float], Optional[int]]
# --load-main-params-from-ckpt: id(model parameter) -> the checkpoint's tensor for it.
MainValues = Dict[int, torch.Tensor]


def main_value(model_param: torch.Tensor, main_values: Optional[MainValues]) -> torch.Tensor:
    """What a main param of ``model_param`` reloads from: the checkpoint's tensor for it, in
    fp32, when ``main_values`` holds one, else the model's own value."""
    source = None if main_values is None else main_values.get(id(model_param))
    if source is None:
        return model_param.detach()
    if tuple(source.shape) != tuple(model_param.shape):
        raise ValueError(f"--load-main-params-from-ckpt: the checkpoint's tensor has shape "
                         f"{tuple(source.shape)}, the parameter {tuple(model_param.shape)}")
    return source.detach().to(device=model_param.device, dtype=torch.float32)


def in_separate_norm_group(param: torch.Tensor) -> bool:
    """True for a parameter tagged ``grad_norm_group`` (Megatron-Core's ``"mtp"``, on detached
    MTP heads): it is clipped by its own group's norm and left out of the logged norm."""
    return getattr(param, "grad_norm_group", None) is not None


def split_by_norm_group(params: Sequence[torch.Tensor]
                        ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(untagged, tagged)``: see :func:`in_separate_norm_group`."""
    return ([p for p in params if not in_separate_norm_group(p)],
            [p for p in params if in_separate_norm_group(p)])


def _zero_grad_group_helper(group: Sequence[torch.Tensor], set_to_none: bool) -> None:
    for param in group:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


def _reject_distributed_state(state_dict: dict) -> None:
    """A replicated optimizer cannot take the unsharded state of the distributed optimizer."""
    if "param_state" in state_dict:
        raise ValueError("optimizer checkpoint was saved with --use-distributed-optimizer "
                         "(it has 'param_state'); pass the flag to load it, or --no-load-optim")


def _group_key(group: dict) -> Optional[Tuple[float, float]]:
    if "wd_mult" not in group:
        return None
    return (float(group["wd_mult"]), float(group.get("lr_mult", 1.0)))


def _in_group_order(state_dict: dict, optimizer: torch.optim.Optimizer) -> dict:
    """``state_dict`` with its param groups in this optimizer's order, matched by
    (``wd_mult``, ``lr_mult``) where both sides record them: Megatron-LM always puts the
    weight-decayed group first, this project the group of the stage's first parameter."""
    saved = state_dict.get("param_groups")
    if not saved:
        return state_dict
    want = [_group_key(g) for g in optimizer.param_groups]
    have = [_group_key(g) for g in saved]
    if (None in want or None in have or want == have or sorted(want) != sorted(have)
            or len(set(want)) != len(want)):
        return state_dict
    by_key = dict(zip(have, saved))
    return {**state_dict, "param_groups": [by_key[k] for k in want]}


def _in_torch_layout(state_dict: dict, optimizer: torch.optim.Optimizer) -> dict:
    """A torch optimizer's state as this optimizer loads it: groups in this optimizer's order,
    and apex FusedAdam's layout (Megatron-LM runs with apex) converted."""
    state_dict = _in_group_order(state_dict, optimizer)
    if optimizer.__class__.__name__ != "SGD" and apex_state.is_apex_adam_state(state_dict):
        logger.info("converting optimizer state saved by apex FusedAdam to torch's AdamW layout")
        return apex_state.to_torch_adam(state_dict, optimizer.param_groups,
                                        "optimizer checkpoint")
    return state_dict


def copy_parallel_attributes(source: torch.Tensor, destination: torch.Tensor) -> None:
    for name in _PARALLEL_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def scale_rows_(tensor: torch.Tensor, factor: torch.Tensor) -> None:
    """``tensor[i] *= factor[i]`` in place for every row ``i`` (``tensor`` ``[rows, ...]``)."""
    shape = (-1,) + (1,) * (tensor.dim() - 1)
    tensor.mul_(factor.to(device=tensor.device, dtype=tensor.dtype).view(shape))


class MegatronOptimizer(ABC):
    """What the training loop sees: step, zero_grad, loss scale, state dicts, param groups.

    Args:
        optimizer: the torch optimizer doing the update (AdamW or SGD).
        config: the run's :class:`OptimizerConfig`.
        model_parallel_group: TP x PP group over which the gradient norm, zero count and
            inf/nan flag are combined; None when this rank alone holds the model.
        tp_rank: this rank's index in its tensor-parallel group (replicated parameters are
            counted in the norm on TP rank 0 only).
        use_main_grad: True: read ``param.main_grad``; False: read ``param.grad``; None: the
            former where a parameter has it.
        expert_model_parallel_group: expert TP x EP x PP (``ParallelState.
            expert_model_parallel_group``), the ranks holding one copy of every expert shard:
            the experts' (parameters marked ``allreduce = False``) part of the norm and zero
            count is combined over it alone, and the inf/nan flag over it after the
            model-parallel group. None: one rank. Where it holds the same ranks as the
            model-parallel group (always with the default expert layout) the experts are
            summed with the dense parameters in one reduction.
        expert_tp_rank: this rank's index in its expert-TP group (an expert's replicated
            parameters count on expert-TP rank 0 only); None: ``tp_rank``.
        grad_shard_group: with fully sharded data parallelism (``--use-torch-fsdp2``), the
            data-parallel group the parameters and gradients are sharded over: norms and zero
            counts of the local shards are summed over it as well. None: not sharded.
        weight_shard_group: the dense weight-shard group (``--tensor-parallel-num-weight-shards``,
            ``ParallelState.weight_shard_group``; None: no weight shards): norms, zero counts
            and the inf/nan flag are combined over it first, the parameters that are not
            weight shards counting on its rank 0 only.
        expert_weight_shard_group: the routed experts' weight-shard group
            (``--expert-tensor-parallel-num-weight-shards``; None: none): the experts are then
            counted apart, their part combined over it before the expert model-parallel group,
            and their parameters that are not weight shards count on its rank 0 only.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, *,
                 model_parallel_group=None, tp_rank: int = 0,
                 use_main_grad: Optional[bool] = None, expert_model_parallel_group=None,
                 expert_tp_rank: Optional[int] = None, grad_shard_group=None,
                 weight_shard_group=None, expert_weight_shard_group=None):
        self.optimizer = optimizer
        self.grad_shard_group = grad_shard_group
        self.weight_shard_group = weight_shard_group
        self.weight_shard_rank = collectives.get_group_rank(weight_shard_group)
        self.expert_weight_shard_group = expert_weight_shard_group
        self.expert_weight_shard_rank = collectives.get_group_rank(expert_weight_shard_group)
        self.config = config
        self.model_parallel_group = model_parallel_group
        self.tp_rank = tp_rank
        self.expert_model_parallel_group = expert_model_parallel_group
        self.expert_tp_rank = tp_rank if expert_tp_rank is None else expert_tp_rank
        # False with the default expert layout: the experts then count as dense parameters.
        # Also under FSDP2, where the shard group (data x context parallel) holds every
        # expert-parallel x expert-data-parallel position: summed over it and then over the
        # model-parallel group, each expert shard counts once.
        # Expert weight shards are summed over their own group first: always apart.
        self.experts_apart = grad_shard_group is None and (
            experts_apart(model_parallel_group, expert_model_parallel_group)
            or collectives.get_group_size(expert_weight_shard_group) > 1)
        self.use_main_grad = use_main_grad

    # -- gradients -------------------------------------------------------------------------

    def _model_grad(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient the backward pass left for ``param`` (``main_grad`` or ``grad``)."""
        if self.use_main_grad is False:
            return param.grad
        if hasattr(param, "main_grad"):
            return param.main_grad
        if self.use_main_grad:
            raise RuntimeError(
                f"parameter of shape {tuple(param.shape)} has no main_grad but the optimizer was "
                "built with use_main_grad=True; wrap the model in the data-parallel wrapper "
                "or pass use_main_grad=False")
        return param.grad

    def get_parameters(self) -> List[torch.Tensor]:
        """Every parameter the torch optimizer updates (fp32 main params in mixed precision)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_main_grads_for_grad_norm(self) -> List[torch.Tensor]:
        return get_grads_for_norm(self.get_parameters(), tp_rank=self.tp_rank,
                                  expert_tp_rank=self.expert_tp_rank,
                                  weight_shard_rank=self.weight_shard_rank)

    def _reduce_any(self, flag: torch.Tensor) -> torch.Tensor:
        """Max of ``flag`` over every rank holding a part of this model's parameters."""
        return collectives.all_reduce(flag, self.model_parallel_group, op=dist.ReduceOp.MAX)

    def has_separate_norm_group(self) -> bool:
        """True when any rank's parameters carry a ``grad_norm_group`` (asked once, over
        every rank, so all of them take the same collectives)."""
        if getattr(self, "_has_separate_norm_group", None) is None:
            local = any(in_separate_norm_group(p) for p in self.get_parameters())
            flag = torch.tensor([float(local)], device=device.current_device())
            self._has_separate_norm_group = bool(self._reduce_any(flag).item())
        return self._has_separate_norm_group

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip the main gradients to ``clip_grad``; return the norm before clipping. Tagged
        parameters (:func:`in_separate_norm_group`) are clipped by their own norm, which the
        returned one leaves out."""
        params = self.get_parameters()
        if not self.has_separate_norm_group():
            return self._clip_grad_norm(params, clip_grad)
        untagged, tagged = split_by_norm_group(params)
        grad_norm = self._clip_grad_norm(untagged, clip_grad)
        self._clip_grad_norm(tagged, clip_grad)
        return grad_norm

    def _clip_grad_norm(self, params: List[torch.Tensor], clip_grad: float) -> float:
        if not self.experts_apart:
            grads = get_grads_for_norm(params, tp_rank=self.tp_rank,
                                       expert_tp_rank=self.expert_tp_rank,
                                       weight_shard_rank=self.weight_shard_rank)
            return clip_grad_norm_fp32(params, grads, clip_grad,
                                       model_parallel_group=self.model_parallel_group,
                                       shard_group=self.grad_shard_group,
                                       weight_shard_group=self.weight_shard_group)
        dense = [p for p in params if not is_expert_parallel(p)]
        experts = [p for p in params if is_expert_parallel(p)]
        return clip_grad_norm_fp32(
            params, get_grads_for_norm(dense, tp_rank=self.tp_rank,
                                       weight_shard_rank=self.weight_shard_rank), clip_grad,
            model_parallel_group=self.model_parallel_group,
            weight_shard_group=self.weight_shard_group,
            expert_grads=get_grads_for_norm(experts, tp_rank=self.expert_tp_rank,
                                            weight_shard_rank=self.expert_weight_shard_rank),
            expert_model_parallel_group=self.expert_model_parallel_group,
            expert_weight_shard_group=self.expert_weight_shard_group)

    def count_zeros(self) -> int:
        params = self.get_parameters()
        kwargs = dict(tp_rank=self.tp_rank, expert_tp_rank=self.expert_tp_rank,
                      shard_group=self.grad_shard_group,
                      weight_shard_group=self.weight_shard_group,
                      weight_shard_rank=self.weight_shard_rank)
        if self.experts_apart:
            kwargs.update(expert_parameters=[p for p in params if is_expert_parallel(p)],
                          expert_model_parallel_group=self.expert_model_parallel_group,
                          expert_weight_shard_group=self.expert_weight_shard_group,
                          expert_weight_shard_rank=self.expert_weight_shard_rank)
            params = [p for p in params if not is_expert_parallel(p)]
        return count_zeros_fp32(params, self.model_parallel_group, **kwargs)

    def _unscale_and_check_for_nan(self, grads: List[torch.Tensor],
                                   inv_scale: torch.Tensor) -> bool:
        """Multiply ``grads`` by ``inv_scale`` in place; True if any rank saw an inf or nan.

        The flag is reduced (MAX) over the model-parallel group, then over the expert
        model-parallel group, so every rank skips the same step: dense gradients are identical
        over data-parallel replicas, which the first reduction reaches from every TP x PP
        position, and expert gradients over expert-data-parallel replicas, which the second
        reaches from every expert TP x EP x PP position (each of its ranks carrying its whole
        model-parallel group's flag). The second is skipped where both hold the same ranks.
        """
        grads = [local_tensor(g) for g in grads]
        where = grads[0].device if grads else device.current_device()
        found_inf = torch.zeros(1, dtype=torch.float32, device=where)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf,
                                                             inv_scale.to(where))
        groups = [self.weight_shard_group, self.grad_shard_group, self.model_parallel_group]
        if self.experts_apart:
            groups += [self.expert_weight_shard_group, self.expert_model_parallel_group]
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return found_inf.item() > 0

    def _raise_if_not_finite(self, grads: List[torch.Tensor]) -> None:
        """``--check-for-nan-in-loss-and-grad`` without a loss scaler: stop on inf/nan."""
        one = torch.ones(1, dtype=torch.float32)
        if self._unscale_and_check_for_nan(grads, one):
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise RuntimeError(
                f"rank {rank}: found inf or nan in the gradients before the optimizer step "
                "(--check-for-nan-in-loss-and-grad is set)")

    def _step_with_ready_grads(self) -> Tuple[Optional[float], Optional[int]]:
        """Clip, count zeros, update. Main gradients must be unscaled and finite."""
        grad_norm = None
        if self.config.clip_grad > 0.0:
            grad_norm = self.clip_grad_norm(self.config.clip_grad)
        num_zeros_in_grad = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        self.optimizer.step()
        return grad_norm, num_zeros_in_grad

    # -- loss scale ------------------------------------------------------------------------

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """The current loss scale as a one-element fp32 tensor."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale, computed in at least fp32 so the product cannot
        overflow a half-precision loss."""
        dtype = torch.promote_types(loss.dtype, torch.float32)
        return loss.to(dtype) * self.get_loss_scale().to(loss.device, dtype).squeeze()

    # -- the rest of Megatron's interface ---------------------------------------------------

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        ...

    @abstractmethod
    def step(self) -> StepResult:
        """Update the parameters from the current gradients.

        Returns:
            ``(update_successful, grad_norm, num_zeros_in_grad)``: False when an fp16 step was
            skipped for inf/nan gradients; the norm before clipping (None without clipping or on
            a skipped step); the zero count with ``--log-num-zeros-in-grad``, else None.
        """

    @abstractmethod
    def reload_model_params(self, main_values: Optional[MainValues] = None) -> None:
        """Refresh main params from the model's params (after loading model weights alone).

        Args:
            main_values: --load-main-params-from-ckpt: maps a model parameter to the tensor the
                checkpoint holds for it (its full local shape, any float dtype); the main param
                takes that value in fp32 instead of the model's (possibly rounded) copy.
                Parameters it lacks take the model's value.
        """

    @torch.no_grad()
    def scale_param_rows(self, factors) -> None:
        """Multiply rows of model parameters by per-row factors after a step (QK-clip).

        ``factors``: ``(model param [rows, ...], factor [rows] fp32)`` pairs. The main weight
        is scaled in fp32 and the model weight follows it, so both stay as one step would
        leave them. This wrapper's parameters are the main weights themselves.
        """
        for param, factor in factors:
            scale_rows_(param.data, factor)

    @abstractmethod
    def state_dict(self) -> dict:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None:
        ...

    @property
    def param_groups(self) -> List[dict]:
        """The torch optimizer's groups; the LR scheduler writes ``lr``/``weight_decay`` here."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value


class FP32Optimizer(MegatronOptimizer):
    """An fp32 model: clip and step on the model parameters themselves.

    Its state dict is the torch optimizer's own, as in Megatron.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, **kwargs):
        super().__init__(optimizer, config, **kwargs)
        self._scale = torch.ones(1, dtype=torch.float32, device=device.current_device())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.optimizer.param_groups:
            _zero_grad_group_helper(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    def step(self) -> StepResult:
        if self.use_main_grad is not False:
            for param in self.get_parameters():
                if hasattr(param, "main_grad") or self.use_main_grad:
                    param.grad = self._model_grad(param)
        if self.config.check_for_nan_in_loss_and_grad:
            self._raise_if_not_finite([p.grad for p in self.get_parameters()
                                       if p.grad is not None])
        grad_norm, num_zeros_in_grad = self._step_with_ready_grads()
        return True, grad_norm, num_zeros_in_grad

    def reload_model_params(self, main_values: Optional[MainValues] = None) -> None:
        pass  # fp32 params are their own main params: loading the model loaded them

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        _reject_distributed_state(state_dict)
        if "state" not in state_dict and "optimizer" in state_dict:
            # Written by the mixed-precision wrapper: its torch optimizer state is compatible.
            logger.warning("loading an fp32 optimizer from a mixed-precision optimizer "
                           "checkpoint: using its 'optimizer' entry only")
            state_dict = state_dict["optimizer"]
        self.optimizer.load_state_dict(_in_torch_layout(state_dict, self.optimizer))


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """A model in fp16 or bf16, updated through fp32 main parameters.

    The torch optimizer's groups are rewritten to hold the fp32 main params in place of the model's
    half-precision params (fp32 model params, if any, are updated directly).

    Args:
        optimizer: torch optimizer built on the model's parameters; must not have stepped yet.
        config: the run's :class:`OptimizerConfig`.
        grad_scaler: the loss scaler (required with ``--fp16``; None for bf16 unless
            ``--loss-scale`` is given).
        **kwargs: see :class:`MegatronOptimizer`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: Optional[MegatronGradScaler], **kwargs):
        super().__init__(optimizer, config, **kwargs)
        if config.fp16 and grad_scaler is None:
            raise ValueError("--fp16 needs a loss scaler (dynamic, or --loss-scale)")
        self.grad_scaler = grad_scaler
        self._scale_one = torch.ones(1, dtype=torch.float32, device=device.current_device())
        self.float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []
        for group in self.optimizer.param_groups:
            self._make_main_params(group)

    def _make_main_params(self, group: dict) -> None:
        float16_params, main_params, fp32_params = [], [], []
        for i, param in enumerate(group["params"]):
            if param.dtype in (torch.float16, torch.bfloat16):
                main_param = param.detach().to(torch.float32, copy=True)
                copy_parallel_attributes(param, main_param)
                group["params"][i] = main_param
                if param in self.optimizer.state:
                    self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                float16_params.append(param)
                main_params.append(main_param)
            elif param.dtype == torch.float32:
                fp32_params.append(param)
            else:
                raise TypeError(f"parameters must be fp16, bf16 or fp32, got {param.dtype} "
                                f"for a parameter of shape {tuple(param.shape)}")
        self.float16_groups.append(float16_params)
        self.fp32_from_float16_groups.append(main_params)
        self.fp32_from_fp32_groups.append(fp32_params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for groups in (self.float16_groups, self.fp32_from_float16_groups,
                       self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _copy_model_grads_to_main_grads(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                grad = self._model_grad(model_param)
                main_param.grad = None if grad is None else grad.float()
                # The fp32 copy now holds it; free the half-precision one.
                model_param.grad = None
        if self.use_main_grad is False:
            return
        for group in self.fp32_from_fp32_groups:
            for param in group:
                if hasattr(param, "main_grad") or self.use_main_grad:
                    param.grad = self._model_grad(param)

    def _main_grads(self) -> List[torch.Tensor]:
        return [p.grad for groups in (self.fp32_from_float16_groups, self.fp32_from_fp32_groups)
                for group in groups for p in group if p.grad is not None]

    def _copy_main_params_to_model_params(self) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                model_param.data.copy_(main_param.data)

    def reload_model_params(self, main_values: Optional[MainValues] = None) -> None:
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                main_param.data.copy_(main_value(model_param, main_values))

    @torch.no_grad()
    def scale_param_rows(self, factors) -> None:
        mains = {id(model): main for model_group, main_group in
                 zip(self.float16_groups, self.fp32_from_float16_groups)
                 for model, main in zip(model_group, main_group)}
        for param, factor in factors:
            main = mains.get(id(param))
            if main is None:                       # an fp32 parameter is its own main weight
                scale_rows_(param.data, factor)
            else:
                scale_rows_(main.data, factor)
                param.data.copy_(main.data)

    @torch.no_grad()
    def step(self) -> StepResult:
        self._copy_model_grads_to_main_grads()
        main_grads = self._main_grads()
        if self.grad_scaler is not None:
            found_inf = self._unscale_and_check_for_nan(main_grads, self.grad_scaler.inv_scale)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None, None
        elif self.config.check_for_nan_in_loss_and_grad:
            self._raise_if_not_finite(main_grads)
        grad_norm, num_zeros_in_grad = self._step_with_ready_grads()
        self._copy_main_params_to_model_params()
        return True, grad_norm, num_zeros_in_grad

    def state_dict(self) -> dict:
        """Megatron's layout: ``optimizer``, ``grad_scaler`` (when there is one) and
        ``fp32_from_fp16_params`` (the fp32 main params, per group), so a resumed run continues
        from the exact master weights rather than from their half-precision rounding."""
        state_dict = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        state_dict["fp32_from_fp16_params"] = self.fp32_from_float16_groups
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        _reject_distributed_state(state_dict)
        key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        if key not in state_dict:
            raise KeyError(f"optimizer checkpoint has neither 'optimizer' nor "
                           f"'optimizer_state_dict'; found keys {sorted(state_dict)}")
        self.optimizer.load_state_dict(_in_torch_layout(state_dict[key], self.optimizer))
        self._load_grad_scaler(state_dict)
        key = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        if key not in state_dict:
            raise KeyError("optimizer checkpoint has no 'fp32_from_fp16_params'; "
                           f"found keys {sorted(state_dict)}")
        self._load_main_params(state_dict[key])

    def _load_grad_scaler(self, state_dict: dict) -> None:
        if "grad_scaler" not in state_dict:
            if self.config.fp16:
                logger.warning("optimizer checkpoint has no grad scaler state; "
                               "keeping the current loss scale")
        elif self.grad_scaler is None:
            logger.warning("optimizer checkpoint has grad scaler state but this run has no "
                           "loss scaler (bf16 without --loss-scale); ignoring it")
        else:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def _load_main_params(self, saved_groups: Sequence[Sequence[torch.Tensor]]) -> None:
        if len(saved_groups) != len(self.fp32_from_float16_groups):
            raise ValueError(f"optimizer checkpoint has {len(saved_groups)} groups of fp32 main "
                             f"params, this model has {len(self.fp32_from_float16_groups)}")
        for g, (current, saved) in enumerate(zip(self.fp32_from_float16_groups, saved_groups)):
            if len(current) != len(saved):
                raise ValueError(f"optimizer checkpoint group {g} has {len(saved)} fp32 main "
                                 f"params, this model has {len(current)}")
            for i, (param, saved_param) in enumerate(zip(current, saved)):
                if param.shape != saved_param.shape:
                    raise ValueError(f"optimizer checkpoint group {g} param {i} has shape "
                                     f"{tuple(saved_param.shape)}, this model's is "
                                     f"{tuple(param.shape)}")
                param.data.copy_(saved_param.data)


class FullyShardedOptimizer(FP32Optimizer):
    """:class:`FP32Optimizer` over FSDP2's sharded fp32 parameters (the fp32 main weights).

    Args:
        optimizer / config / **kwargs: as for :class:`FP32Optimizer`; ``grad_shard_group`` is
            the group the parameters are sharded over.
        half: the model computes in bf16 or fp16 (``--bf16`` / ``--fp16``, FSDP2's
            mixed-precision policy): the state dict then takes the mixed-precision optimizer's
            layout (``optimizer``, ``grad_scaler`` and ``fp32_from_fp16_params``), so a
            checkpoint moves between runs with and without FSDP2 and a resume continues from
            the exact fp32 weights.
        grad_scaler: the loss scaler (``--fp16``, or ``--loss-scale``). The sharded gradients
            arrive scaled; each step unscales them and checks them for inf/nan, the flag
            reduced over the shard group and the model-parallel groups, so every rank skips
            the same step and the scaler moves alike everywhere. None: no scaling.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, *,
                 half: bool = False, grad_scaler: Optional[MegatronGradScaler] = None,
                 **kwargs):
        super().__init__(optimizer, config, **kwargs)
        if config.fp16 and grad_scaler is None:
            raise ValueError("--fp16 needs a loss scaler (dynamic, or --loss-scale)")
        self.half = half
        self.grad_scaler = grad_scaler

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale if self.grad_scaler is None else self.grad_scaler.scale

    @torch.no_grad()
    def step(self) -> StepResult:
        if self.grad_scaler is None:
            return super().step()
        grads = [p.grad for p in self.get_parameters() if p.grad is not None]
        found_inf = self._unscale_and_check_for_nan(grads, self.grad_scaler.inv_scale)
        self.grad_scaler.update(found_inf)
        if found_inf:
            return False, None, None
        grad_norm, num_zeros_in_grad = self._step_with_ready_grads()
        return True, grad_norm, num_zeros_in_grad

    def state_dict(self) -> dict:
        """Whole tensors, in the layout of the optimizer a run without FSDP2 would have
        (collective over the shard group)."""
        inner = gather_full(self.optimizer.state_dict())
        if not self.half:
            return inner
        mains = [[gather_full(p.detach()) for p in group["params"]]
                 for group in self.optimizer.param_groups]
        state = {"optimizer": inner}
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        state["fp32_from_fp16_params"] = mains
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        _reject_distributed_state(state_dict)
        mains = state_dict.get("fp32_from_fp16_params", state_dict.get("fp32_from_fp16"))
        scaler = state_dict.get("grad_scaler")
        if "state" not in state_dict and "optimizer" in state_dict:
            state_dict = state_dict["optimizer"]
        state_dict = _in_torch_layout(state_dict, self.optimizer)
        self.optimizer.load_state_dict(self._sharded(state_dict))
        if self.grad_scaler is not None and scaler is not None:
            self.grad_scaler.load_state_dict(scaler)
        elif self.config.fp16:
            logger.warning("optimizer checkpoint has no grad scaler state; "
                           "keeping the current loss scale")
        if mains is not None:
            self._load_main_params(mains)
        elif self.half:
            logger.warning("optimizer checkpoint has no fp32 main params; the fp32 weights "
                           "start from the loaded model weights")

    @torch.no_grad()
    def _load_main_params(self, saved_groups) -> None:
        """The fp32 weights a mixed-precision checkpoint holds, into this rank's shards."""
        groups = [group["params"] for group in self.optimizer.param_groups]
        if [len(g) for g in saved_groups] != [len(g) for g in groups]:
            raise ValueError(f"optimizer checkpoint has fp32 main params in groups of "
                             f"{[len(g) for g in saved_groups]}, this model "
                             f"{[len(g) for g in groups]}")
        for current, saved in zip(groups, saved_groups):
            for param, saved_param in zip(current, saved):
                value = self._shard(saved_param.detach().float(), param)
                local_tensor(param).copy_(local_tensor(value))

    def _sharded(self, state_dict: dict) -> dict:
        """``state_dict`` with each whole moment replaced by this rank's shard of it."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        ids = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
        by_id = dict(zip(ids, params))
        state = {}
        for index, entry in state_dict.get("state", {}).items():
            param = by_id.get(index)
            state[index] = {key: self._shard(value, param) for key, value in entry.items()}
        return {**state_dict, "state": state}

    @staticmethod
    def _shard(value, param):
        sharded = is_dtensor(param) and isinstance(value, torch.Tensor)
        if not sharded or is_dtensor(value) or tuple(value.shape) != tuple(param.shape):
            return value   # the step count, or a value torch.optim itself checks
        return shard_like(value, param)


# -- construction ------------------------------------------------------------------------------
