"""The training loop's side of the mixture-of-experts auxiliary losses.

Before each step the loop sets every MoE tracker's gradient scale to the factor the main loss
is scaled by in the schedule: ``1 / num_microbatches`` times the fp16 loss scale (1 without
fp16; the loss scale alone with ``--calculate-per-token-loss``), so the load-balancing and z
losses reach the gradients exactly as if they had been added to the loss. After the step it
collects the logged values under Megatron's names (``load_balancing_loss``,
``seq_load_balancing_loss``, ``global_load_balancing_loss``, ``z_loss``: each the mean over MoE
layers of the per-micro-batch mean), summed over pipeline stages (each holds its own layers)
and averaged over data-parallel ranks (each routed its own micro-batches), as the ``lm loss``
is; and it restarts the routers' ``global_aux_loss`` running averages. With
``--moe-per-layer-logging`` each layer's value is also returned under ``moe/{name}_layer_{i}``
(``i`` 0-based, Megatron's TensorBoard name), which the console line leaves out.

Since these sums (and the routers' token counts) change during a step's passes, this module
also saves and restores that state for a re-run of the step (:func:`step_state`, used by
``--rerun-mode``).
"""

import copy
from typing import Dict, List

import torch

from megatron.core.collectives import all_reduce, get_group_size
from megatron.model.dsa import INDEXER_LOSS_NAME
from megatron.model.moe.router import update_expert_biases as update_expert_biases_of
from megatron.model.moe.router import update_quantile_biases
from megatron.model.moe.tracker import LOSS_NAMES, MoELossTracker

PER_LAYER_PREFIX = "moe/"


def model_trackers(model_chunks) -> List[MoELossTracker]:
    """The trackers of the (wrapped) model chunks; empty for a dense model."""
    trackers = []
    for chunk in model_chunks:
        module = chunk
        while getattr(module, "moe_tracker", None) is None and hasattr(module, "module"):
            module = module.module
        tracker = getattr(module, "moe_tracker", None)
        if tracker is not None:
            trackers.append(tracker)
    return trackers


def _unwrapped(model_chunks):
    for chunk in model_chunks:
        module = chunk
        while hasattr(module, "module") and not hasattr(module, "mtp_tracker"):
            module = module.module
        yield module


def mtp_trackers(model_chunks):
    """The multi-token prediction trackers of the (wrapped) model chunks."""
    return [m.mtp_tracker for m in _unwrapped(model_chunks)
            if getattr(m, "mtp_tracker", None) is not None]


def dsa_trackers(model_chunks):
    """The DSA indexer-loss trackers of the (wrapped) model chunks."""
    return [m.dsa_tracker for m in _unwrapped(model_chunks)
            if getattr(m, "dsa_tracker", None) is not None]


def set_aux_loss_scale(model_chunks, loss_scale: torch.Tensor, num_microbatches: int,
                       per_token_loss: bool = False) -> None:
    """The gradient the auxiliary losses (MoE, multi-token prediction, DSA's indexer) start
    backward with: ``loss_scale / num_microbatches``, the factor of the main loss's gradient;
    with ``per_token_loss`` (``--calculate-per-token-loss``) ``loss_scale`` alone, as
    Megatron-Core sets it: the losses attach token-count multiples of their values (see the
    router and the GPT model) and the gradients are divided by the step's token count."""
    scale = float(loss_scale) if per_token_loss else float(loss_scale) / num_microbatches
    for tracker in (model_trackers(model_chunks) + mtp_trackers(model_chunks)
                    + dsa_trackers(model_chunks)):
        tracker.backward_scale = scale


def mtp_loss_values(model_chunks, pstate, num_microbatches: int) -> Dict[str, float]:
    """``mtp_{K} loss`` of this iteration, averaged over data x context-parallel ranks (every
    rank of the last stage must call it)."""
    out = {}
    dp_group = getattr(pstate, "dp_cp_group", pstate.dp_group)
    for tracker in mtp_trackers(model_chunks):
        out.update(tracker.report(num_microbatches, dp_group))
    return out


