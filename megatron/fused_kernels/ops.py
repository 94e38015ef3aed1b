"""The compiled fused ops (``torch.ops.megatron_fused``) with autograd, and their fallbacks.

Each public function here has the signature and meaning of a pure-torch reference in this
package (softmax.py, layer_norm.py, bias_gelu.py, bias_dropout_add.py) or, for the optimizer and
the loss, of ``torch.optim.AdamW`` and ``megatron.core.tensor_parallel.vocab_parallel_cross_
entropy``. It runs the compiled body when the extension is loaded (see :mod:`.loader`), the
tensors sit on a device it has bodies for, their dtypes are float32 / float16 / bfloat16 and the
body has passed its self-check for that device type and dtype; otherwise it runs the reference,
with the same results up to float32 rounding.

Self-check (:mod:`.selfcheck`): the first use of an op on a device type with a dtype first runs
the compiled body on small inputs against the reference, forward and backward; a body that
disagrees or raises is replaced by the reference for the rest of the run there, with one
warning. ``MEGATRON_KERNEL_SELFCHECK=0`` skips the check (benchmarks). Tests can reach every
compiled call through :data:`COMPILED_CALL_HOOKS`.

:func:`install` registers the compiled ops under the names the model's fusable calls look up
(``megatron.fused_kernels.register_kernel``), so ``FusedLayerNorm``, ``FusedScaleMaskSoftmax``
and friends use them without any change to model code.

Differences from the references worth knowing:

- training bias-dropout-add draws its mask from a Philox counter RNG seeded from the device's
  torch generator, not from ``torch.bernoulli``: the kept fraction and scaling are the same,
  the exact mask differs from ``F.dropout``'s for the same seed (it is the same on CPU and GPU,
  for any thread count, and deterministic for a given torch RNG state);
- every op computes in float32 and rounds once, where the references round half-precision
  intermediates (``x + bias`` etc.) to the input dtype.
"""

from typing import Callable, Dict, Optional, Sequence

import torch

from megatron.fused_kernels import loader, selfcheck
from megatron.fused_kernels.bias_dropout_add import (
    bias_dropout_add_inference_reference,
    bias_dropout_add_train_reference,
)
from megatron.fused_kernels.bias_gelu import bias_gelu_reference
from megatron.fused_kernels.layer_norm import layer_norm_reference, rms_norm_reference
from megatron.fused_kernels.softmax import (
    scaled_masked_softmax_reference,
    scaled_upper_triang_masked_softmax_reference,
)

_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernels_available(device_type: str = "cpu") -> bool:
    """Whether compiled bodies are loaded for ``device_type`` ("cpu" or "cuda")."""
    available = loader.has_device_kernels(device_type)
    if available:
        _register_fake_impls()
    return available


# Tests only: kernel name (e.g. "bias_gelu_fwd") -> fn(result) -> result, applied to every
# call of that compiled op, to count calls or to break a body on purpose. Empty otherwise.
COMPILED_CALL_HOOKS: Dict[str, Callable] = {}


class _HookedOps:
    """``torch.ops.megatron_fused`` with :data:`COMPILED_CALL_HOOKS` applied to the results."""

    def __init__(self, namespace):
        self._namespace = namespace

    def __getattr__(self, name):
        op, hook = getattr(self._namespace, name), COMPILED_CALL_HOOKS.get(name)
        return op if hook is None else (lambda *args: hook(op(*args)))


def _ops():
    namespace = loader.load()
    if COMPILED_CALL_HOOKS and namespace is not None:
        return _HookedOps(namespace)
    return namespace


def _verified(op: str, tensor: torch.Tensor, compiled: Callable, reference: Callable) -> bool:
    """The compiled body of ``op`` passed its self-check on ``tensor``'s device and dtype."""
    return selfcheck.passes(op, tensor.device.type, tensor.dtype, compiled, reference)


_FAKES_REGISTERED = []


