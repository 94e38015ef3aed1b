"""Scaled (masked) softmax over attention scores, and the module attention calls.

The ops take scores ``x`` of shape ``[b, np, sq, sk]`` (or ``[b * np, sq, sk]`` for the causal
one), multiply by ``scale``, set masked positions to ``-10000.0`` (the value Megatron's kernels
use, so a fully masked row becomes a uniform distribution rather than NaN) and take the softmax
over the last dimension. Math is done in float32 at least (float64 stays float64) and the result is
cast back to the input's dtype, which is what the compiled kernels do for fp16/bf16 inputs.

:class:`FusedScaleMaskSoftmax` keeps Megatron's constructor; with ``scaled_masked_softmax_fusion``
it calls the fusable ops (compiled body when registered, else the references below), without it
the plain torch composition (``mask_func`` + ``torch.softmax``). Both give the same numbers.

Sliding windows (``--window-size``) reach these ops as an explicit banded mask
(:func:`sliding_window_mask`), so the fused masked kernel serves them. A softmax offset
(``--softmax-type off-by-one|learnable``: one extra logit per head in the denominator) has no
compiled body: :func:`softmax_with_offset_reference` computes it on either path.
"""

from typing import Callable, Optional

import torch

from megatron.fused_kernels import get_kernel
from megatron.model.enums import AttnMaskType

MASKED_VALUE = -10000.0


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def causal_mask(sq: int, sk: int, device=None) -> torch.Tensor:
    """Bool ``[sq, sk]`` mask, True above the diagonal (a query may not see later keys)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1 + sk - sq)


def sliding_window_mask(sq: int, sk: int, window, device=None) -> torch.Tensor:
    """Bool ``[sq, sk]`` mask, True outside the window (``--window-size left,right``).

    Query ``i`` sits at position ``i + sk - sq`` (the last ``sq`` of ``sk`` positions, as with a
    key/value cache) and sees key ``j`` when ``pos - left <= j <= pos + right``; -1 lifts the
    limit on that side, so ``(-1, 0)`` is the causal mask.
    """
    left, right = window
    pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    key = torch.arange(sk, device=device)[None, :]
    masked = torch.zeros(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        masked |= key < pos - left
    if right >= 0:
        masked |= key > pos + right
    return masked


def softmax_with_offset_reference(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                                  offset: torch.Tensor) -> torch.Tensor:
    """``exp(s_j) / (exp(o_h) + sum_k exp(s_k))`` with ``s = x * scale`` masked to -10000 and
    ``o_h`` the offset of head ``h``: a softmax over the keys plus one extra logit per head whose
    probability is dropped (attention sinks). Math in float32 or better; differentiable in
    ``offset``.

    Args:
        x: scores ``[b, np, sq, sk]``.
        mask: bool broadcastable to ``x``, True = masked, or None.
        scale: multiplies the scores before masking.
        offset: ``[np]``, the extra logit of each head (zeros for off-by-one).
    """
    dtype = _math_dtype(x)
    y = x.to(dtype) * scale
    if mask is not None:
        y = y.masked_fill(mask, MASKED_VALUE)
    b, np_, sq, _ = y.shape
    sink = offset.to(dtype).view(1, np_, 1, 1).expand(b, np_, sq, 1)
    probs = torch.softmax(torch.cat([y, sink], dim=-1), dim=-1)       # [b, np, sq, sk + 1]
    return probs[..., :-1].to(x.dtype)


def attention_mask_func(attention_scores: torch.Tensor,
                        attention_mask: torch.Tensor) -> torch.Tensor:
    """Megatron's masking: positions where the mask is True get -10000."""
    return attention_scores.masked_fill(attention_mask, MASKED_VALUE)


def scaled_masked_softmax_reference(x: torch.Tensor, mask: Optional[torch.Tensor],
                                    scale: float) -> torch.Tensor:
    """softmax(x * scale with masked positions set to -10000), math in float32 or better.

    Args:
        x: scores ``[b, np, sq, sk]``.
        mask: bool, broadcastable to ``x`` (typically ``[b or 1, 1, sq, sk]``); True = masked.
            None means no masking.
        scale: multiplies the scores before masking.
    """
    y = x.to(_math_dtype(x)) * scale
    if mask is not None:
        y = y.masked_fill(mask, MASKED_VALUE)
    return torch.softmax(y, dim=-1).to(x.dtype)


