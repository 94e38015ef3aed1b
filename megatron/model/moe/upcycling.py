"""Dense-to-MoE upcycling: a mixture-of-experts model's weights made from a dense model's.

Everything but the MLPs is copied as it is. Each MoE layer's experts come from the dense MLP
of the same layer, as Megatron-Core's upcycling makes them (its ``upcycling_utils``):

* ``granularity`` G splits the dense FFN (``ffn``) into G pieces of ``ffn / G``: piece ``i`` is
  rows ``i`` of ``dense_h_to_4h`` (with a gated unit: the gate's and the value's rows ``i``,
  stacked ``[gate_i; value_i]``) and columns ``i`` of ``dense_4h_to_h``. The ``E`` experts are
  ``E / G`` copies of those G pieces: expert ``e`` is piece ``e % G`` of copy ``e // G``.
* Weights are scaled so the routed sum keeps the dense output's magnitude: the activation
  scale is ``G`` (top-k then softmax), or ``E * G / topk`` with ``--moe-router-pre-softmax``;
  ``linear_fc1`` (weight and bias) and ``linear_fc2``'s weight are multiplied by its cube root
  (gated units and squared ReLU) or square root (others); ``linear_fc2``'s bias is copied.
* The router keeps its own initialisation, but the G experts of one copy share one row: expert
  ``e`` gets row ``e // G`` of the router's first ``E / G`` rows (its bias, with
  ``--add-bias-linear``, entry ``e // G`` alike).
* Shared experts keep their initialisation (Megatron-Core's upcycling does not touch them).

With G = 1, top-k routing and probabilities normalised over the chosen experts (the default
softmax after top-k), every chosen expert is the dense MLP and the weights sum to one, so the
upcycled model computes what the dense one does. With G > 1 the scale is exact only for
activations homogeneous in their input (ReLU powers); for GeLU and SwiGLU it is Megatron's
approximation.

The arithmetic is done on full (unsplit) tensors: the dense MLP is gathered over its
tensor-parallel group, the experts are cut, and each rank keeps its expert-tensor-parallel
share of its expert-parallel rank's experts, so the result does not depend on the layout.
"""

from typing import Dict, List, Optional

import torch

from megatron.core.collectives import get_group_rank, get_group_size
from megatron.core.tensor_parallel.mappings import gather_along_first_dim


def activation_scale(num_experts: int, granularity: int, topk: int, pre_softmax: bool) -> float:
    """How much larger the experts' activations must be than the dense MLP's."""
    if pre_softmax:
        return num_experts * granularity / topk
    return float(granularity)


def weight_scale(num_experts: int, granularity: int, topk: int, pre_softmax: bool,
                 cube_root: bool) -> float:
    """The factor on ``linear_fc1`` and ``linear_fc2``'s weights: the activation scale's cube
    root (gated units, squared ReLU: the output is cubic in the weights) or square root."""
    return activation_scale(num_experts, granularity, topk, pre_softmax) ** (
        1 / 3 if cube_root else 1 / 2)


def _pieces(tensor: torch.Tensor, granularity: int, gated: bool, dim: int) -> List[torch.Tensor]:
    """``tensor`` cut into ``granularity`` pieces along ``dim``; with a gated unit each piece is
    ``[gate_i; value_i]`` of the ``[gate; value]`` halves."""
    if not gated:
        return list(torch.tensor_split(tensor, granularity, dim=dim))
    gate, value = torch.chunk(tensor, 2, dim=dim)
    return [torch.cat([g, v], dim=dim) for g, v in zip(torch.tensor_split(gate, granularity, dim),
                                                       torch.tensor_split(value, granularity,
                                                                          dim))]


def upcycle_expert_weights(dense: Dict[str, Optional[torch.Tensor]], num_experts: int,
                           granularity: int, scale: float, gated: bool
                           ) -> List[Dict[str, Optional[torch.Tensor]]]:
    """The ``num_experts`` experts' full weights from the dense MLP's full weights.

    Args:
        dense: ``fc1_weight`` ``[(2) ffn, h]``, ``fc1_bias`` ``[(2) ffn]`` or None,
            ``fc2_weight`` ``[h, ffn]``, ``fc2_bias`` ``[h]`` or None.
        num_experts: E; a multiple of ``granularity``.
        granularity: G; divides ``ffn``.
        scale: :func:`weight_scale`.
        gated: ``fc1`` holds ``[gate; value]``.
    Returns:
        One dict per expert with the same keys, expert ``e`` = piece ``e % G`` of copy ``e // G``.
    """
    fc1 = _pieces(dense["fc1_weight"] * scale, granularity, gated, 0)
    fc2 = _pieces(dense["fc2_weight"] * scale, granularity, False, 1)
    b1 = dense["fc1_bias"]
    b1 = [None] * granularity if b1 is None else _pieces(b1 * scale, granularity, gated, 0)
    b2 = dense["fc2_bias"]
    experts = []
    for e in range(num_experts):
        i = e % granularity
        experts.append({"fc1_weight": fc1[i], "fc1_bias": b1[i], "fc2_weight": fc2[i],
                        "fc2_bias": None if b2 is None else b2.clone()})
    return experts


def upcycle_router_weight(router_weight: torch.Tensor, granularity: int) -> torch.Tensor:
    """``[E, h]`` -> ``[E, h]``: expert ``e`` gets row ``e // G`` of the first ``E / G`` rows,
    so the G pieces of one dense copy always score alike."""
    first = torch.tensor_split(router_weight, granularity, dim=0)[0]        # [E/G, h]
    return first.repeat_interleave(granularity, dim=0)                       # [E, h]