def _register_fake_impls() -> None:
    """Shape-only bodies of every op, so ``torch.compile`` (fake tensors) can trace them."""
    if _FAKES_REGISTERED:
        return
    _FAKES_REGISTERED.append(True)
    f32 = torch.float32

    def fake(name):
        return torch.library.register_fake(f"megatron_fused::{name}")

    def rows(x):
        return x.numel() // max(1, x.shape[-1])

    def like(x, *_):
        return torch.empty_like(x)

    for name in ("scaled_masked_softmax_fwd", "scaled_masked_softmax_bwd",
                 "scaled_upper_triang_masked_softmax_fwd", "bias_gelu_fwd",
                 "scaled_upper_triang_masked_softmax_bwd"):
        fake(name)(like)

    @fake("layer_norm_fwd")
    def _(input, weight, bias, eps, rms):
        half_w = weight.dtype in (torch.float16, torch.bfloat16)
        out = weight.dtype if input.dtype == f32 and half_w else input.dtype
        return (input.new_empty(input.shape, dtype=out), input.new_empty(rows(input), dtype=f32),
                input.new_empty(rows(input), dtype=f32))

    @fake("layer_norm_bwd")
    def _(grad_output, input, weight, mean, rstd, rms):
        n = input.shape[-1]
        return (torch.empty_like(input), input.new_empty(n, dtype=f32),
                input.new_empty(0 if rms else n, dtype=f32))

    @fake("bias_gelu_bwd")
    def _(grad_output, input, bias):
        return torch.empty_like(input), input.new_empty(0 if bias is None else bias.numel(),
                                                        dtype=f32)

    @fake("bias_dropout_add_fwd")
    def _(input, bias, residual, prob, training, generator=None):
        return torch.empty_like(input), torch.empty(2, dtype=torch.int64)

    @fake("bias_dropout_add_bwd")
    def _(grad_output, rng_state, prob, training, bias_numel):
        return torch.empty_like(grad_output), grad_output.new_empty(bias_numel, dtype=f32)

    @fake("cross_entropy_fwd")
    def _(logits, target, vocab_start):
        return logits.new_empty((5, target.numel()), dtype=f32)

    @fake("cross_entropy_bwd")
    def _(logits, target, lse, grad_loss, vocab_start, vocab_size, smoothing, grad_input):
        return None

    @fake("fused_adamw_")
    def _(*args):
        return None


def _usable(*tensors: Optional[torch.Tensor]) -> bool:
    """All given tensors share a device with compiled bodies and have a supported dtype."""
    present = [t for t in tensors if t is not None]
    device = present[0].device
    return (all(t.device == device and t.dtype in _FLOAT_TYPES for t in present)
            and kernels_available(device.type))


# ---- softmax --------------------------------------------------------------------------------


class ScaledMaskedSoftmax(torch.autograd.Function):
    """softmax(input * scale, masked positions -> -10000); mask bool, True = masked."""

    @staticmethod
    def forward(ctx, input, mask, scale):
        output = _ops().scaled_masked_softmax_fwd(input, mask, scale)
        ctx.scale = scale
        ctx.save_for_backward(output, mask)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        output, mask = ctx.saved_tensors
        grad = _ops().scaled_masked_softmax_bwd(grad_output.to(output.dtype), output, mask,
                                               ctx.scale)
        return grad, None, None


class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Causal softmax of ``input * scale`` over ``[attn_batches, sq, sk]``."""

    @staticmethod
    def forward(ctx, input, scale):
        output = _ops().scaled_upper_triang_masked_softmax_fwd(input, scale)
        ctx.scale = scale
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        grad = _ops().scaled_upper_triang_masked_softmax_bwd(grad_output.to(output.dtype),
                                                            output, ctx.scale)
        return grad, None


def scaled_masked_softmax(input: torch.Tensor, mask: Optional[torch.Tensor],
                          scale: float) -> torch.Tensor:
    """Fused :func:`~megatron.fused_kernels.softmax.scaled_masked_softmax_reference`."""
    if (not _usable(input) or (mask is not None and mask.dtype != torch.bool) or input.dim() < 1
            or not _verified("scaled_masked_softmax", input, ScaledMaskedSoftmax.apply,
                             scaled_masked_softmax_reference)):
        return scaled_masked_softmax_reference(input, mask, scale)
    return ScaledMaskedSoftmax.apply(input, mask, float(scale))


def scaled_upper_triang_masked_softmax(input: torch.Tensor, scale: float) -> torch.Tensor:
    """Fused causal softmax (``softmax.scaled_upper_triang_masked_softmax_reference``)."""
    if (not _usable(input) or input.dim() < 2
            or not _verified("scaled_upper_triang_masked_softmax", input,
                             ScaledUpperTriangMaskedSoftmax.apply,
                             scaled_upper_triang_masked_softmax_reference)):
        return scaled_upper_triang_masked_softmax_reference(input, scale)
    return ScaledUpperTriangMaskedSoftmax.apply(input, float(scale))


# ---- layer norm / RMS norm ------------------------------------------------------------------


class FusedNormFunction(torch.autograd.Function):
    """Layer norm (``rms=False``) or RMS norm over the last dim with float32 statistics."""

    @staticmethod
    def forward(ctx, input, weight, bias, eps, rms):
        output, mean, rstd = _ops().layer_norm_fwd(input, weight, bias, eps, rms)
        ctx.rms = rms
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(input, weight, mean, rstd)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, rstd = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = _ops().layer_norm_bwd(
            grad_output, input, weight, mean, rstd, ctx.rms)
        grad_bias = None if ctx.bias_dtype is None else grad_bias.to(ctx.bias_dtype)
        return grad_input, grad_weight.to(weight.dtype), grad_bias, None, None


def _norm_usable(x, weight, bias) -> bool:
    return (_usable(x, weight, bias) and weight.dim() == 1 and x.dim() >= 1
            and x.shape[-1] == weight.shape[0] and (bias is None or bias.shape == weight.shape))


def _layer_norm_compiled(x, weight, bias, eps):
    return FusedNormFunction.apply(x, weight, bias, float(eps), False)


def _rms_norm_compiled(x, weight, eps):
    return FusedNormFunction.apply(x, weight, None, float(eps), True)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               eps: float) -> torch.Tensor:
    """Fused :func:`~megatron.fused_kernels.layer_norm.layer_norm_reference`."""
    if not _norm_usable(x, weight, bias) or not _verified(
            "layer_norm", x, _layer_norm_compiled, layer_norm_reference):
        return layer_norm_reference(x, weight, bias, eps)
    return FusedNormFunction.apply(x, weight, bias, float(eps), False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused :func:`~megatron.fused_kernels.layer_norm.rms_norm_reference`."""
    if not _norm_usable(x, weight, None) or not _verified(
            "rms_norm", x, _rms_norm_compiled, rms_norm_reference):
        return rms_norm_reference(x, weight, eps)
    return FusedNormFunction.apply(x, weight, None, float(eps), True)