def scaled_upper_triang_masked_softmax_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of ``x * scale`` over ``[attn_batches, sq, sk]``, math in fp32 or better."""
    mask = causal_mask(x.shape[-2], x.shape[-1], device=x.device)
    return scaled_masked_softmax_reference(x, mask, scale)


def scaled_masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor],
                          scale: float) -> torch.Tensor:
    """The fusable op (compiled when registered as ``scaled_masked_softmax``)."""
    return get_kernel("scaled_masked_softmax", scaled_masked_softmax_reference)(x, mask, scale)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The fusable op (compiled when registered as ``scaled_upper_triang_masked_softmax``)."""
    return get_kernel("scaled_upper_triang_masked_softmax",
                      scaled_upper_triang_masked_softmax_reference)(x, scale)


class FusedScaleMaskSoftmax(torch.nn.Module):
    """Scale, mask and softmax attention scores, fused or as plain torch ops.

    Args:
        input_in_fp16: scores arrive in float16.
        input_in_bf16: scores arrive in bfloat16.
        attn_mask_type: :class:`AttnMaskType`; with ``causal`` a missing mask means causal.
        scaled_masked_softmax_fusion: use the fusable ops (``--no-masked-softmax-fusion`` turns
            this off).
        mask_func: the plain-torch masking function (``attention_mask_func``).
        softmax_in_fp32: on the plain path, compute half-precision softmax in float32
            (``--attention-softmax-in-fp32``); the fused path always does.
        scale: multiplies the scores first (query-key layer scaling); needs ``softmax_in_fp32``.
    """

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, attn_mask_type: AttnMaskType,
                 scaled_masked_softmax_fusion: bool, mask_func: Callable,
                 softmax_in_fp32: bool, scale: Optional[float]):
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise ValueError("scores cannot be both fp16 and bf16")
        if scale is not None and not softmax_in_fp32:
            raise ValueError("a scaled softmax (--apply-query-key-layer-scaling) needs "
                             "softmax in fp32 (--attention-softmax-in-fp32)")
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor],
                softmax_offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Probabilities ``[b, np, sq, sk]`` from scores ``[b, np, sq, sk]``.

        ``mask`` is bool (True = masked) broadcastable to the scores, or None: causal when the
        mask type is causal, no masking when it is padding. ``softmax_offset`` ``[np]`` adds one
        logit per head to the denominator; it has no fused kernel, so both paths then compute
        :func:`softmax_with_offset_reference` (in fp32 at least).
        """
        if input.dim() != 4:
            raise ValueError(f"attention scores must be [b, np, sq, sk], got {tuple(input.shape)}")
        if softmax_offset is not None:
            if mask is None and self.attn_mask_type == AttnMaskType.causal:
                mask = causal_mask(input.shape[-2], input.shape[-1], device=input.device)
            scale = 1.0 if self.scale is None else self.scale
            return softmax_with_offset_reference(input, mask, scale, softmax_offset)
        if self.scaled_masked_softmax_fusion:
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask)

    def forward_fused_softmax(self, input: torch.Tensor,
                              mask: Optional[torch.Tensor]) -> torch.Tensor:
        scale = 1.0 if self.scale is None else self.scale
        if mask is None and self.attn_mask_type == AttnMaskType.causal:
            b, np_, sq, sk = input.shape
            probs = scaled_upper_triang_masked_softmax(input.reshape(b * np_, sq, sk), scale)
            return probs.view(b, np_, sq, sk)
        return scaled_masked_softmax(input, mask, scale)

    def forward_torch_softmax(self, input: torch.Tensor,
                              mask: Optional[torch.Tensor]) -> torch.Tensor:
        orig_dtype = input.dtype
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        if mask is None and self.attn_mask_type == AttnMaskType.causal:
            mask = causal_mask(input.shape[-2], input.shape[-1], device=input.device)
        if mask is not None:
            input = self.mask_func(input, mask)
        probs = torch.nn.Softmax(dim=-1)(input)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.to(orig_dtype)
        return probs
