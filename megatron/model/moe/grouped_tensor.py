"""The local experts stored as Megatron-Core's TransformerEngine grouped linears hold them with
``--moe-single-grouped-weight`` / ``--moe-single-grouped-bias`` (``--moe-use-grouped-tensor``).

Megatron-Core's ``TEGroupedMLP`` keeps each projection of all local experts in one grouped
linear, ``experts.linear_fc1`` and ``experts.linear_fc2``, with one GEMM per local expert:

* per GEMM, ``weight0 .. weight{El-1}`` (``[out, in]`` each) and ``bias0 ...`` (``[out]``);
* ``--moe-single-grouped-weight``: one parameter ``weight`` ``[El, out, in]`` for all of them;
* ``--moe-single-grouped-bias``: one parameter ``bias`` ``[El, out]``.

``out``/``in`` are those of :class:`~megatron.model.moe.experts.ExpertMLP` (fc1 ``[(2) ffn /
etp, h]``, SwiGLU ``[gate_r; value_r]``; fc2 ``[h, ffn / etp]``). These are the names of the
model's state (``--ckpt-format torch``: ``...layers.N.mlp.experts.linear_fc1.weight``). In
``torch_dist`` the tensors keep Megatron-Core's per-expert keys
(``decoder.layers.mlp.experts.experts.linear_fc1.weight`` ``[L, E, out, in]``), which no
layout changes, so any of these layouts loads a file saved by any other (and by the loop over
experts). Loading a state dict converts between the three spellings (stacked, per GEMM, and
``local_experts.<J>.``), as Megatron-Core's grouped linear does between the first two.

The computation is :class:`~megatron.model.moe.experts.GroupedMLP`'s (one batched matmul per
projection); the initial values are the loop's (each expert from its own seed), so a model
with these flags equals one without them.
"""

from types import SimpleNamespace
from typing import Dict, List, Optional

import torch

from megatron.core.tensor_parallel.layers import copy_tensor_model_parallel_attributes
from megatron.model.moe.experts import GroupedMLP

_LINEARS = ("linear_fc1", "linear_fc2")


def _parameter(value: torch.Tensor, like: torch.Tensor, stacked: bool) -> torch.nn.Parameter:
    """A new parameter holding ``value`` with the attributes of the per-expert ``like``
    (tensor-parallel split shifted one dim when ``value`` has the expert axis in front)."""
    param = torch.nn.Parameter(value.detach().clone())
    copy_tensor_model_parallel_attributes(param, like)
    if stacked and param.partition_dim >= 0:
        param.partition_dim += 1
    for name, attribute in vars(like).items():
        if name not in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            setattr(param, name, attribute)
    return param


class GroupedExpertLinear(torch.nn.Module):
    """One projection of all local experts, Megatron-Core's grouped-linear names.

    Args:
        weights: each local expert's weight ``[out, in]``, in order.
        biases: their biases ``[out]`` (None: no bias).
        single_weight: one ``weight`` ``[El, out, in]`` (else ``weight0 ...``).
        single_bias: one ``bias`` ``[El, out]`` (else ``bias0 ...``).
    """

    def __init__(self, weights: List[torch.Tensor], biases: Optional[List[torch.Tensor]],
                 single_weight: bool, single_bias: bool):
        super().__init__()
        self.num_gemms = len(weights)
        self.single_weight, self.single_bias = single_weight, single_bias
        self.use_bias = biases is not None
        self._register("weight", weights, single_weight)
        if biases is not None:
            self._register("bias", biases, single_bias)
        self._register_load_state_dict_pre_hook(self._normalize_keys, with_module=True)

    def _register(self, kind: str, tensors: List[torch.Tensor], single: bool) -> None:
        if single:
            self.register_parameter(kind, _parameter(torch.stack(tensors), tensors[0], True))
            return
        for i, tensor in enumerate(tensors):
            self.register_parameter(f"{kind}{i}", _parameter(tensor, tensor, False))

    def stacked(self, kind: str) -> Optional[torch.Tensor]:
        """``weight`` ``[El, out, in]`` or ``bias`` ``[El, out]`` of all local experts (None:
        no bias)."""
        if kind == "bias" and not self.use_bias:
            return None
        if self.single_weight if kind == "weight" else self.single_bias:
            return getattr(self, kind)
        return torch.stack([getattr(self, f"{kind}{i}") for i in range(self.num_gemms)])

    @staticmethod
    def _normalize_keys(module, state_dict, prefix, *args) -> None:
        """A state of the other spelling (stacked / per GEMM) made this module's."""
        kinds = [("weight", module.single_weight)]
        if module.use_bias:
            kinds.append(("bias", module.single_bias))
        for kind, single in kinds:
            whole = f"{prefix}{kind}"
            parts = [f"{prefix}{kind}{i}" for i in range(module.num_gemms)]
            if single and whole not in state_dict and all(p in state_dict for p in parts):
                state_dict[whole] = torch.stack([state_dict.pop(p) for p in parts])
            elif not single and whole in state_dict and not any(p in state_dict for p in parts):
                tensor = state_dict.pop(whole)
                if tensor.dim() == 0 or tensor.shape[0] != module.num_gemms:
                    raise RuntimeError(f"{whole}: holds {tuple(tensor.shape)}, expected "
                                       f"{module.num_gemms} local experts on the first dim")
                state_dict.update(zip(parts, tensor.unbind(0)))


