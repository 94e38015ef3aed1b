"""Building the optimizer a run asks for: parameter groups, the torch optimizer, the wrapper.

:func:`get_megatron_optimizer` (Megatron's name) returns :class:`FP32Optimizer`,
:class:`Float16OptimizerWithFloat16Params` or, with ``--use-distributed-optimizer``,
:class:`DistributedOptimizer`; it lives apart from the wrappers so that neither wrapper module
needs the other.
"""

from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .clip_grads import is_expert_parallel
from .config import OptimizerConfig
from .distrib_optimizer import DistributedOptimizer
from .cpu_offload import HybridDeviceOptimizer
from .lion import Lion
from .emerging import EMERGING_OPTIMIZERS, build_emerging
from .precision_aware_adam import PrecisionAwareAdamW
from .muon import build_muon, mark_qkv_weights, split_muon_groups
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .optimizer import (Float16OptimizerWithFloat16Params, FP32Optimizer, FullyShardedOptimizer,
                        MegatronOptimizer)
from megatron.core.config import ConfigError
from megatron.core.mup import mup_group_overrides

ParamCond = Callable[[str, torch.nn.Parameter], bool]


def get_param_groups(model_chunks: Sequence[torch.nn.Module], config: OptimizerConfig,
                     no_weight_decay_cond: Optional[ParamCond] = None,
                     scale_lr_cond: Optional[ParamCond] = None,
                     lr_mult: float = 1.0) -> List[dict]:
    """Group trainable parameters by (``wd_mult``, ``lr_mult``), in order of first appearance.

    By default biases (names ending in ``.bias``) and every 1-D parameter (norm weights) get no
    weight decay (``wd_mult`` 0), except, with ``config.apply_wd_to_qk_layernorm``
    (``--apply-wd-to-qk-layernorm``), the query and key norms' parameters; parameters selected by ``scale_lr_cond`` get ``lr_mult``.
    Each group's initial ``lr`` and ``weight_decay`` already include its multipliers, so the
    optimizer is right before the scheduler first touches it.

    With ``config.decoupled_lr`` (``--decoupled-lr``), parameters marked
    ``is_embedding_or_output_parameter`` (word embeddings, output layer) form groups of their
    own, and every group carries ``max_lr`` / ``min_lr`` (``--decoupled-lr`` /
    ``--decoupled-min-lr``, else ``--min-lr``, for those; ``--lr`` / ``--min-lr`` for the rest)
    and ``is_decoupled_lr``, which the scheduler follows with the same schedule shape.

    With ``config.use_mup`` (``--use-mup``) parameters are further grouped by
    :func:`~megatron.core.mup.mup_group_overrides`: a group whose lr it scales carries the
    scaled ``max_lr`` / ``min_lr`` and ``mup_lr_factor``, one whose Adam ``eps`` it scales
    its own ``eps``.
    """
    decoupled = config.decoupled_lr is not None
    by_key: Dict[tuple, List[torch.nn.Parameter]] = {}
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if not param.requires_grad:
                continue
            if no_weight_decay_cond is not None:
                no_wd = no_weight_decay_cond(name, param)
            else:
                no_wd = name.endswith(".bias") or param.dim() == 1
                if config.apply_wd_to_qk_layernorm and _is_qk_norm(name):
                    no_wd = False
            scale_lr = scale_lr_cond(name, param) if scale_lr_cond is not None else False
            own_lr = decoupled and getattr(param, "is_embedding_or_output_parameter", False)
            key = (0.0 if no_wd else 1.0, float(lr_mult) if scale_lr else 1.0, own_lr)
            if config.use_mup:
                key += mup_group_overrides(config.optimizer, config.mup_width_mult, decoupled,
                                           param, name)
            by_key.setdefault(key, []).append(param)
    return [_param_group(config, key, params) for key, params in by_key.items()]


def _param_group(config: OptimizerConfig, key: tuple, params: List[torch.nn.Parameter]) -> dict:
    """One group's hyper-parameters from its key ``(wd_mult, lr_mult, own_lr[, mup lr
    factor, mup eps factor])``."""
    wd_mult, group_lr_mult, own_lr = key[:3]
    mup_lr, mup_eps = key[3:] if len(key) > 3 else (1.0, 1.0)
    max_lr = (config.decoupled_lr if own_lr else config.lr) * mup_lr
    group = {"params": params, "wd_mult": wd_mult, "lr_mult": group_lr_mult,
             "lr": max_lr * group_lr_mult, "weight_decay": config.weight_decay * wd_mult}
    if config.decoupled_lr is not None or mup_lr != 1.0:
        min_lr = config.min_lr
        if own_lr and config.decoupled_min_lr is not None:
            min_lr = config.decoupled_min_lr
        group.update(max_lr=max_lr, min_lr=min_lr * mup_lr, is_decoupled_lr=own_lr)
    if mup_lr != 1.0:
        group["mup_lr_factor"] = mup_lr
    if mup_eps != 1.0:
        group["eps"] = config.adam_eps * mup_eps
        group["mup_eps_factor"] = mup_eps
    return group


