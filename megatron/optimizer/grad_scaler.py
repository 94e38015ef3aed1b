"""Loss scalers for fp16 training: a constant scale, and Megatron's dynamic scale with hysteresis.

The loss is multiplied by ``scale`` before backward so small fp16 gradients do not flush to zero;
the optimizer multiplies the gradients by ``inv_scale`` before using them. The dynamic scaler
lowers the scale when gradients overflow and raises it after a run of clean steps.

State dicts use Megatron's keys (``scale``, ``growth_tracker``, ``hysteresis_tracker``) so
checkpoints carry the scaler across the two codebases.
"""

from abc import ABC, abstractmethod

import torch

from megatron.core import device


class MegatronGradScaler(ABC):
    """A loss scale held as a one-element fp32 tensor on the training device."""

    def __init__(self, initial_scale: float):
        if initial_scale <= 0.0:
            raise ValueError(f"loss scale must be > 0, got {initial_scale}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32,
                                   device=device.current_device())

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        # Reciprocal in fp64 then rounded, so a power-of-two scale gives an exact inverse.
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step; ``found_inf`` says whether any gradient overflowed."""

    @abstractmethod
    def state_dict(self) -> dict:
        ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict) -> None:
        ...


class ConstantGradScaler(MegatronGradScaler):
    """``--loss-scale S``: always S. Has no state worth saving (Megatron saves an empty dict)."""

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale.

    Rule, per step:

    * overflow: the growth counter restarts at 0 and the hysteresis counter drops by one; once it
      is at or below 0 the scale is multiplied by ``backoff_factor``, never going below
      ``min_scale``. The hysteresis counter is not restored by clean steps, only by growth, so
      after the first backoff every further overflow backs off again until the scale grows.
    * clean step: the growth counter rises by one; when it reaches ``growth_interval`` the scale is
      multiplied by ``growth_factor``, the growth counter restarts at 0 and the hysteresis counter
      is restored to ``hysteresis``.

    Args:
        initial_scale: starting scale (``--initial-loss-scale``, default 2**32).
        min_scale: floor of the scale (``--min-loss-scale``).
        growth_factor: factor applied on growth (> 1).
        backoff_factor: factor applied on backoff (in (0, 1)).
        growth_interval: clean steps needed before growing (``--loss-scale-window``).
        hysteresis: overflows tolerated before the first backoff (``--hysteresis``).
    """

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"min_scale must be in (0, initial_scale={initial_scale}], "
                             f"got {min_scale}")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32,
                                      device=self._scale.device)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32,
                                          device=self._scale.device)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32,
                                           device=self._scale.device)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state_dict)
        if missing:
            raise KeyError(f"grad scaler state is missing {sorted(missing)}; "
                           f"found keys {sorted(state_dict)}")
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32)
        self._scale = scale.reshape(1).to(self._scale.device).clone()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
