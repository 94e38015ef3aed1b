"""FusedAdamW: ``torch.optim.AdamW`` with the whole step of a param group in one kernel call.

The update rule, hyper-parameters, state (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``) and ``state_dict`` layout are those of ``torch.optim.AdamW``, so checkpoints
load in either direction. The step runs ``megatron_fused::fused_adamw_`` (see
:func:`megatron.fused_kernels.ops.multi_tensor_adamw`) over every float32 parameter of a group at
once; parameters it cannot take (other dtypes, devices without kernels, or no extension) go
through torch's own single-tensor AdamW.

Mixed precision: a param group may carry ``"model_params"``, a list parallel to ``"params"``
(the float32 main params) of model params (e.g. bfloat16); after each update the main param is
rounded into its model param by the same kernel, so no separate copy pass is needed.
"""

from typing import Dict, List, Tuple

import torch

from megatron.fused_kernels.ops import multi_tensor_adamw
from megatron.optimizer.torch_base import OptimizerBase


class FusedAdamW(OptimizerBase):
    """AdamW (decoupled weight decay) over multi-tensor fused steps.

    Args:
        params: parameters or param groups (a group may add ``model_params``, see above).
        lr, betas, eps, weight_decay, amsgrad, maximize: as in ``torch.optim.AdamW``.
    """

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False):
        if lr < 0.0:
            raise ValueError(f"FusedAdamW: lr must be >= 0, got {lr}")
        if eps < 0.0:
            raise ValueError(f"FusedAdamW: eps must be >= 0, got {eps}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"FusedAdamW: betas[{i}] must be in [0, 1), got {beta}")
        if weight_decay < 0.0:
            raise ValueError(f"FusedAdamW: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check_model_params(group)

    @staticmethod
    def _check_model_params(group: Dict) -> None:
        model = group.get("model_params")
        if model is None:
            return
        if len(model) != len(group["params"]):
            raise ValueError(f"FusedAdamW: a param group has {len(group['params'])} params but "
                             f"{len(model)} model_params; they must pair up one to one")
        for i, (main, copy) in enumerate(zip(group["params"], model)):
            if main.numel() != copy.numel():
                raise ValueError(f"FusedAdamW: model_params[{i}] has {copy.numel()} elements, "
                                 f"its main param {main.numel()}")

    def add_param_group(self, param_group: Dict) -> None:
        super().add_param_group(param_group)
        self._check_model_params(self.param_groups[-1])

    def state_dict(self) -> Dict:
        """torch.optim.AdamW's layout; ``model_params`` (live model tensors) is left out."""
        state = super().state_dict()
        for group in state["param_groups"]:
            group.pop("model_params", None)
        return state

    def load_state_dict(self, state_dict: Dict) -> None:
        """Load an AdamW or FusedAdamW state; each group keeps its own ``model_params``."""
        model = [group.get("model_params") for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, params in zip(self.param_groups, model):
            if params is not None:
                group["model_params"] = params

    def _state_for(self, p: torch.Tensor, amsgrad: bool) -> Dict:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: Dict) -> None:
        amsgrad = group["amsgrad"]
        model_params = group.get("model_params")
        # Params whose step counts agree go in one call (normally the whole group).
        batches: Dict[float, List[List[torch.Tensor]]] = {}
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("FusedAdamW does not support sparse gradients")
            state = self._state_for(p, amsgrad)
            state["step"] += 1
            lists = batches.setdefault(float(state["step"]), [[], [], [], [], [], []])
            lists[0].append(p)
            lists[1].append(p.grad)
            lists[2].append(state["exp_avg"])
            lists[3].append(state["exp_avg_sq"])
            if amsgrad:
                lists[4].append(state["max_exp_avg_sq"])
            if model_params is not None:
                lists[5].append(model_params[i])
        beta1, beta2 = group["betas"]
        for step, (params, grads, exp_avgs, exp_avg_sqs, max_sqs, models) in batches.items():
            multi_tensor_adamw(params, grads, exp_avgs, exp_avg_sqs, lr=group["lr"],
                               beta1=beta1, beta2=beta2, eps=group["eps"],
                               weight_decay=group["weight_decay"], step=step,
                               amsgrad=amsgrad, maximize=group["maximize"],
                               max_exp_avg_sqs=max_sqs, model_params=models)
