"""Optimizer CPU offload (``--optimizer-cpu-offload``): part of the step runs on the host.

:class:`HybridDeviceOptimizer` (Megatron-Core's name) is a torch optimizer over the parameters
the wrappers hand it (fp32 main params, or the distributed optimizer's shards). Walking them in
group order, a parameter goes to the host while the elements already sent are below
``--optimizer-offload-fraction`` of the total (Megatron's rule, so 1.0 sends everything and 0.5
about the first half). For those the optimizer keeps an fp32 host copy (pinned unless
``--no-pin-cpu-params``), copies each gradient to a host buffer (pinned unless
``--no-pin-cpu-grads``), steps a host optimizer (torch's own), and copies the result back into
the device parameter; the rest step on the device as without offload (with
``--use-torch-optimizer-for-cpu-offload`` through torch's optimizer there too, not the fused
one). ``--overlap-cpu-optimizer-d2h-h2d`` issues the copies asynchronously and lets the device
part's step run while the host waits for its gradients.

The state of every parameter, host or device, is one dict shared with the sub-optimizer that
steps it, keyed here by the device parameter: ``state_dict()`` is exactly what the optimizer
would save without offload, so checkpoints move freely between runs with and without it.

The split is made at the first step and again whenever the set of parameters changes (the
mixed-precision wrapper swaps in its main params after building the optimizer). A host copy is
refreshed from its device parameter when the latter was written by someone else (a checkpoint
load, a reload of model params): its version counter tells.
"""

from typing import Callable, Dict, List, Optional

import torch

from megatron.optimizer.torch_base import OptimizerBase

SubOptimizerFactory = Callable[[List[dict], bool], torch.optim.Optimizer]


def split_for_offload(params: List[torch.Tensor], fraction: float) -> List[bool]:
    """Per parameter (in order), whether it steps on the host: while the elements already sent
    are fewer than ``fraction`` of all, the next parameter goes too."""
    threshold = fraction * sum(p.numel() for p in params)
    out, sent = [], 0
    for param in params:
        out.append(sent < threshold)
        sent += param.numel()
    return out