# ---- bias + GeLU ----------------------------------------------------------------------------


class BiasGeLUFunction(torch.autograd.Function):
    """``gelu_tanh(input + bias)``; ``bias`` ([h], the input's last dim) may be None."""

    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return _ops().bias_gelu_fwd(input, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        grad_input, grad_bias = _ops().bias_gelu_bwd(grad_output.to(input.dtype), input, bias)
        return grad_input, None if bias is None else grad_bias.to(bias.dtype)


def bias_gelu(input: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Fused :func:`~megatron.fused_kernels.bias_gelu.bias_gelu_reference`."""
    ok = _usable(input, bias) and input.dim() >= 1 and (
        bias is None or (bias.dim() == 1 and bias.shape[0] == input.shape[-1]
                         and bias.dtype == input.dtype))
    if not ok or not _verified("bias_gelu", input, BiasGeLUFunction.apply, bias_gelu_reference):
        return bias_gelu_reference(input, bias)
    return BiasGeLUFunction.apply(input, bias)


# ---- bias + dropout + residual add ----------------------------------------------------------


class BiasDropoutAddFunction(torch.autograd.Function):
    """``residual + dropout(x + bias, prob)`` (dropout only when ``training``)."""

    @staticmethod
    def forward(ctx, x, bias, residual, prob, training):
        output, rng_state = _ops().bias_dropout_add_fwd(x, bias, residual, prob, training)
        ctx.prob, ctx.training = prob, training
        ctx.bias_numel = 0 if bias is None else bias.numel()
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(rng_state)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (rng_state,) = ctx.saved_tensors
        grad_x, grad_bias = _ops().bias_dropout_add_bwd(grad_output, rng_state, ctx.prob,
                                                       ctx.training, ctx.bias_numel)
        grad_bias = None if ctx.bias_dtype is None else grad_bias.to(ctx.bias_dtype)
        return grad_x, grad_bias, grad_output, None, None


def _bda_usable(x, bias, residual) -> bool:
    """Shapes and dtypes the kernel takes, and its self-check (both modes) passed."""
    return (_usable(x, bias, residual) and x.dim() >= 1 and residual.shape == x.shape
            and residual.dtype == x.dtype
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == x.shape[-1]
                                  and bias.dtype == x.dtype))
            and _verified("bias_dropout_add", x, BiasDropoutAddFunction.apply,
                          bias_dropout_add_inference_reference))


def bias_dropout_add_train(x: torch.Tensor, bias: Optional[torch.Tensor],
                           residual: torch.Tensor, prob: float) -> torch.Tensor:
    """Fused training bias-dropout-add (mask from the Philox RNG, see the module docstring)."""
    if not _bda_usable(x, bias, residual):
        return bias_dropout_add_train_reference(x, bias, residual, prob)
    return BiasDropoutAddFunction.apply(x, bias, residual, float(prob), True)


def bias_dropout_add_inference(x: torch.Tensor, bias: Optional[torch.Tensor],
                               residual: torch.Tensor, prob: float) -> torch.Tensor:
    """Fused inference bias-dropout-add: ``residual + x + bias``."""
    if not _bda_usable(x, bias, residual):
        return bias_dropout_add_inference_reference(x, bias, residual, prob)
    return BiasDropoutAddFunction.apply(x, bias, residual, float(prob), False)


# ---- multi-tensor AdamW ---------------------------------------------------------------------


def _adamw_usable(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params) -> bool:
    if not params:
        return False
    device = params[0].device
    if not kernels_available(device.type):
        return False
    states = list(params) + list(exp_avgs) + list(exp_avg_sqs) + list(max_exp_avg_sqs or [])
    if any(t.device != device or t.dtype != torch.float32 or not t.is_contiguous()
           for t in states):
        return False
    extra = list(grads) + list(model_params or [])
    return (all(t.device == device and t.dtype in _FLOAT_TYPES and not t.is_sparse
                for t in extra) and all(t.is_contiguous() for t in (model_params or []))
            and _verified("multi_tensor_adamw", grads[0], _adamw_compiled, _adamw_reference))


def _adamw_compiled(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, *,
                    lr, beta1, beta2, eps, weight_decay, step, amsgrad, maximize) -> None:
    """The compiled step, with :func:`_adamw_reference`'s signature."""
    _ops().fused_adamw_(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs),
                        list(max_exp_avg_sqs), list(model_params), float(lr), float(beta1),
                        float(beta2), float(eps), float(weight_decay), float(step),
                        bool(amsgrad), bool(maximize))


def multi_tensor_adamw(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                       exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                       *, lr: float, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: float, amsgrad: bool = False,
                       maximize: bool = False,
                       max_exp_avg_sqs: Optional[Sequence[torch.Tensor]] = None,
                       model_params: Optional[Sequence[torch.Tensor]] = None) -> None:
    """One AdamW step (``step`` = the new step count, >= 1) over many tensors, in place.

    Same arithmetic as ``torch.optim.AdamW``; when ``model_params`` is given, each updated
    float32 param is also written (rounded) into its model param, e.g. a bfloat16 copy.
    Falls back to torch's functional AdamW when the kernel cannot run.
    """
    max_exp_avg_sqs = list(max_exp_avg_sqs or [])
    model_params = list(model_params or [])
    step_fn = (_adamw_compiled if _adamw_usable(params, grads, exp_avgs, exp_avg_sqs,
                                                max_exp_avg_sqs, model_params)
               else _adamw_reference)
    step_fn(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
            amsgrad=amsgrad, maximize=maximize)


def _adamw_reference(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, model_params, *,
                     lr, beta1, beta2, eps, weight_decay, step, amsgrad, maximize) -> None:
    """torch's own single-tensor AdamW, then the model-param copy."""
    from torch.optim.adamw import adamw

    steps = [torch.tensor(float(step) - 1.0) for _ in params]  # torch adds one
    with torch.no_grad():
        adamw(list(params), [g.to(p.dtype) for g, p in zip(grads, params)], list(exp_avgs),
              list(exp_avg_sqs), list(max_exp_avg_sqs), steps, foreach=False, amsgrad=amsgrad,
              beta1=beta1, beta2=beta2, lr=lr, weight_decay=weight_decay, eps=eps,
              maximize=maximize)
        for model, main in zip(model_params, params):
            if model.data_ptr() != main.data_ptr():
                model.copy_(main.view_as(model))


# ---- cross entropy --------------------------------------------------------------------------


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from (vocab-split) logits without forming their softmax."""

    @staticmethod
    def forward(ctx, logits, target, label_smoothing, group, inplace_backward):
        from megatron.core.collectives import all_reduce, get_group_rank, get_group_size

        local_vocab = logits.shape[-1]
        world = get_group_size(group)
        vocab_start = get_group_rank(group) * local_vocab
        x = logits.reshape(-1, local_vocab).contiguous()                   # [N, V/tp]
        t = target.reshape(-1).long().contiguous()                          # [N]
        stats = _ops().cross_entropy_fwd(x, t, vocab_start)                 # [5, N]
        local_max, sum_exp, target_logit, sum_logits, owned = stats.unbind(0)
        global_max = local_max
        if world > 1:
            global_max = local_max.clone()
            all_reduce(global_max, group, op=torch.distributed.ReduceOp.MAX)
            partial = torch.stack([sum_exp * torch.exp(local_max - global_max), target_logit,
                                   sum_logits, owned])
            all_reduce(partial, group)
            sum_exp, target_logit, sum_logits, owned = partial.unbind(0)
        lse = global_max + torch.log(sum_exp)                               # [N]
        # A target no rank owns counts as a shifted logit of 0, as in the reference.
        loss = lse - (target_logit + (1.0 - owned) * global_max)
        vocab_size = local_vocab * world
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_probs = sum_logits / vocab_size - lse
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
        ctx.meta = (vocab_start, vocab_size, smoothing, inplace_backward, logits.shape)
        ctx.save_for_backward(x, t, lse)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        x, t, lse = ctx.saved_tensors
        vocab_start, vocab_size, smoothing, inplace, shape = ctx.meta
        grad_input = x if inplace else torch.empty_like(x)
        _ops().cross_entropy_bwd(x, t, lse, grad_output.reshape(-1).float().contiguous(),
                                 vocab_start, vocab_size, smoothing, grad_input)
        return grad_input.view(shape), None, None, None, None


def _cross_entropy_compiled(logits, target, group, label_smoothing):
    """The compiled path with the reference's signature (for the self-check)."""
    return ChunkedCrossEntropy.apply(logits, target, float(label_smoothing), group, False)


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 group=None, label_smoothing: float = 0.0, *,
                                 inplace_backward: bool = False) -> torch.Tensor:
    """Fused drop-in for :func:`megatron.core.tensor_parallel.cross_entropy.
    vocab_parallel_cross_entropy` (same arguments and meaning; ``group=None`` means the logits
    hold the whole vocabulary). Returns the float32 loss per token, shaped like ``target``.

    Memory: forward keeps five float32 numbers per token besides the logits; backward allocates
    one gradient of the logits' shape, or none with ``inplace_backward=True``, which writes the
    gradient into the logits' storage -- only for logits nothing else reads after the backward
    (e.g. the output layer's result, consumed only by the loss).
    """
    from megatron.core.tensor_parallel import cross_entropy as reference

    logits = vocab_parallel_logits
    ok = (_usable(logits) and logits.dim() >= 1
          and tuple(target.shape) == tuple(logits.shape[:-1])
          and target.dtype in (torch.int64, torch.int32) and 0.0 <= label_smoothing < 1.0)
    if not ok or not _verified("vocab_parallel_cross_entropy", logits, _cross_entropy_compiled,
                               reference.vocab_parallel_cross_entropy):
        return reference.vocab_parallel_cross_entropy(logits, target, group, label_smoothing)
    return ChunkedCrossEntropy.apply(logits, target, float(label_smoothing), group,
                                     bool(inplace_backward))


