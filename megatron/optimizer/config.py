"""The optimizer's and the learning-rate schedule's typed configs: what
``megatron/training/configs.py`` hands to the optimizer and its scheduler.

OptimizerConfig's field names follow Megatron's flags (``--adam-beta1`` -> ``adam_beta1``); its
:meth:`__post_init__` rejects impossible values with a message naming the flag, the value seen and
what was expected, so a wrong command line fails before any model is built. SchedulerConfig's
follow the scheduler's arguments, which Megatron-Core's scheduler shares.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from megatron.core.config import ConfigError
from megatron.core.mup import mup_optimizer_conflict

_DTYPE_FOR_PRECISION = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class OptimizerConfig:
    """Optimizer, mixed precision and loss-scaling settings (Megatron flag names in comments)."""

    optimizer: str = "adam"  # --optimizer adam, sgd, lion, muon, dist_muon, soap, adaptive_muon
    lr: Optional[float] = None             # --lr (the scheduler's max_lr; required)
    min_lr: float = 0.0                    # --min-lr
    # --decoupled-lr / --decoupled-min-lr: max and min lr of the word embeddings and the output
    # layer (params marked ``is_embedding_or_output_parameter``); the min defaults to --min-lr.
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None
    weight_decay: float = 0.01             # --weight-decay
    adam_beta1: float = 0.9                # --adam-beta1
    adam_beta2: float = 0.999              # --adam-beta2
    adam_eps: float = 1e-8                 # --adam-eps
    sgd_momentum: float = 0.9              # --sgd-momentum
    lion_beta1: float = 0.95               # --lion-beta1 (megatron/optimizer/lion.py)
    lion_beta2: float = 0.98               # --lion-beta2
    clip_grad: float = 1.0                 # --clip-grad (0 disables clipping)
    fp16: bool = False                     # --fp16
    bf16: bool = False                     # --bf16
    params_dtype: Optional[torch.dtype] = None  # derived from --fp16 / --bf16 when None
    loss_scale: Optional[float] = None     # --loss-scale (None: dynamic scaling with --fp16)
    initial_loss_scale: float = 2.0 ** 32  # --initial-loss-scale
    min_loss_scale: float = 1.0            # --min-loss-scale
    loss_scale_window: int = 1000          # --loss-scale-window
    hysteresis: int = 2                    # --hysteresis
    use_distributed_optimizer: bool = False  # --use-distributed-optimizer
    log_num_zeros_in_grad: bool = False    # --log-num-zeros-in-grad
    check_for_nan_in_loss_and_grad: bool = False  # --check-for-nan-in-loss-and-grad
    apply_wd_to_qk_layernorm: bool = False  # --apply-wd-to-qk-layernorm: weight decay on q/k norms
    # --muon-*: see megatron/optimizer/muon.py (read with --optimizer muon / dist_muon only)
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"
    muon_fp32_matmul_prec: str = "medium"
    muon_coefficient_type: str = "quintic"
    muon_num_ns_steps: int = 5
    muon_tp_mode: str = "duplicated"
    muon_use_syrk: bool = False
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"
    # --optimizer soap / adaptive_muon (megatron/optimizer/soap.py, adaptive_muon.py): Megatron-
    # Core's config fields of these names and defaults; no command-line flag sets them.
    soap_shampoo_beta: float = 0.95
    soap_precondition_frequency: int = 1
    soap_use_kl_shampoo: bool = True
    adaptive_muon_moment2_method: str = "adamuon"
    adaptive_muon_beta2: float = 0.95
    adaptive_muon_eps: float = 1e-8
    # --optimizer-cpu-offload and its companions: see megatron/optimizer/cpu_offload.py
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    use_torch_optimizer_for_cpu_offload: bool = False
    overlap_cpu_optimizer_d2h_h2d: bool = False
    pin_cpu_grads: bool = True             # --no-pin-cpu-grads
    pin_cpu_params: bool = True            # --no-pin-cpu-params
    # --use-mup: per-group lr (and Adam eps) scaled by the resolved width multiplier
    # (megatron/core/mup.py, mup_group_overrides)
    use_mup: bool = False
    mup_width_mult: float = 1.0
    # --use-precision-aware-optimizer and the dtypes it reads ("fp32", "bf16", "fp16"):
    # see megatron/optimizer/precision_aware_adam.py
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"

    def __post_init__(self):
        if self.optimizer not in ("adam", "sgd", "lion", "muon", "dist_muon", "soap",
                                  "adaptive_muon"):
            raise ConfigError(f"--optimizer must be adam, sgd, lion, muon, dist_muon, soap or "
                              f"adaptive_muon, got {self.optimizer!r}")
        problem = mup_optimizer_conflict(self.use_mup, self.optimizer)
        if problem is None and self.use_mup and not self.mup_width_mult > 0:
            problem = f"--mup-width-mult must be > 0, got {self.mup_width_mult}"
        if problem is not None:
            raise ConfigError(problem)
        if self.lr is None:
            raise ConfigError("--lr must be given (the peak learning rate), got None")
        self._check_learning_rates()
        self._check_precision()
        self._check_loss_scaling()
        if self.optimizer in ("muon", "dist_muon"):
            self._check_muon()
        if self.optimizer in ("soap", "adaptive_muon"):
            from .emerging import check_emerging_settings

            check_emerging_settings(self)
        self._check_offload()
        self._check_precision_aware()

    def _check_precision_aware(self) -> None:
        from .precision_aware_adam import precision_aware_conflict

        problem = precision_aware_conflict(
            self.use_precision_aware_optimizer, self.optimizer, self.use_distributed_optimizer,
            self.main_grads_dtype, self.main_params_dtype, self.exp_avg_dtype,
            self.exp_avg_sq_dtype)
        if problem is None and self.use_precision_aware_optimizer and self.optimizer_cpu_offload:
            problem = ("--use-precision-aware-optimizer with --optimizer-cpu-offload is not "
                       "built; drop one of the two")
        if problem is not None:
            raise ConfigError(problem)

    def _check_offload(self) -> None:
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ConfigError(f"--optimizer-offload-fraction must be in [0, 1], got "
                              f"{self.optimizer_offload_fraction}")
        if self.optimizer_cpu_offload and self.optimizer in ("muon", "dist_muon"):
            raise ConfigError("--optimizer-cpu-offload steps adam, sgd or lion on the host; "
                              f"--optimizer {self.optimizer} is not offloaded, drop the flag")

    def _check_muon(self) -> None:
        from .muon import check_muon_settings

        check_muon_settings(self)

    def _check_learning_rates(self) -> None:
        if self.lr < 0.0:
            raise ConfigError(f"--lr must be >= 0, got {self.lr}")
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"--min-lr must be in [0, --lr={self.lr}], got {self.min_lr}")
        if self.decoupled_lr is not None:
            if self.decoupled_lr < 0.0:
                raise ConfigError(f"--decoupled-lr must be >= 0, got {self.decoupled_lr}")
            low = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            if not 0.0 <= low <= self.decoupled_lr:
                raise ConfigError(f"--decoupled-min-lr (else --min-lr) must be in "
                                  f"[0, --decoupled-lr={self.decoupled_lr}], got {low}")
        if self.weight_decay < 0.0:
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for flag, value in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2),
                            ("--lion-beta1", self.lion_beta1), ("--lion-beta2", self.lion_beta2)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{flag} must be in [0, 1), got {value}")
        if self.adam_eps <= 0.0:
            raise ConfigError(f"--adam-eps must be > 0, got {self.adam_eps}")
        if self.sgd_momentum < 0.0:
            raise ConfigError(f"--sgd-momentum must be >= 0, got {self.sgd_momentum}")
        if self.clip_grad < 0.0:
            raise ConfigError(f"--clip-grad must be >= 0 (0 disables clipping), "
                              f"got {self.clip_grad}")

    def _check_precision(self) -> None:
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 cannot both be given")
        expected = torch.float32
        if self.fp16:
            expected = _DTYPE_FOR_PRECISION["fp16"]
        elif self.bf16:
            expected = _DTYPE_FOR_PRECISION["bf16"]
        if self.params_dtype is None:
            self.params_dtype = expected
        elif self.params_dtype != expected:
            precision = ("--fp16" if self.fp16 else "--bf16" if self.bf16
                         else "neither --fp16 nor --bf16")
            raise ConfigError(f"params_dtype {self.params_dtype} does not match {precision}: "
                              f"expected {expected}")

    def _check_loss_scaling(self) -> None:
        if self.loss_scale is not None and self.loss_scale <= 0.0:
            raise ConfigError(f"--loss-scale must be > 0 (or omitted for dynamic scaling), "
                              f"got {self.loss_scale}")
        if self.initial_loss_scale <= 0.0:
            raise ConfigError(f"--initial-loss-scale must be > 0, got {self.initial_loss_scale}")
        if not 0.0 < self.min_loss_scale <= self.initial_loss_scale:
            raise ConfigError(f"--min-loss-scale must be in (0, --initial-loss-scale="
                              f"{self.initial_loss_scale}], got {self.min_loss_scale}")
        # Megatron parses --loss-scale-window as a float; accept any whole number.
        if self.loss_scale_window < 1 or self.loss_scale_window != int(self.loss_scale_window):
            raise ConfigError(f"--loss-scale-window must be a whole number >= 1, "
                              f"got {self.loss_scale_window}")
        self.loss_scale_window = int(self.loss_scale_window)
        if self.hysteresis < 1:
            raise ConfigError(f"--hysteresis must be >= 1, got {self.hysteresis}")


@dataclass
class SchedulerConfig:
    """The learning-rate and weight-decay schedule: the arguments of
    :class:`~megatron.optimizer.optimizer_param_scheduler.OptimizerParamScheduler`, which checks
    them. Every ``*_steps`` is a number of samples: ``megatron/training/configs.py`` multiplies
    the ``--*-iters`` flags by the global batch size, as the training loop steps the schedule by the
    samples of each iteration."""

    init_lr: float                                # --lr-warmup-init
    max_lr: float                                 # --lr
    min_lr: float                                 # --min-lr
    lr_warmup_steps: float                        # --lr-warmup-{iters,samples,fraction}
    lr_decay_steps: int                           # --lr-decay-{iters,samples}, else the run
    lr_decay_style: str                           # --lr-decay-style
    start_wd: float                               # --start-weight-decay
    end_wd: float                                 # --end-weight-decay
    wd_incr_steps: int                            # --train-iters / --train-samples
    wd_incr_style: str                            # --weight-decay-incr-style
    use_checkpoint_opt_param_scheduler: bool = False  # --use-checkpoint-opt_param-scheduler
    override_opt_param_scheduler: bool = False    # --override-opt_param-scheduler
    wsd_decay_steps: Optional[int] = None         # --lr-wsd-decay-{iters,samples}
    lr_wsd_decay_style: Optional[str] = None      # --lr-wsd-decay-style