class HybridDeviceOptimizer(OptimizerBase):
    """Steps the first ``offload_fraction`` of the parameters on ``host`` and the rest where
    they live.

    Args:
        param_groups: torch param groups (their hyper-parameters are followed at every step).
        build: ``(groups, on_host) -> torch optimizer`` for either part.
        offload_fraction: ``--optimizer-offload-fraction``, in [0, 1].
        host: the host device (``cpu``).
        pin_grads / pin_params: pin the host gradient buffers / parameter copies (only where
            the parameters live on an accelerator; there is nothing to pin for on a CPU run).
        overlap: ``--overlap-cpu-optimizer-d2h-h2d``: asynchronous copies.
    """

    def __init__(self, param_groups: List[dict], build: SubOptimizerFactory,
                 offload_fraction: float = 1.0, host: str = "cpu", pin_grads: bool = True,
                 pin_params: bool = True, overlap: bool = False):
        if not 0.0 <= offload_fraction <= 1.0:
            raise ValueError(f"--optimizer-offload-fraction must be in [0, 1], got "
                             f"{offload_fraction}")
        super().__init__(param_groups, {})
        self.build, self.offload_fraction = build, offload_fraction
        self.host = torch.device(host)
        self.pin_grads, self.pin_params, self.overlap = pin_grads, pin_params, overlap
        self._split_key = None
        self.host_optimizer: Optional[torch.optim.Optimizer] = None
        self.device_optimizer: Optional[torch.optim.Optimizer] = None
        self.host_copies: Dict[torch.Tensor, torch.Tensor] = {}  # device param -> host copy
        self._grad_buffers: Dict[torch.Tensor, torch.Tensor] = {}
        self._versions: Dict[torch.Tensor, int] = {}
        self._ensure_split()

    def _pin(self, param: torch.Tensor, wanted: bool) -> bool:
        return wanted and param.device.type != "cpu" and torch.cuda.is_available()

    def _ensure_split(self) -> None:
        key = tuple(id(p) for group in self.param_groups for p in group["params"])
        if key == self._split_key:
            return
        params = [p for group in self.param_groups for p in group["params"]]
        on_host = dict(zip(params, split_for_offload(params, self.offload_fraction)))
        host_groups, device_groups, links = [], [], []
        self.host_copies, self._grad_buffers, self._versions = {}, {}, {}
        for g, group in enumerate(self.param_groups):
            hparams = {k: v for k, v in group.items() if k not in ("params", "model_params")}
            mine = [p for p in group["params"] if on_host[p]]
            rest = [p for p in group["params"] if not on_host[p]]
            if mine:
                copies = [self._host_copy(p) for p in mine]
                host_groups.append(dict(hparams, params=copies, _group=g))
                links += [(c, p) for c, p in zip(copies, mine)]
            if rest:
                device_groups.append(dict(hparams, params=rest, _group=g))
                links += [(p, p) for p in rest]
        self.host_optimizer = self.build(host_groups, True) if host_groups else None
        self.device_optimizer = self.build(device_groups, False) if device_groups else None
        for sub in self._subs():
            sub.state.clear()
        for stepped, param in links:  # one state dict per parameter, shared
            sub = self.host_optimizer if stepped is not param else self.device_optimizer
            sub.state[stepped] = self.state[param]
        for sub in self._subs():  # the sub-optimizers' defaults (betas, eps, ...) show here
            for sub_group in sub.param_groups:
                group = self.param_groups[sub_group["_group"]]
                for name, value in sub_group.items():
                    if name not in ("params", "_group"):
                        group.setdefault(name, value)
        self._split_key = key

    def _subs(self) -> List[torch.optim.Optimizer]:
        return [s for s in (self.host_optimizer, self.device_optimizer) if s is not None]

    def _host_copy(self, param: torch.Tensor) -> torch.Tensor:
        copy = torch.empty(param.shape, dtype=torch.float32, device=self.host,
                           pin_memory=self._pin(param, self.pin_params))
        copy.copy_(param.detach())
        self.host_copies[param] = copy
        self._versions[param] = param._version
        return copy

    def _sync_hyperparameters(self) -> None:
        for sub in self._subs():
            for sub_group in sub.param_groups:
                group = self.param_groups[sub_group["_group"]]
                sub_group.update({k: v for k, v in group.items()
                                  if k not in ("params", "model_params")})

    def _stage_on_host(self) -> None:
        """Fresh host copies where the device parameter was written by someone else, state
        tensors on the host, and this step's gradients copied over."""
        blocking = not self.overlap
        for param, copy in self.host_copies.items():
            if param._version != self._versions[param]:
                copy.copy_(param.detach())
            state = self.state[param]
            for name, value in state.items():
                if torch.is_tensor(value) and value.device != self.host:
                    state[name] = value.to(self.host)
            if param.grad is None:
                copy.grad = None
                continue
            buffer = self._grad_buffers.get(param)
            if buffer is None:
                buffer = torch.empty(param.shape, dtype=torch.float32, device=self.host,
                                     pin_memory=self._pin(param, self.pin_grads))
                self._grad_buffers[param] = buffer
            buffer.copy_(param.grad.detach(), non_blocking=not blocking)
            copy.grad = buffer

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_split()
        self._sync_hyperparameters()
        self._stage_on_host()
        if self.device_optimizer is not None:
            self.device_optimizer.step()  # queued on the device while the host works
        if self.host_optimizer is not None:
            if self.overlap and torch.cuda.is_available():
                torch.cuda.current_stream().synchronize()  # the gradients have arrived
            self.host_optimizer.step()
            for param, copy in self.host_copies.items():
                param.copy_(copy, non_blocking=self.overlap)
                self._versions[param] = param._version
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._split_key = None  # the state dicts are new: link them again at the next step
