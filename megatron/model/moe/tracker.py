"""The auxiliary losses of mixture-of-experts layers: how they reach the gradients, and the
values logged under Megatron's names (``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss``, ``z_loss``).

An auxiliary loss is not returned by the model: each router attaches it to one of its own
activations with :func:`attach_aux_loss`, an identity whose backward also starts the loss's
backward. The training loss therefore needs no extra terms, and pipeline stages need not pass
losses along. The gradient the loss starts with is ``backward_scale`` of the tracker (1 by
default); the training loop sets it to the factor its main loss is scaled by (e.g.
``1 / num_microbatches``, times the fp16 loss scale), as the main loss's gradient is.

One :class:`MoELossTracker` is shared by the MoE layers of a model chunk and passed to each one
explicitly; the layers record their values per global layer number, summed over the
micro-batches of an iteration.
"""

from typing import Dict, Optional

import torch

from megatron.core.collectives import all_reduce

LOSS_NAMES = ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss",
              "z_loss")


class MoELossTracker:
    """Per-layer sums of the logged auxiliary losses, and the scale of their gradients.

    Args:
        num_layers: layers of the whole model (global layer numbers run 1 .. num_layers).

    ``values[name]`` is ``[num_layers]``: the sum over recorded micro-batches of the value each
    layer logged (before its coefficient); ``recorded[name]`` marks the layers that logged it.
    With pipeline parallelism each stage fills its own layers; :meth:`all_reduce` over the
    pipeline group gathers them before :meth:`report`.
    """

    def __init__(self, num_layers: int, num_decoder_layers: Optional[int] = None):
        if num_layers < 1:
            raise ValueError(f"MoELossTracker needs num_layers >= 1, got {num_layers}")
        self.num_layers = num_layers
        # Layers past the decoder's (multi-token prediction) are logged, and summed into the
        # average, but Megatron divides that sum by the decoder's MoE layers only.
        self.num_decoder_layers = num_layers if num_decoder_layers is None else num_decoder_layers
        self.backward_scale = 1.0
        self.values: Dict[str, torch.Tensor] = {}
        self.recorded: Dict[str, torch.Tensor] = {}

    def record(self, name: str, layer_number: int, value: torch.Tensor) -> None:
        """Add ``value`` (a scalar; its graph is not kept) to layer ``layer_number`` (1-based)."""
        if not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"layer number {layer_number} is outside 1 .. {self.num_layers}")
        if name not in self.values:
            self.values[name] = torch.zeros(self.num_layers, dtype=torch.float64,
                                            device=value.device)
            self.recorded[name] = torch.zeros(self.num_layers, dtype=torch.float64,
                                              device=value.device)
        self.values[name][layer_number - 1] += value.detach().to(torch.float64)
        self.recorded[name][layer_number - 1] = 1.0

    def all_reduce(self, group) -> None:
        """Sum the values and the recorded marks over ``group`` (e.g. the pipeline group)."""
        for name in sorted(self.values):
            all_reduce(self.values[name], group)
            all_reduce(self.recorded[name], group)
            self.recorded[name].clamp_(max=1.0)

    def report(self, num_microbatches: int = 1, per_layer: bool = False) -> Dict[str, float]:
        """The logged values: for each name, the mean over the layers that recorded it of the
        per-micro-batch mean (Megatron's ``load_balancing_loss`` of the log line; with
        multi-token prediction layers, the sum over all recorded layers divided by the
        decoder's recorded ones, as Megatron logs it). With
        ``per_layer`` (``--moe-per-layer-logging``) also ``{name}_layer_{n}`` for each of them."""
        out = {}
        for name in self.values:
            mask = self.recorded[name] > 0
            per_microbatch = self.values[name] / num_microbatches
            if mask.any() and self.num_decoder_layers < self.num_layers:
                decoder = int(mask[:self.num_decoder_layers].sum())
                out[name] = float(per_microbatch[mask].sum() / max(decoder, 1))
            elif mask.any():
                out[name] = float(per_microbatch[mask].mean())
            if per_layer:
                for index in mask.nonzero().flatten().tolist():
                    out[f"{name}_layer_{index + 1}"] = float(per_microbatch[index])
        return out

    def clear(self) -> None:
        """Forget the recorded values (after each logged iteration)."""
        self.values.clear()
        self.recorded.clear()


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: ``output`` unchanged. Backward: ``output``'s gradient passes through, and
    ``aux_loss`` receives the gradient ``backward_scale`` (read when the backward runs).

    The forward returns a copy, not a view: FSDP2 hooks its pre-backward on the model's
    output, and a view of a custom function's input is one an in-place op could detach it
    from (FSDP2 warns about it; the copy is one ``[b, s]`` loss tensor)."""

    @staticmethod
    def forward(ctx, output, aux_loss, tracker):
        ctx.save_for_backward(aux_loss)
        ctx.tracker = tracker
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output):
        aux_loss, = ctx.saved_tensors
        scale = 1.0 if ctx.tracker is None else ctx.tracker.backward_scale
        return grad_output, torch.full_like(aux_loss, scale), None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor,
                    tracker: Optional[MoELossTracker]) -> torch.Tensor:
    """``output``, with ``aux_loss`` (a scalar already multiplied by its coefficient) added to
    what the backward of ``output`` differentiates."""
    return _AttachAuxLoss.apply(output, aux_loss, tracker)
