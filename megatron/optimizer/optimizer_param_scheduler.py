"""Learning-rate and weight-decay schedules, stepped in samples or iterations.

``step(increment)`` advances the schedule by ``increment`` steps; the training loop passes the
global batch size, so every ``*_steps`` argument here is a number of samples (the harness
converts ``--lr-warmup-iters`` etc. by multiplying with the global batch size).

Learning rate at step ``n`` (``max_lr``/``min_lr`` may be overridden per param group):

* warmup (``n <= lr_warmup_steps``, when ``lr_warmup_steps > 0``): linear from ``init_lr`` to
  ``max_lr``;
* ``constant``: ``max_lr`` after warmup, forever;
* otherwise, after ``lr_decay_steps``: ``min_lr``;
* ``inverse-square-root``: ``max_lr * sqrt(max(warmup, 1)) / sqrt(max(n, 1))``, floored at
  ``min_lr``;
* ``linear`` / ``cosine``: from ``max_lr`` to ``min_lr`` over ``[warmup, decay]``;
* ``WSD`` (warmup-stable-decay): ``max_lr`` until the last ``wsd_decay_steps`` of the decay, then a
  tail of style ``lr_wsd_decay_style`` (``exponential``, ``linear``, ``cosine``, ``minus_sqrt``).

Weight decay goes from ``start_wd`` to ``end_wd`` over ``wd_incr_steps`` (``constant``, ``linear``
or ``cosine``). Each group receives ``lr * lr_mult`` and ``wd * wd_mult``.
"""

import logging
import math
from typing import Optional

from megatron.core.config import ConfigError

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")

# Checkpoint key -> (attribute, description used in messages, flag that sets it).
_CHECKED_FIELDS = (
    ("max_lr", "learning rate", "--lr"),
    ("min_lr", "minimum learning rate", "--min-lr"),
    ("lr_warmup_steps", "warmup iterations", "--lr-warmup-iters/--lr-warmup-samples"),
    ("lr_decay_steps", "total number of iterations", "--lr-decay-iters/--lr-decay-samples"),
    ("lr_decay_style", "learning rate decay style", "--lr-decay-style"),
)
_CHECKED_WD_FIELDS = (
    ("start_wd", "start weight decay", "--start-weight-decay"),
    ("end_wd", "end weight decay", "--end-weight-decay"),
    ("wd_incr_steps", "total number of weight decay iterations", "--train-iters/--train-samples"),
    ("wd_incr_style", "weight decay incr style", "--weight-decay-incr-style"),
)
# Older checkpoints name some fields differently; newest name first.
_LEGACY_KEYS = {
    "max_lr": ("max_lr", "start_lr"),
    "lr_warmup_steps": ("lr_warmup_steps", "warmup_steps", "warmup_iter"),
    "lr_decay_steps": ("lr_decay_steps", "decay_steps", "end_iter"),
    "lr_decay_style": ("lr_decay_style", "decay_style"),
    "num_steps": ("num_steps", "num_iters"),
}


