"""QK-clip (``--qk-clip``) and the largest attention logit (``--log-max-attention-logit``).

During the training forwards of a step each attention layer's core attention keeps, per head
of this rank, the largest pre-softmax logit ``q . k * softmax scale`` over unmasked positions
(``current_max_attn_logits``, the maximum over the step's micro-batches). After the optimizer
step, :func:`finish_step`:

1. takes the maximum of every layer's values over the data-parallel x context-parallel group
   (the replicas saw different tokens; tensor-parallel ranks hold different heads, pipeline
   stages different layers, and each clips its own);
2. with ``--qk-clip`` and a step that was taken, scales the query and key rows of every head
   whose maximum exceeded ``--qk-clip-threshold`` (each attention layer's
   ``qk_clip_row_factors``), through the optimizer so the fp32 main weights are scaled too;
3. resets the maxima (also after a skipped step);
4. returns the largest value of the whole model: the maximum over the model-parallel group too,
   the number the log line and ``max_attention_logit`` show.

Nothing of this outlives the step, so checkpoints hold no state for it.
"""

from typing import Iterable, List, Optional, Tuple

import torch

from megatron.core import collectives, device


def attention_layers(model_chunks: Iterable[torch.nn.Module]) -> List[torch.nn.Module]:
    """The modules of ``model_chunks`` that can be clipped (in module order, each once)."""
    layers, seen = [], set()
    for chunk in model_chunks:
        for module in chunk.modules():
            if hasattr(module, "qk_clip_row_factors") and id(module) not in seen:
                seen.add(id(module))
                layers.append(module)
    return layers


def reduce_max_logits(layers, dp_cp_group) -> Optional[torch.Tensor]:
    """Every layer's per-head maxima, reduced (MAX) over ``dp_cp_group`` in one collective and
    written back; returns them concatenated (None when no layer has any)."""
    maxima = [layer.core_attention.current_max_attn_logits for layer in layers]
    present = [m for m in maxima if m is not None]
    if not present:
        return None
    flat = torch.cat(present)
    if collectives.get_group_size(dp_cp_group) > 1:
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX,
                                     group=dp_cp_group)
    parts = iter(torch.split(flat, [m.numel() for m in present]))
    for layer, own in zip(layers, maxima):
        if own is not None:
            layer.core_attention.current_max_attn_logits = next(parts)
    return flat


def _model_max(flat: Optional[torch.Tensor], model_parallel_group) -> Tuple[float, bool]:
    """The largest value of the whole model, not below 0 (Megatron starts its maximum at 0,
    which is also what a stage without attention layers holds), and whether any value, on any
    rank, is nan or +inf."""
    stats = torch.zeros(2, dtype=torch.float32,
                        device=device.current_device() if flat is None else flat.device)
    if flat is not None:
        bad = torch.isnan(flat) | torch.isposinf(flat)
        stats[0] = flat.masked_fill(bad, float("-inf")).max().clamp(min=0.0)
        stats[1] = bad.any().float()
    if collectives.get_group_size(model_parallel_group) > 1:
        torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.MAX,
                                     group=model_parallel_group)
    return float(stats[0].item()), bool(stats[1].item())


def clip(layers, optimizer, threshold: float, alpha: float) -> None:
    """Scale the query and key rows of the heads over ``threshold`` (after a step)."""
    factors = [pair for layer in layers
               for pair in layer.qk_clip_row_factors(threshold, alpha)]
    if factors:
        optimizer.scale_param_rows(factors)


def reset(layers) -> None:
    for layer in layers:
        layer.core_attention.current_max_attn_logits = None


def finish_step(model_chunks, optimizer, pstate, *, clip_weights: bool, threshold: float,
                alpha: float) -> float:
    """Reduce, clip (when ``clip_weights``), reset; returns the model's largest logit of the
    step. Collective over the data x context parallel and model-parallel groups."""
    layers = attention_layers(model_chunks)
    flat = reduce_max_logits(layers, pstate.dp_cp_group)
    largest, not_finite = _model_max(flat, pstate.model_parallel_group)
    if not_finite:
        reset(layers)
        raise FloatingPointError("--qk-clip / --log-max-attention-logit: an attention logit "
                                 "of this step is not finite (inf or nan)")
    if clip_weights:
        clip(layers, optimizer, threshold, alpha)
    reset(layers)
    return largest
