"""Precision-aware AdamW (``--use-precision-aware-optimizer``): Adam's state in narrow dtypes.

Megatron-LM hands these flags to TransformerEngine's fused Adam; this is the same storage
contract in plain PyTorch:

- ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` (fp32 | bf16 | fp16 | fp8): the first and second
  moments are stored in that dtype. Each step reads them back to fp32, computes the whole AdamW
  update in fp32 (the operations of ``torch.optim.AdamW``), and rounds them on store.
- ``--main-params-dtype`` (fp32 | fp16): the master copy of the weights is held at that
  precision; before the first update and after each one it is rounded through fp16 and back.
  Its storage stays the fp32 main piece of the distributed optimizer, so checkpoints and resume
  see exactly the values the next step starts from.
- ``--main-grads-dtype`` (fp32 | bf16): the gradients the optimizer reads are bf16 values
  (rounded here; the data-parallel gradient buffer and its reduction keep their own dtype).

bf16 is a plain round-to-nearest cast. fp16 and fp8 are scaled per tensor as
TransformerEngine does, so a tensor of tiny values keeps its digits: fp16 with
``scale = amax / (fp16 max / 2)``, stored ``fp16(x * (1 / scale))``, read back
``fp16 * scale``; fp8 (E4M3, TransformerEngine's Float8 tensor for Megatron's ``fp8``) with
``scale = amax / 448``, stored ``e4m3(x * (1 / scale))`` saturated to +-448, read back
``e4m3 * (1 / (1 / scale))``, its scale-inverse. A tensor of zeros (or below 1e-38, where
``1 / scale`` overflows) is stored as zeros with scale 0 in both, where TransformerEngine's fp8
cast would multiply by infinity.

Checkpoints hold the moments unscaled in fp32 (Megatron's layout: TransformerEngine's
``state_dict`` unscales them too); bf16 moments come back bit for bit, fp16 ones get their
per-tensor scale recomputed from the saved values, as TransformerEngine does on load.

Megatron converts these flags to torch dtypes (``fp8`` to ``torch.uint8``); here they stay the
flag strings.
"""

from typing import Dict, Optional

import torch

from megatron.optimizer.torch_base import OptimizerBase

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.float8_e4m3fn}
STATE_NAMES = ("exp_avg", "exp_avg_sq")
# Half the largest fp16 value: TransformerEngine's headroom for fp16 optimizer state.
FP16_RANGE = torch.finfo(torch.float16).max / 2.0
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def precision_aware_conflict(use_precision_aware_optimizer: bool, optimizer: str,
                             use_distributed_optimizer: bool, main_grads_dtype: str,
                             main_params_dtype: str, exp_avg_dtype: str,
                             exp_avg_sq_dtype: str) -> Optional[str]:
    """One line naming the flags when these settings cannot run together, else None
    (Megatron-Core's ``OptimizerConfig`` rules)."""
    dtypes = (("--main-grads-dtype", main_grads_dtype), ("--main-params-dtype", main_params_dtype),
              ("--exp-avg-dtype", exp_avg_dtype), ("--exp-avg-sq-dtype", exp_avg_sq_dtype))
    if not use_precision_aware_optimizer:
        narrow = [f"{flag} {value}" for flag, value in dtypes if value != "fp32"]
        if narrow:
            return (f"{', '.join(narrow)} needs --use-precision-aware-optimizer (without it "
                    "every optimizer dtype is fp32)")
        return None
    if optimizer != "adam":
        return (f"--use-precision-aware-optimizer runs with --optimizer adam only, got "
                f"--optimizer {optimizer}")
    if not use_distributed_optimizer:
        return "--use-precision-aware-optimizer needs --use-distributed-optimizer (as in Megatron)"
    return None


def quantize(value: torch.Tensor, dtype: torch.dtype):
    """``(stored, scale)`` for fp32 ``value`` kept in ``dtype``; ``scale`` (``[1]``, what the
    stored values are multiplied by to read them) is None for fp32 and bf16."""
    if dtype == torch.float32:
        return value.clone(), None
    if dtype == torch.bfloat16:
        return value.to(torch.bfloat16), None
    amax = value.abs().max() if value.numel() else value.new_zeros(())
    limit = FP16_RANGE if dtype == torch.float16 else FP8_MAX
    scale = (amax.to(torch.float32) / limit).reshape(1)  # [1]
    rscale = scale.reciprocal()
    rscale = torch.where((scale > 0) & rscale.isfinite(), rscale, torch.zeros_like(scale))
    scaled = value * rscale
    if dtype == torch.float16:
        return scaled.to(torch.float16), scale
    scale_inv = torch.where(rscale > 0, rscale.reciprocal(), torch.zeros_like(rscale))
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale_inv