def indexer_loss_values(model_chunks, pstate, num_microbatches: int) -> Dict[str, float]:
    """``indexer loss`` of this iteration (DSA, with its coefficient): the mean over the
    indexer layers of the per-micro-batch mean, summed over pipeline stages and averaged over
    data-parallel ranks, as Megatron-Core logs it (every rank must call it; the trackers are
    cleared)."""
    # Every indexer layer records in training when the loss is on, so every rank either has
    # values or none.
    filled = [t for t in dsa_trackers(model_chunks) if INDEXER_LOSS_NAME in t.values]
    if not filled:
        return {}
    merged = MoELossTracker(filled[0].num_layers)
    merged.values[INDEXER_LOSS_NAME] = sum(t.values[INDEXER_LOSS_NAME] for t in filled)
    merged.recorded[INDEXER_LOSS_NAME] = torch.stack(
        [t.recorded[INDEXER_LOSS_NAME] for t in filled]).amax(dim=0)
    for tracker in filled:
        tracker.clear()
    merged.all_reduce(pstate.pp_group)
    dp_group = getattr(pstate, "dp_cp_group", pstate.dp_group)
    all_reduce(merged.values[INDEXER_LOSS_NAME], dp_group)
    merged.values[INDEXER_LOSS_NAME] /= get_group_size(dp_group)
    return merged.report(num_microbatches)


def update_expert_biases(model_chunks, pstate) -> None:
    """Aux-loss-free balancing after the optimizer step: every router's expert bias moves by
    the token choices of the step, counted over data x context x tensor-parallel ranks; every
    quantile-balancing router's bias is set from the step's batch biases."""
    groups = (getattr(pstate, "dp_cp_group", pstate.dp_group), pstate.tp_group)
    update_expert_biases_of(list(_unwrapped(model_chunks)), groups)
    # Quantile balancing: the micro-batches' batch biases are whole-sequence values already,
    # so only the data x context-parallel ranks average them (as Megatron-Core).
    update_quantile_biases(list(_unwrapped(model_chunks)), groups[0])


def reset_global_aux_loss(model_chunks) -> None:
    """After each step: the routers' ``global_aux_loss`` running averages start again (as
    Megatron-Core resets them when it finalises a step's gradients)."""
    for chunk in _unwrapped(model_chunks):
        for module in chunk.modules():
            reset = getattr(module, "reset_global_aux_loss_tracker", None)
            if reset is not None:
                reset()


def aux_loss_values(model_chunks, pstate, num_microbatches: int,
                    per_layer: bool = False) -> Dict[str, float]:
    """The logged auxiliary losses of this iteration (every rank must call it; the trackers are
    cleared)."""
    trackers = model_trackers(model_chunks)
    if not trackers:
        return {}
    merged = MoELossTracker(trackers[0].num_layers, trackers[0].num_decoder_layers)
    dev = torch.device("cpu")
    for tracker in trackers:
        for values in tracker.values.values():
            dev = values.device
    for name in LOSS_NAMES:
        values = torch.zeros(merged.num_layers, dtype=torch.float64, device=dev)
        recorded = torch.zeros_like(values)
        for tracker in trackers:
            if name in tracker.values:
                values += tracker.values[name]
                recorded = torch.maximum(recorded, tracker.recorded[name])
        merged.values[name], merged.recorded[name] = values, recorded
    merged.all_reduce(pstate.pp_group)
    # The mean over data x context-parallel ranks (each context-parallel rank records its
    # share times the group size, see the router).
    dp_group = getattr(pstate, "dp_cp_group", pstate.dp_group)
    dp_size = get_group_size(dp_group)
    for name in LOSS_NAMES:
        all_reduce(merged.values[name], dp_group)
        merged.values[name] /= dp_size
    for tracker in trackers:
        tracker.clear()
    out = {}
    for key, value in merged.report(num_microbatches, per_layer).items():
        name, _, layer = key.partition("_layer_")
        out[f"{PER_LAYER_PREFIX}{name}_layer_{int(layer) - 1}" if layer else key] = value
    return out


def step_state(model_chunks) -> dict:
    """What a training step's forward and backward passes change in the model besides the
    gradients: every module buffer (the routers' token counts since the last expert-bias
    update, among others) and the MoE and multi-token-prediction trackers' sums. A re-run of
    the step (--rerun-mode) restores it first, so the step counts once."""
    buffers = [[b.detach().clone() for b in chunk.buffers()] for chunk in model_chunks]
    trackers = [copy.deepcopy(vars(t))
                for t in model_trackers(model_chunks) + mtp_trackers(model_chunks)]
    return {"buffers": buffers, "trackers": trackers}


def restore_step_state(model_chunks, saved: dict) -> None:
    """Put back what :func:`step_state` took."""
    with torch.no_grad():
        for chunk, values in zip(model_chunks, saved["buffers"]):
            for buffer, value in zip(chunk.buffers(), values):
                buffer.copy_(value)
    for tracker, fields in zip(model_trackers(model_chunks) + mtp_trackers(model_chunks),
                               saved["trackers"]):
        vars(tracker).update(copy.deepcopy(fields))
