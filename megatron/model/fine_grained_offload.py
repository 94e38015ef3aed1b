"""Fine-grained activation offloading (``--fine-grained-activation-offloading --offload-modules
...``): the tensors chosen modules save for backward wait in host memory between forward and
backward, per module rather than per layer (``--cpu-offloading-num-layers``).

Each chosen module instance is one *group*. Its forward runs under saved-tensor hooks
(:class:`~megatron.model.activation_offload.HostActivationStash`) that move to the host every
saved tensor with at least ``--min-offloaded-tensor-size`` elements that is not a parameter;
backward copies them back, so gradients are those of the plain run bit for bit. Module names
are Megatron's: ``attn_norm`` (the input norm), ``qkv_linear`` (with MLA, the down and up
projections), ``core_attn``, ``attn_proj``, ``mlp_norm`` (the post-attention norm),
``expert_fc1`` (each local expert's first projection; with ``--moe-grouped-gemm`` their one
batched projection) and ``moe_act`` (the experts' activation).

Which groups offload is decided as Megatron decides it, once the first forward of a model
chunk has shown the groups in order and the bytes each would move: the last group of each
module name stays on the device (backward needs it first); then, on pipeline rank ``r``,
``r x --delta-offload-bytes-across-pp-ranks`` bytes stay, taken from the first groups on; then
of the groups left a share ``1 - --activation-offload-fraction`` stays, taken from the last.
A tensor already in host memory (a CPU run) is kept as it is: there is nothing to save there.
"""

from typing import Callable, Dict, List, Optional

import torch

from megatron.model.activation_offload import HostActivationStash

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
                   "expert_fc1", "moe_act")


class OffloadGroup(HostActivationStash):
    """One module instance's saved tensors; ``offload`` False keeps them where they are."""

    def __init__(self, name: str, min_elements: int, copy_host_tensors: bool = False):
        super().__init__(copy_host_tensors=copy_host_tensors)
        self.name = name
        self.min_elements = min_elements
        self.offload = True
        self.bytes_first_pass = 0          # what the first forward moved (or would have)

    def _pack(self, tensor: torch.Tensor):
        if (not self.offload or isinstance(tensor, torch.nn.Parameter)
                or tensor.numel() < self.min_elements):
            return ("kept", tensor)
        packed = super()._pack(tensor)
        if packed[0] != "kept":
            self.bytes_first_pass += tensor.numel() * tensor.element_size()
        return packed


def _module_targets(layer) -> Dict[str, List[torch.nn.Module]]:
    """Module name -> the submodules of one transformer layer it covers (absent ones omitted)."""
    attention = getattr(layer, "self_attention", None)
    out: Dict[str, List[torch.nn.Module]] = {}

    def add(name, module):
        if module is not None:
            out.setdefault(name, []).append(module)

    add("attn_norm", getattr(layer, "input_layernorm", None))
    add("mlp_norm", getattr(layer, "post_attention_layernorm", None))
    if attention is not None:
        qkv = getattr(attention, "query_key_value", None)
        if qkv is None and hasattr(attention, "qkv_projection"):   # MLA: down and up projections
            qkv = attention
        add("qkv_linear", qkv)
        add("core_attn", getattr(attention, "core_attention", None))
        add("attn_proj", getattr(attention, "dense", None) or getattr(attention, "linear_proj",
                                                                      None))
    experts = getattr(getattr(layer, "mlp", None), "experts", None)
    if experts is not None:
        if hasattr(experts, "fc1"):              # grouped experts: one batched first projection
            add("expert_fc1", experts)
        for module in experts.modules():
            if not hasattr(experts, "fc1"):
                add("expert_fc1", getattr(module, "linear_fc1", None))
            if hasattr(module, "activation_func"):
                add("moe_act", module)
    return out


class FineGrainedOffload:
    """The groups of one model chunk and the policy that picks which of them offload."""

    def __init__(self, chunk: torch.nn.Module, layers, modules, min_elements: int,
                 pp_rank: int, delta_bytes: int, fraction: float,
                 copy_host_tensors: bool = False):
        self.groups: List[OffloadGroup] = []
        self.order: List[OffloadGroup] = []        # forward order, seen in the first pass
        self.pp_rank, self.delta_bytes, self.fraction = pp_rank, delta_bytes, fraction
        self.decided = False
        for layer in layers:
            targets = _module_targets(layer)
            for name in modules:
                for module in targets.get(name, []):
                    group = OffloadGroup(name, min_elements, copy_host_tensors)
                    self.groups.append(group)
                    if name == "moe_act":
                        module.activation_func = self._wrap(group, module.activation_func)
                    elif name == "expert_fc1" and hasattr(module, "fc1"):
                        module.fc1 = self._wrap(group, module.fc1)
                    elif name == "qkv_linear" and hasattr(module, "qkv_projection"):
                        module.qkv_projection = self._wrap(group, module.qkv_projection)
                    else:
                        module.register_forward_pre_hook(self._enter(group))
                        module.register_forward_hook(self._exit(group))
        chunk.register_forward_hook(lambda *_: self._decide())

    def _enter(self, group: OffloadGroup) -> Callable:
        def hook(_module, _inputs):
            if torch.is_grad_enabled():
                self._seen(group)
                group.__enter__()
        return hook

    def _exit(self, group: OffloadGroup) -> Callable:
        def hook(_module, _inputs, _output):
            if torch.is_grad_enabled():
                group.__exit__(None, None, None)
        return hook

    def _wrap(self, group: OffloadGroup, fn: Callable) -> Callable:
        def wrapped(*args):
            if not torch.is_grad_enabled():
                return fn(*args)
            self._seen(group)
            with group:
                return fn(*args)
        return wrapped

    def _seen(self, group: OffloadGroup) -> None:
        if not self.decided and group not in self.order:
            self.order.append(group)

    def _decide(self) -> None:
        """After the chunk's first forward with gradients: Megatron's choice of groups."""
        if self.decided or not self.order:
            return
        self.decided = True
        for group in self.groups:
            if group not in self.order:
                group.offload = False            # never ran with gradients
        last = {}
        for group in self.order:
            last[group.name] = group
        for group in last.values():
            group.offload = False                # backward needs it first
        keep = self.pp_rank * self.delta_bytes
        for group in self.order:
            if group.offload and keep > 0:
                keep -= group.bytes_first_pass
                group.offload = False
        eligible = [g for g in self.order if g.offload]
        disabled = int(len(eligible) * (1.0 - self.fraction))
        for group in reversed(eligible):
            if disabled <= 0:
                break
            group.offload = False
            disabled -= 1

    def offloading(self) -> List[str]:
        """``name#index`` of the groups that offload, in forward order (after the first pass)."""
        counts: Dict[str, int] = {}
        out = []
        for group in self.order:
            index = counts.get(group.name, 0)
            counts[group.name] = index + 1
            if group.offload:
                out.append(f"{group.name}#{index}")
        return out


def install(chunk: torch.nn.Module, layers, config, pp_rank: int,
            copy_host_tensors: bool = False) -> Optional[FineGrainedOffload]:
    """Attach the offload groups --offload-modules names to ``layers`` of ``chunk``."""
    if not config.fine_grained_activation_offloading:
        return None
    return FineGrainedOffload(chunk, layers, config.offload_modules,
                              config.min_offloaded_tensor_size, pp_rank,
                              config.delta_offload_bytes_across_pp_ranks,
                              config.activation_offload_fraction, copy_host_tensors)