class OptimizerParamScheduler:
    """Sets ``lr`` and ``weight_decay`` of every optimizer param group at each step.

    Args:
        optimizer: anything with ``param_groups`` (a torch optimizer or a MegatronOptimizer).
        init_lr: learning rate at step 0 of warmup (``--lr-warmup-init``).
        max_lr, min_lr: ``--lr``, ``--min-lr``.
        lr_warmup_steps, lr_decay_steps: in the unit of ``step``'s increment.
        lr_decay_style: one of :data:`LR_DECAY_STYLES`.
        start_wd, end_wd, wd_incr_steps, wd_incr_style: weight-decay schedule.
        use_checkpoint_opt_param_scheduler: on load, take the checkpoint's values
            (``--use-checkpoint-opt_param-scheduler``).
        override_opt_param_scheduler: on load, keep this object's values
            (``--override-opt_param-scheduler``).
        wsd_decay_steps, lr_wsd_decay_style: the WSD tail.
    """

    def __init__(self, optimizer, init_lr: float, max_lr: float, min_lr: float,
                 lr_warmup_steps: int, lr_decay_steps: int, lr_decay_style: str,
                 start_wd: float, end_wd: float, wd_incr_steps: int, wd_incr_style: str,
                 use_checkpoint_opt_param_scheduler: bool = True,
                 override_opt_param_scheduler: bool = False,
                 wsd_decay_steps: Optional[int] = None,
                 lr_wsd_decay_style: Optional[str] = None):
        self.optimizer = optimizer
        self.init_lr = init_lr
        self.max_lr = float(max_lr)
        self.min_lr = min_lr
        self.lr_warmup_steps = lr_warmup_steps
        self.lr_decay_steps = lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = wsd_decay_steps
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = start_wd
        self.end_wd = end_wd
        self.wd_incr_steps = wd_incr_steps
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        if override_opt_param_scheduler and use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler cannot both be set")
        self._validate()
        self.num_steps = 0
        self.step(0)
        logger.info("learning rate decay style: %s", self.lr_decay_style)

    def _validate(self) -> None:
        if self.min_lr < 0.0:
            raise ConfigError(f"--min-lr must be >= 0, got {self.min_lr}")
        if self.max_lr < self.min_lr:
            raise ConfigError(f"--lr ({self.max_lr}) must be >= --min-lr ({self.min_lr})")
        if self.init_lr > self.max_lr:
            raise ConfigError(f"--lr-warmup-init ({self.init_lr}) must be <= --lr "
                              f"({self.max_lr})")
        if self.lr_decay_steps <= 0:
            raise ConfigError(f"lr decay steps (--lr-decay-iters/--lr-decay-samples, else "
                              f"--train-iters/--train-samples) must be > 0, "
                              f"got {self.lr_decay_steps}")
        if not 0 <= self.lr_warmup_steps < self.lr_decay_steps:
            raise ConfigError(f"lr warmup steps ({self.lr_warmup_steps}) must be >= 0 and "
                              f"smaller than lr decay steps ({self.lr_decay_steps})")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style must be one of {LR_DECAY_STYLES}, "
                              f"got {self.lr_decay_style!r}")
        if self.lr_decay_style == "WSD":
            self._validate_wsd()
        if not 0.0 <= self.start_wd <= self.end_wd:
            raise ConfigError(f"need 0 <= --start-weight-decay ({self.start_wd}) <= "
                              f"--end-weight-decay ({self.end_wd})")
        if self.wd_incr_style not in WD_INCR_STYLES:
            raise ConfigError(f"--weight-decay-incr-style must be one of {WD_INCR_STYLES}, "
                              f"got {self.wd_incr_style!r}")
        if self.wd_incr_style == "constant" and self.start_wd != self.end_wd:
            raise ConfigError(f"--weight-decay-incr-style constant needs --start-weight-decay "
                              f"({self.start_wd}) == --end-weight-decay ({self.end_wd})")
        if self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            raise ConfigError(f"weight decay increment steps must be > 0 with "
                              f"--weight-decay-incr-style {self.wd_incr_style}, "
                              f"got {self.wd_incr_steps}")

    def _validate_wsd(self) -> None:
        if self.wsd_decay_steps is None:
            raise ConfigError("--lr-decay-style WSD needs --lr-wsd-decay-iters or "
                              "--lr-wsd-decay-samples")
        if not 0 < self.wsd_decay_steps <= self.lr_decay_steps:
            raise ConfigError(f"WSD decay steps ({self.wsd_decay_steps}) must be in "
                              f"(0, lr decay steps={self.lr_decay_steps}]")
        if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            raise ConfigError(f"--lr-wsd-decay-style must be one of {WSD_DECAY_STYLES}, "
                              f"got {self.lr_wsd_decay_style!r}")

    def get_wd(self) -> float:
        """Weight decay at the current step."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict) -> float:
        """Learning rate at the current step, before the group's ``lr_mult``."""
        max_lr = param_group.get("max_lr", self.max_lr)
        min_lr = param_group.get("min_lr", self.min_lr)
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(self.lr_warmup_steps)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1)
            lr = max_lr * math.sqrt(warmup) / math.sqrt(max(n, 1))
            return max(min_lr, lr)
        decay_ratio = float(n - self.lr_warmup_steps) / float(
            self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        else:  # WSD
            coeff = self._wsd_coeff(n)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, n: int) -> float:
        anneal_start = self.lr_decay_steps - self.wsd_decay_steps
        if n <= anneal_start:
            return 1.0
        ratio = float(n - anneal_start) / float(self.wsd_decay_steps)
        style = self.lr_wsd_decay_style
        if style == "linear":
            return 1.0 - ratio
        if style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        return 1.0 - math.sqrt(ratio)  # minus_sqrt

    def step(self, increment: int) -> None:
        """Advance by ``increment`` (the global batch size when counting samples) and apply."""
        self.num_steps += increment
        new_wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = new_wd * group.get("wd_mult", 1.0)

    def state_dict(self) -> dict:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, value, saved_value, description: str, flag: str):
        """Which of this run's ``value`` and the checkpoint's ``saved_value`` to keep."""
        if self.override_opt_param_scheduler:
            logger.info(" > overriding %s value to %s", description, value)
            return value
        if not self.use_checkpoint_opt_param_scheduler and value != saved_value:
            raise ConfigError(
                f"OptimizerParamScheduler: {description} ({flag}) is {value!r} in this run but "
                f"{saved_value!r} in the checkpoint; pass --override-opt_param-scheduler to use "
                "this run's value or --use-checkpoint-opt_param-scheduler to use the checkpoint's")
        logger.info(" > using checkpoint value %s for %s", saved_value, description)
        return saved_value

    @staticmethod
    def _saved(state_dict: dict, name: str):
        for key in _LEGACY_KEYS.get(name, (name,)):
            if key in state_dict:
                return state_dict[key]
        raise KeyError(f"optimizer param scheduler state has no {name!r}; "
                       f"found keys {sorted(state_dict)}")

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the step count and reconcile the schedule with the checkpoint's.

        A value that differs from the checkpoint's raises :class:`ConfigError` naming it,
        unless ``override_opt_param_scheduler`` (keep ours) or
        ``use_checkpoint_opt_param_scheduler`` (take the checkpoint's) is set.
        """
        for name, description, flag in _CHECKED_FIELDS:
            saved = self._saved(state_dict, name)
            setattr(self, name, self._check_and_set(getattr(self, name), saved, description, flag))
        if "start_wd" in state_dict:
            for name, description, flag in _CHECKED_WD_FIELDS:
                saved = state_dict[name]
                setattr(self, name,
                        self._check_and_set(getattr(self, name), saved, description, flag))
        self._validate()
        self.num_steps = 0
        self.step(int(self._saved(state_dict, "num_steps")))