def compiled_paths() -> Dict[str, tuple]:
    """Op name -> (compiled path, reference), the pairs :mod:`.selfcheck` compares."""
    from megatron.core.tensor_parallel import cross_entropy

    return {
        "scaled_masked_softmax": (ScaledMaskedSoftmax.apply, scaled_masked_softmax_reference),
        "scaled_upper_triang_masked_softmax": (ScaledUpperTriangMaskedSoftmax.apply,
                                               scaled_upper_triang_masked_softmax_reference),
        "layer_norm": (_layer_norm_compiled, layer_norm_reference),
        "rms_norm": (_rms_norm_compiled, rms_norm_reference),
        "bias_gelu": (BiasGeLUFunction.apply, bias_gelu_reference),
        "bias_dropout_add": (BiasDropoutAddFunction.apply, bias_dropout_add_inference_reference),
        "vocab_parallel_cross_entropy": (_cross_entropy_compiled,
                                         cross_entropy.vocab_parallel_cross_entropy),
        "multi_tensor_adamw": (_adamw_compiled, _adamw_reference),
    }


# ---- registration with the model's fusable calls --------------------------------------------

FUSABLE_OPS = {
    "scaled_masked_softmax": scaled_masked_softmax,
    "scaled_upper_triang_masked_softmax": scaled_upper_triang_masked_softmax,
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
    "bias_gelu": bias_gelu,
    "bias_dropout_add_train": bias_dropout_add_train,
    "bias_dropout_add_inference": bias_dropout_add_inference,
}


def install() -> bool:
    """Route the model's fusable ops to the functions above; returns whether kernels loaded.

    Safe to call when the extension is missing: the functions fall back per call, and
    :func:`megatron.fused_kernels.loader.load` has already warned once.
    """
    from megatron import fused_kernels

    loaded = loader.load() is not None
    if loaded:
        for name, fn in FUSABLE_OPS.items():
            fused_kernels.register_kernel(name, fn)
    return loaded


def uninstall() -> None:
    """Undo :func:`install`: the model's fusable calls use the references again."""
    from megatron import fused_kernels

    for name in FUSABLE_OPS:
        fused_kernels.unregister_kernel(name)