def dequantize(stored: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """The fp32 value of a stored state tensor (a new tensor)."""
    value = stored.to(torch.float32, copy=True)
    if scale is not None:
        value.mul_(scale)
    return value


class PrecisionAwareAdamW(OptimizerBase):
    """AdamW over fp32 main params whose moments (and master values, and gradients) are kept
    in narrower dtypes; see the module docstring.

    Args:
        params, lr, betas, eps, weight_decay: as in ``torch.optim.AdamW``.
        exp_avg_dtype, exp_avg_sq_dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"``.
        main_params_dtype: ``"fp32"`` or ``"fp16"``; main_grads_dtype: ``"fp32"`` or ``"bf16"``.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, exp_avg_dtype: str = "fp32",
                 exp_avg_sq_dtype: str = "fp32", main_params_dtype: str = "fp32",
                 main_grads_dtype: str = "fp32"):
        for flag, value, allowed in (("--exp-avg-dtype", exp_avg_dtype, DTYPES),
                                     ("--exp-avg-sq-dtype", exp_avg_sq_dtype, DTYPES),
                                     ("--main-params-dtype", main_params_dtype, ("fp32", "fp16")),
                                     ("--main-grads-dtype", main_grads_dtype, ("fp32", "bf16"))):
            if value not in allowed:
                raise ValueError(f"PrecisionAwareAdamW: {flag} must be one of "
                                 f"{', '.join(allowed)}, got {value!r}")
        self.state_dtypes = {"exp_avg": DTYPES[exp_avg_dtype],
                             "exp_avg_sq": DTYPES[exp_avg_sq_dtype]}
        self.main_params_dtype = DTYPES[main_params_dtype]
        self.main_grads_dtype = DTYPES[main_grads_dtype]
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    # -- state in storage form ---------------------------------------------------------------

    def unscaled_state(self, param: torch.Tensor, name: str) -> Optional[torch.Tensor]:
        """``exp_avg`` or ``exp_avg_sq`` of ``param`` in fp32 (a copy); None before its first
        step."""
        state = self.state.get(param, {})
        if name not in state:
            return None
        return dequantize(state[name], state.get(name + "_scale"))

    def set_unscaled_state(self, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Store fp32 ``value`` as ``param``'s ``name`` in its storage dtype (with a new scale
        for fp16 and fp8)."""
        stored, scale = quantize(value.to(param.device, torch.float32).reshape(param.shape),
                                 self.state_dtypes[name])
        state = self.state[param]
        state[name] = stored
        if scale is None:
            state.pop(name + "_scale", None)
        else:
            state[name + "_scale"] = scale

    def load_state_dict(self, state_dict: Dict) -> None:
        """torch's loading (which casts every state tensor to fp32), then every moment put back
        in its storage dtype: exactly as saved when that dtype is this run's, else re-stored
        from its fp32 value."""
        super().load_state_dict(state_dict)
        for param, state in self.state.items():
            for name in STATE_NAMES:
                if name not in state:
                    continue
                dtype, scale = self.state_dtypes[name], state.get(name + "_scale")
                if scale is not None and state[name].dtype != dtype:
                    state[name] = state[name].to(dtype)  # values of that dtype: exact
                elif scale is not None or state[name].dtype != dtype:
                    self.set_unscaled_state(param, name, dequantize(state[name], scale))

    # -- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: Dict) -> None:
        """torch.optim.AdamW's single-tensor arithmetic in fp32 on the unscaled state."""
        if param.dtype != torch.float32:
            raise TypeError(f"PrecisionAwareAdamW steps fp32 main params, got {param.dtype}")
        state = self.state[param]
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            for name in STATE_NAMES:
                self.set_unscaled_state(param, name, torch.zeros_like(param))
            self._round_master(param)  # the master starts as its fp16 copy, as in TE
        state["step"] += 1
        step = float(state["step"])
        grad = param.grad.to(self.main_grads_dtype).to(torch.float32)
        exp_avg = self.unscaled_state(param, "exp_avg")
        exp_avg_sq = self.unscaled_state(param, "exp_avg_sq")
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        param.mul_(1.0 - lr * group["weight_decay"])
        exp_avg.lerp_(grad, 1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        step_size = lr / (1.0 - beta1 ** step)
        denom = (exp_avg_sq.sqrt() / (1.0 - beta2 ** step) ** 0.5).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        self.set_unscaled_state(param, "exp_avg", exp_avg)
        self.set_unscaled_state(param, "exp_avg_sq", exp_avg_sq)
        self._round_master(param)

    def _round_master(self, param: torch.Tensor) -> None:
        """Hold ``param`` at ``--main-params-dtype`` precision (fp16 scaled per tensor)."""
        if self.main_params_dtype != torch.float32:
            param.copy_(dequantize(*quantize(param, self.main_params_dtype)))
