"""Layer norm and RMS norm over the last dimension, with float32 statistics.

References (the meaning every compiled body must match):

- layer norm: ``(x - mean) / sqrt(var + eps) * weight + bias`` with the biased variance;
- RMS norm: ``x / sqrt(mean(x^2) + eps) * weight``.

Statistics and normalisation run in float32 (float64 stays float64). The result has the input's
dtype, except that a float32 input with half-precision weights (``--fp32-residual-connection``)
gives the weights' dtype, as a mixed-dtype fused layer norm does.

The modules keep Megatron's names: :class:`FusedLayerNorm` (alias :data:`MixedFusedLayerNorm`)
and :class:`MixedFusedRMSNorm`. With sequence parallelism their parameters carry
``param.sequence_parallel = True``: each tensor-parallel rank sees a different slice of the
sequence, so the gradients of these replicated parameters must be all-reduced across the
tensor-parallel group (the gradient reduction does it for every parameter so marked).
"""

from typing import Optional

import torch

from megatron.core import device
from megatron.fused_kernels import get_kernel


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _output_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    if x.dtype == torch.float32 and weight.dtype in (torch.float16, torch.bfloat16):
        return weight.dtype
    return x.dtype


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         eps: float) -> torch.Tensor:
    """Layer norm over the last dimension with float32 (or better) statistics."""
    math = _math_dtype(x)
    xf = x.to(math)
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.to(math)
    if bias is not None:
        y = y + bias.to(math)
    return y.to(_output_dtype(x, weight))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dimension with float32 (or better) statistics."""
    math = _math_dtype(x)
    xf = x.to(math)
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(math)
    return y.to(_output_dtype(x, weight))


def fused_layer_norm(x, weight, bias, eps):
    """The fusable op (compiled when registered as ``layer_norm``)."""
    return get_kernel("layer_norm", layer_norm_reference)(x, weight, bias, eps)


def fused_rms_norm(x, weight, eps):
    """The fusable op (compiled when registered as ``rms_norm``)."""
    return get_kernel("rms_norm", rms_norm_reference)(x, weight, eps)


class FusedLayerNorm(torch.nn.Module):
    """Layer norm with ``weight`` (ones) and ``bias`` (zeros) over the last dimension.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: ``--norm-epsilon``.
        sequence_parallel: mark the parameters for a tensor-parallel gradient all-reduce.
        params_dtype: dtype of weight and bias.
        apply_layernorm_1p: ``--apply-layernorm-1p``: ``weight`` holds ``gamma - 1`` (zeros at
            start) and the norm scales by ``1 + weight``, so weight decay pulls gamma to 1, not 0.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, apply_layernorm_1p: bool = False):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.sequence_parallel = sequence_parallel
        self.apply_layernorm_1p = apply_layernorm_1p
        kw = dict(dtype=params_dtype, device=device.current_device())
        init = torch.zeros if apply_layernorm_1p else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, **kw))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size, **kw))
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.apply_layernorm_1p else self.weight
        return fused_layer_norm(x, weight, self.bias, self.eps)


MixedFusedLayerNorm = FusedLayerNorm


class MixedFusedRMSNorm(torch.nn.Module):
    """RMS norm with ``weight`` (ones) over the last dimension; same arguments as the layer norm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=params_dtype, device=device.current_device()))
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)
