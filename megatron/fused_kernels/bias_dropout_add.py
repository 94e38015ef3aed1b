"""Bias + dropout + residual add: ``residual + dropout(x + bias, p)``.

Used after attention's ``dense`` and the MLP's ``dense_4h_to_h`` (both skip their bias so it can
be fused here). Megatron picks a training or an inference variant (dropout fixed on or off) for the
fused path, and a plain function taking ``training`` for the ``--no-bias-dropout-fusion`` path;
all compute the same numbers from the same RNG state.
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.fused_kernels import get_kernel


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                     prob: float, training: bool) -> torch.Tensor:
    """``residual + dropout(x + bias)``; ``bias`` may be None (``--disable-bias-linear``)."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=prob, training=training)


def bias_dropout_add_train_reference(x, bias, residual, prob):
    return bias_dropout_add(x, bias, residual, prob, True)


def bias_dropout_add_inference_reference(x, bias, residual, prob):
    return bias_dropout_add(x, bias, residual, prob, False)


def bias_dropout_add_fused_train(x: torch.Tensor, bias: Optional[torch.Tensor],
                                 residual: torch.Tensor, prob: float) -> torch.Tensor:
    """The fusable training op (compiled when registered as ``bias_dropout_add_train``)."""
    fn = get_kernel("bias_dropout_add_train", bias_dropout_add_train_reference)
    return fn(x, bias, residual, prob)


def bias_dropout_add_fused_inference(x: torch.Tensor, bias: Optional[torch.Tensor],
                                     residual: torch.Tensor, prob: float) -> torch.Tensor:
    """The fusable inference op (compiled when registered as ``bias_dropout_add_inference``)."""
    fn = get_kernel("bias_dropout_add_inference", bias_dropout_add_inference_reference)
    return fn(x, bias, residual, prob)


def get_bias_dropout_add(training: bool) -> Callable:
    """The unfused function with ``training`` bound, taking ``(x, bias, residual, prob)``."""
    def _bias_dropout_add(x, bias, residual, prob):
        return bias_dropout_add(x, bias, residual, prob, training)
    return _bias_dropout_add


def get_bias_dropout_add_func(fusion: bool, training: bool) -> Callable:
    """``(x, bias, residual, prob) -> out``: fused variant when ``fusion`` (``--bias-dropout-
    fusion``), else the plain one."""
    if not fusion:
        return get_bias_dropout_add(training)
    return bias_dropout_add_fused_train if training else bias_dropout_add_fused_inference