def _member(grouped: GroupedExpertLinear, kind: str, j: int) -> Optional[torch.Tensor]:
    if kind == "bias" and not grouped.use_bias:
        return None
    if grouped.single_weight if kind == "weight" else grouped.single_bias:
        return getattr(grouped, kind)[j]
    return getattr(grouped, f"{kind}{j}")


class TEGroupedMLP(GroupedMLP):
    """:class:`GroupedMLP` with Megatron-Core's ``TEGroupedMLP`` parameter layout (module
    docstring); the same arguments as :class:`~megatron.model.moe.experts.SequentialMLP`."""

    def __init__(self, config, moe_config, *args, **kwargs):
        if moe_config.moe_single_grouped_bias and not config.add_bias_linear:
            raise ValueError("--moe-single-grouped-bias needs biases (Megatron-Core refuses it "
                             "with --disable-bias-linear)")
        super().__init__(config, moe_config, *args, **kwargs)
        experts = self.local_experts
        del self.local_experts
        for name in _LINEARS:
            linears = [getattr(e, name) for e in experts]
            biases = [lin.bias for lin in linears] if linears[0].bias is not None else None
            setattr(self, name, GroupedExpertLinear(
                [lin.weight for lin in linears], biases,
                moe_config.moe_single_grouped_weight, moe_config.moe_single_grouped_bias))
        self._register_load_state_dict_pre_hook(self._from_local_experts, with_module=True)

    def _stacked(self, name: str, attr: str) -> Optional[torch.Tensor]:
        return getattr(self, name).stacked(attr)

    def expert_views(self) -> List[SimpleNamespace]:
        """One object per local expert whose ``linear_fc1`` / ``linear_fc2`` have ``weight``,
        ``bias`` (views of, or, per GEMM, the parameters themselves) and ``tp_group``: what
        writing one expert's weights in place (upcycling) needs."""
        views = []
        for j in range(self.num_local_experts):
            linears = {}
            for name in _LINEARS:
                grouped = getattr(self, name)
                linears[name] = SimpleNamespace(
                    weight=_member(grouped, "weight", j), bias=_member(grouped, "bias", j),
                    tp_group=self.expert_tp_group)
            views.append(SimpleNamespace(**linears))
        return views

    @staticmethod
    def _from_local_experts(module, state_dict: Dict[str, torch.Tensor], prefix, *args):
        """The loop's spelling, ``local_experts.<J>.linear_fc1.weight``, as per-GEMM names
        (which the grouped linears then stack as they need)."""
        head = f"{prefix}local_experts."
        for key in [k for k in state_dict if k.startswith(head)]:
            expert, rest = key[len(head):].split(".", 1)
            linear, kind = rest.rsplit(".", 1)
            state_dict[f"{prefix}{linear}.{kind}{expert}"] = state_dict.pop(key)
