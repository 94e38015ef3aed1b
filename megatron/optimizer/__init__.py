"""Optimizers, loss scaling, gradient clipping and learning-rate schedules (Megatron's names)."""

from .builder import build_grad_scaler, get_megatron_optimizer, get_param_groups
from .clip_grads import (clip_grad_norm_fp32, count_zeros_fp32, get_grad_norm_fp32,
                         get_grads_for_norm)
from .config import OptimizerConfig, SchedulerConfig
from .distrib_optimizer import DistributedOptimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, MegatronGradScaler
from .optimizer import (Float16OptimizerWithFloat16Params, FP32Optimizer, FullyShardedOptimizer,
                        MegatronOptimizer)
from .optimizer_param_scheduler import OptimizerParamScheduler

__all__ = [
    "OptimizerConfig", "SchedulerConfig", "get_megatron_optimizer", "get_param_groups",
    "build_grad_scaler",
    "MegatronOptimizer", "FP32Optimizer", "Float16OptimizerWithFloat16Params",
    "FullyShardedOptimizer",
    "DistributedOptimizer",
    "MegatronGradScaler", "ConstantGradScaler", "DynamicGradScaler",
    "clip_grad_norm_fp32", "get_grad_norm_fp32", "get_grads_for_norm", "count_zeros_fp32",
    "OptimizerParamScheduler",
]