def _gather_rows(local: torch.Tensor, group, stride: int) -> torch.Tensor:
    """The full tensor of a column-parallel shard (dim 0) held as ``stride`` interleaved blocks
    per rank (rank ``r`` holds blocks ``r, r + tp, ...`` of the full tensor's ``stride * tp``)."""
    world = get_group_size(group)
    if world == 1:
        return local
    shards = gather_along_first_dim(local.contiguous(), group).chunk(world, dim=0)
    blocks = [shard.chunk(stride, dim=0) for shard in shards]
    return torch.cat([blocks[r][j] for j in range(stride) for r in range(world)], dim=0)


def _rank_rows(full: torch.Tensor, group, stride: int) -> torch.Tensor:
    """This rank's column-parallel shard of ``full`` (the inverse of :func:`_gather_rows`)."""
    world, rank = get_group_size(group), get_group_rank(group)
    blocks = full.chunk(stride * world, dim=0)
    return torch.cat([blocks[rank + j * world] for j in range(stride)], dim=0)


def dense_mlp_weights(mlp) -> Dict[str, Optional[torch.Tensor]]:
    """A dense :class:`~megatron.model.transformer.ParallelMLP`'s full weights, gathered over its
    tensor-parallel group (every rank gets them)."""
    fc1, fc2 = mlp.dense_h_to_4h, mlp.dense_4h_to_h
    group = fc1.tp_group
    stride = 2 if mlp.config.gated_linear_unit else 1
    fc2_t = _gather_rows(fc2.weight.detach().t(), group, 1)                # [ffn, h]
    return {"fc1_weight": _gather_rows(fc1.weight.detach(), group, stride),
            "fc1_bias": None if fc1.bias is None else _gather_rows(fc1.bias.detach(), group,
                                                                   stride),
            "fc2_weight": fc2_t.t(),
            "fc2_bias": None if fc2.bias is None else fc2.bias.detach()}


def _load_expert(expert, full: Dict[str, Optional[torch.Tensor]], gated: bool) -> None:
    """Copy an expert's full weights into its expert-tensor-parallel share."""
    fc1, fc2 = expert.linear_fc1, expert.linear_fc2
    group = fc1.tp_group
    stride = 2 if gated else 1
    fc1.weight.copy_(_rank_rows(full["fc1_weight"], group, stride))
    fc2.weight.copy_(_rank_rows(full["fc2_weight"].t(), group, 1).t())
    for layer, key, rows in ((fc1, "fc1_bias", True), (fc2, "fc2_bias", False)):
        if (layer.bias is None) != (full[key] is None):
            raise ValueError(f"upcycling: the dense MLP and the experts disagree on biases "
                             f"({key}); use the dense run's --add-bias-linear setting")
        if layer.bias is not None:
            layer.bias.copy_(_rank_rows(full[key], group, stride) if rows else full[key])


def upcycle_moe_layer(moe_layer, dense_mlp, granularity: int) -> None:
    """Fill ``moe_layer``'s routed experts and router from ``dense_mlp`` (in place)."""
    cfg, config = moe_layer.moe_config, moe_layer.config
    num_experts = cfg.num_moe_experts
    scale = weight_scale(num_experts, granularity, cfg.moe_router_topk,
                         cfg.moe_router_pre_softmax,
                         cube_root=config.gated_linear_unit or config.squared_relu)
    experts = upcycle_expert_weights(dense_mlp_weights(dense_mlp), num_experts, granularity,
                                     scale, config.gated_linear_unit)
    local = getattr(moe_layer.experts, "local_experts", None)
    if local is None:   # Megatron-Core's grouped-linear layout (grouped_tensor.py)
        local = moe_layer.experts.expert_views()
    first = get_group_rank(moe_layer.token_dispatcher.ep_group) * len(local)
    with torch.no_grad():
        for i, expert in enumerate(local):
            _load_expert(expert, experts[first + i], config.gated_linear_unit)
        for param in (moe_layer.router.weight, moe_layer.router.bias):
            if param is not None:
                param.copy_(upcycle_router_weight(param.detach().clone(), granularity))


def upcycle_model(moe_model: torch.nn.Module, dense_model: torch.nn.Module,
                  granularity: int) -> int:
    """Copy ``dense_model`` (same pipeline stage) into ``moe_model`` in place: every parameter
    outside the MoE layers by name, each MoE layer's experts and router from the dense MLP at
    the same place. Returns the number of MoE layers upcycled."""
    from megatron.model.moe.layer import MoELayer

    moe_layers = {name: m for name, m in moe_model.named_modules() if isinstance(m, MoELayer)}
    dense_state = dense_model.state_dict()
    own = moe_model.state_dict()
    with torch.no_grad():
        for key, value in own.items():
            if not isinstance(value, torch.Tensor) or any(key.startswith(name + ".") for name in moe_layers):
                continue
            if key not in dense_state or dense_state[key].shape != value.shape:
                raise ValueError(f"upcycling: the dense checkpoint has no {key} of shape "
                                 f"{tuple(value.shape)} (the dense model must be the MoE model "
                                 "without experts)")
            value.copy_(dense_state[key])
    for name, layer in moe_layers.items():
        upcycle_moe_layer(layer, dense_model.get_submodule(name), granularity)
    return len(moe_layers)