def _is_qk_norm(name: str) -> bool:
    return "q_layernorm." in name or "k_layernorm." in name


def _build_torch_optimizer(config: OptimizerConfig, param_groups: List[dict],
                           sharded: bool = False) -> torch.optim.Optimizer:
    """The optimizer :func:`_build_one_optimizer` gives, wrapped with
    ``--optimizer-cpu-offload`` in a :class:`HybridDeviceOptimizer` that builds its host and
    device parts the same way (torch's own AdamW for both with
    ``--use-torch-optimizer-for-cpu-offload``)."""
    if not config.optimizer_cpu_offload:
        return _build_one_optimizer(config, param_groups, sharded)
    if sharded:
        raise ConfigError("--optimizer-cpu-offload does not run with --use-torch-fsdp2 "
                          "(its parameters are sharded DTensors); drop one of the two")
    torch_only = config.use_torch_optimizer_for_cpu_offload
    return HybridDeviceOptimizer(
        param_groups, lambda groups, on_host: _build_one_optimizer(config, groups, torch_only),
        offload_fraction=config.optimizer_offload_fraction, pin_grads=config.pin_cpu_grads,
        pin_params=config.pin_cpu_params, overlap=config.overlap_cpu_optimizer_d2h_h2d)


def _build_one_optimizer(config: OptimizerConfig, param_groups: List[dict],
                         sharded: bool = False) -> torch.optim.Optimizer:
    """AdamW (fused when the kernels load; :class:`PrecisionAwareAdamW` with
    ``--use-precision-aware-optimizer``), Lion or SGD; ``sharded``: over FSDP2's DTensor
    parameters, which the fused kernel does not take, so torch's own AdamW."""
    if config.optimizer == "adam" and config.use_precision_aware_optimizer:
        return PrecisionAwareAdamW(
            param_groups, lr=config.lr, weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
            exp_avg_dtype=config.exp_avg_dtype, exp_avg_sq_dtype=config.exp_avg_sq_dtype,
            main_params_dtype=config.main_params_dtype, main_grads_dtype=config.main_grads_dtype)
    if config.optimizer == "adam":
        # Megatron's Adam decouples weight decay from the gradient (AdamW). The fused
        # multi-tensor step is used when the compiled kernels load; its state_dict is
        # torch.optim.AdamW's, so checkpoints move freely between the two.
        from megatron.fused_kernels import loader

        adam_cls = torch.optim.AdamW
        if not sharded and loader.load() is not None:
            from megatron.optimizer.fused_adam import FusedAdamW

            adam_cls = FusedAdamW
        return adam_cls(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
    if config.optimizer == "lion":
        return Lion(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                    betas=(config.lion_beta1, config.lion_beta2))
    return torch.optim.SGD(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                           momentum=config.sgd_momentum)


def build_grad_scaler(config: OptimizerConfig) -> Optional[MegatronGradScaler]:
    """``--loss-scale`` gives a constant scaler; otherwise fp16 gets the dynamic one."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    if config.fp16:
        return DynamicGradScaler(initial_scale=config.initial_loss_scale,
                                 min_scale=config.min_loss_scale, growth_factor=2.0,
                                 backoff_factor=0.5, growth_interval=config.loss_scale_window,
                                 hysteresis=config.hysteresis)
    return None


def _check_expert_groups(model_chunks, param_groups: List[dict], mp_group,
                         expert_model_parallel_group, expert_tp_rank: Optional[int]) -> None:
    """Refuse a model with experts but no expert group where one is needed: without it the
    experts' part of the norm would be counted on this rank alone."""
    if expert_model_parallel_group is not None:
        if expert_tp_rank is None:
            raise ValueError("get_megatron_optimizer: expert_model_parallel_group was given "
                             "without expert_tp_rank; pass ParallelState.expert_tp_rank")
        return
    if not any(is_expert_parallel(p) for group in param_groups for p in group["params"]):
        return
    mp_size = dist.get_world_size(mp_group) if mp_group is not None else 1
    expert_buffers = any(getattr(c, "expert_dp_group", None) is not None for c in model_chunks)
    if mp_size > 1 or expert_buffers:
        where = (f"mp_group has {mp_size} ranks" if mp_size > 1 else
                 "the model chunks keep expert gradients over an expert-data-parallel group")
        raise ConfigError(
            f"get_megatron_optimizer: the model has expert parameters (allreduce = False) and "
            f"{where}, but expert_model_parallel_group is None, so the experts' part of the "
            "gradient norm would miss the other ranks' experts; pass "
            "ParallelState.expert_model_parallel_group and ParallelState.expert_tp_rank")


def _check_weight_shards(config: OptimizerConfig, weight_shard_group, grad_shard_group,
                         flag: str = "--tensor-parallel-num-weight-shards") -> None:
    """Refuse, in one line, the optimizers that do not combine norms over weight shards."""
    if weight_shard_group is None or dist.get_world_size(weight_shard_group) == 1:
        return
    if config.use_distributed_optimizer or grad_shard_group is not None:
        raise ConfigError(f"{flag} does not run with --use-distributed-optimizer or "
                          "--use-torch-fsdp2 yet")
    if config.optimizer in ("muon", "dist_muon") or config.optimizer in EMERGING_OPTIMIZERS:
        raise ConfigError(f"--optimizer {config.optimizer} does not run with {flag} (it needs "
                          "each weight matrix whole); use --optimizer adam")


def _fully_sharded_optimizer(config: OptimizerConfig, param_groups: List[dict], kwargs: dict,
                             grad_shard_group) -> MegatronOptimizer:
    """The optimizer over FSDP2's sharded fp32 parameters (with --bf16 / --fp16 too: FSDP2
    computes in half precision from them; --fp16 adds the loss scaler)."""
    inner = _build_torch_optimizer(config, param_groups, sharded=True)
    return FullyShardedOptimizer(inner, config, half=config.bf16 or config.fp16,
                                 grad_scaler=build_grad_scaler(config),
                                 grad_shard_group=grad_shard_group, **kwargs)


def get_megatron_optimizer(config: OptimizerConfig,
                           model_chunks: Union[torch.nn.Module, Sequence[torch.nn.Module]], *,
                           mp_group, tp_group, dp_group=None,
                           no_weight_decay_cond: Optional[ParamCond] = None,
                           scale_lr_cond: Optional[ParamCond] = None, lr_mult: float = 1.0,
                           use_main_grad: Optional[bool] = None,
                           overlap_param_gather: bool = False,
                           expert_model_parallel_group=None,
                           expert_tp_rank: Optional[int] = None,
                           grad_shard_group=None,
                           expert_tp_group=None,
                           weight_shard_group=None,
                           expert_weight_shard_group=None) -> MegatronOptimizer:
    """Build the optimizer for this rank's model chunks.

    Args:
        config: the run's optimizer settings.
        model_chunks: this rank's model (a list with virtual pipeline stages).
        mp_group: model-parallel group (TP x PP) for the grad norm and the inf/nan flag; None when
            this rank holds the whole model.
        tp_group: tensor-parallel group, used only to know this rank's TP rank (replicated
            parameters count in the norm on TP rank 0 only); None means no tensor parallelism.
            Both are required arguments so that forgetting one cannot silently double-count.
        dp_group: data-parallel group, over which ``--use-distributed-optimizer`` shards the
            optimizer state (None: the model chunks' own); unused otherwise, since gradients
            then arrive already averaged over data-parallel ranks.
        no_weight_decay_cond: ``(name, param) -> bool``; default: biases and 1-D params.
        scale_lr_cond: ``(name, param) -> bool`` selecting params whose lr is scaled by
            ``lr_mult``.
        lr_mult: learning-rate multiplier for ``scale_lr_cond`` params.
        use_main_grad: where gradients are read from; see :class:`MegatronOptimizer`
            (the distributed optimizer always reads the data-parallel gradient buffer).
        overlap_param_gather: with ``--use-distributed-optimizer``, overlap the all-gather of
            updated parameters with the next forward (``--overlap-param-gather``).
        expert_model_parallel_group: the experts' counterpart of ``mp_group``, expert TP x EP x
            PP (``ParallelState.expert_model_parallel_group``; None: one rank); required when
            the model has experts (parameters marked ``allreduce = False``) and ``mp_group``
            has several ranks or the chunks keep expert gradient buffers. See
            :class:`MegatronOptimizer`.
        expert_tp_rank: this rank's expert-TP rank (``ParallelState.expert_tp_rank``);
            required with ``expert_model_parallel_group``.
        grad_shard_group: the data-parallel group FSDP2 shards the model chunks over
            (``--use-torch-fsdp2``); a :class:`FullyShardedOptimizer` is returned, stepping on
            the shards, its norms summed over this group. None: parameters are whole.
        expert_tp_group: the group expert weights are split over (``--optimizer muon``
            gathers their shards from it; None: ``tp_group``).
        weight_shard_group: the dense weight-shard group (``ParallelState.weight_shard_group``,
            ``--tensor-parallel-num-weight-shards``; None: none), see
            :class:`MegatronOptimizer`. Only the plain (non-distributed) Adam / SGD / Lion
            optimizers take it.
        expert_weight_shard_group: the routed experts' weight-shard group
            (``ParallelState.expert_weight_shard_group``,
            ``--expert-tensor-parallel-num-weight-shards``; None: none); the same optimizers.

    With ``config.use_distributed_optimizer`` the model chunks must be
    ``DistributedDataParallel`` wrappers (built with ``use_distributed_optimizer=True`` so that
    gradients are reduce-scattered); a :class:`DistributedOptimizer` is returned.
    """
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    param_groups = get_param_groups(model_chunks, config, no_weight_decay_cond, scale_lr_cond,
                                    lr_mult)
    if not param_groups:
        raise ValueError("the model has no trainable parameters to optimize")
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    _check_expert_groups(model_chunks, param_groups, mp_group, expert_model_parallel_group,
                         expert_tp_rank)
    _check_weight_shards(config, weight_shard_group, grad_shard_group)
    _check_weight_shards(config, expert_weight_shard_group, grad_shard_group,
                         "--expert-tensor-parallel-num-weight-shards")
    if config.use_distributed_optimizer and config.optimizer not in EMERGING_OPTIMIZERS:
        scaler = build_grad_scaler(config) if config.fp16 or config.bf16 else None
        return DistributedOptimizer(
            config, model_chunks, param_groups,
            lambda groups: _build_torch_optimizer(config, groups), scaler, dp_group=dp_group,
            model_parallel_group=mp_group, tp_rank=tp_rank,
            expert_model_parallel_group=expert_model_parallel_group,
            expert_tp_rank=expert_tp_rank, overlap_param_gather=overlap_param_gather)
    if overlap_param_gather:
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")
    kwargs = dict(model_parallel_group=mp_group, tp_rank=tp_rank, use_main_grad=use_main_grad,
                  expert_model_parallel_group=expert_model_parallel_group,
                  expert_tp_rank=expert_tp_rank, weight_shard_group=weight_shard_group,
                  expert_weight_shard_group=expert_weight_shard_group)
    if config.optimizer in ("muon", "dist_muon"):
        if grad_shard_group is not None:
            raise ConfigError("--optimizer muon does not run with --use-torch-fsdp2 (Muon "
                              "needs each weight matrix whole); use --optimizer adam")
        if config.muon_split_qkv:
            mark_qkv_weights(model_chunks)
        inner = build_muon(config, split_muon_groups(param_groups), tp_group=tp_group,
                           expert_tp_group=expert_tp_group or tp_group,
                           dp_group=_model_dp_group(model_chunks, dp_group))
    elif config.optimizer in EMERGING_OPTIMIZERS:
        inner = _build_emerging(config, model_chunks, param_groups, grad_shard_group, tp_group,
                                expert_tp_group, dp_group)
    elif grad_shard_group is not None:
        return _fully_sharded_optimizer(config, param_groups, kwargs, grad_shard_group)
    else:
        inner = _build_torch_optimizer(config, param_groups)
    if config.fp16 or config.bf16:
        return Float16OptimizerWithFloat16Params(inner, config, build_grad_scaler(config),
                                                 **kwargs)
    return FP32Optimizer(inner, config, **kwargs)


def _build_emerging(config, model_chunks, param_groups, grad_shard_group, tp_group,
                    expert_tp_group, dp_group):
    """``--optimizer soap`` / ``adaptive_muon`` (megatron/optimizer/emerging.py); with
    ``--use-distributed-optimizer`` they deal whole weights over ``dp_group`` themselves."""
    if grad_shard_group is not None:
        raise ConfigError(f"--optimizer {config.optimizer} does not run with --use-torch-fsdp2 "
                          "(it needs each weight matrix whole); use --optimizer adam")
    if config.optimizer == "adaptive_muon" and config.muon_split_qkv:
        mark_qkv_weights(model_chunks)
    return build_emerging(config, split_muon_groups(param_groups), tp_group=tp_group,
                          expert_tp_group=expert_tp_group or tp_group,
                          dp_group=_model_dp_group(model_chunks, dp_group))


def _model_dp_group(model_chunks, dp_group):
    """``dp_group``, else the data-parallel wrapper's own group (None: one rank)."""
    if dp_group is not None:
        return dp_group
    return getattr(model_chunks[0], "dp_group", None)
