"""Muon (``--optimizer muon``): momentum orthogonalised by a Newton-Schulz iteration for the
transformer layers' 2-D weight matrices, AdamW for every other parameter.

The meaning follows Megatron-Core's Muon (built on NVIDIA's Emerging-Optimizers):

- Which parameters: 2-D weights not marked ``is_embedding_or_output_parameter`` get Muon;
  the word embeddings, the output layer, norms and biases get AdamW with ``--adam-beta1``,
  ``--adam-beta2``, ``--adam-eps``, the same learning rate and weight-decay groups
  (``--muon-scalar-optimizer adam``). As in Megatron-Core, a learned position-embedding table
  is 2-D and unmarked, so it takes Muon.
- A Muon step, for a parameter ``W`` with gradient ``G``, learning rate ``lr``, weight decay
  ``wd`` and momentum ``beta`` (``--muon-momentum``)::

      W <- W - lr * wd * W                          (decoupled weight decay)
      M <- beta * M + (1 - beta) * G                (``momentum_buffer``)
      U <- (1 - beta) * G + beta * M  if --muon-nesterov, else M
      W <- W - lr * scale(m, n) * extra * NS(U)     (--muon-extra-scale-factor)

- ``NS``: ``X = U / max(||U||_F, 1e-7)`` (transposed first when it has more rows than columns),
  then per step ``(a, b, c)``: ``A = X X^T``, ``X <- a X + (b A + c A A) X``; the coefficient
  table is ``--muon-coefficient-type``, run for ``--muon-num-ns-steps`` steps.
  ``--muon-fp32-matmul-prec medium`` runs the iteration in bfloat16 (as Megatron-Core does:
  torch has no fp32-in, bf16-compute matmul), ``high`` in fp32.
- ``scale(m, n)`` for an ``m x n`` (out x in) matrix, ``--muon-scale-mode``: ``spectral``
  ``sqrt(max(m, n))``, ``unit_rms_norm`` ``sqrt(m / n)``, ``shape_scaling``
  ``sqrt(max(1, m / n))``.
- ``--muon-split-qkv`` (the default): the fused query/key/value weight, whose rows are ordered
  per query group ``[groups, heads_per_group + 2, head_dim]``, is orthogonalised as three
  matrices (all queries, all keys, all values), each with its own scale.
- ``--muon-tp-mode duplicated`` (the default): a tensor-parallel shard is all-gathered into the
  whole matrix, orthogonalised on every rank and cut back, so the numbers do not depend on the
  tensor-parallel layout. ``blockwise`` (per-shard) and ``distributed`` are refused.
- ``--optimizer dist_muon`` (Megatron-Core's layer-wise distributed optimizer around Muon):
  whole parameters are dealt round-robin over the data-parallel ranks (one counter running
  through the groups, Muon's first), each rank steps only its own and keeps only their state,
  then every parameter is broadcast from its owner. Gradients are already averaged over the
  data-parallel ranks, so the weights are those of ``--optimizer muon``. Expert parameters are
  stepped by every rank (their gradients are averaged over the expert-data-parallel ranks
  only). A state dict is gathered whole on every rank (the same as Muon's), and a loaded one is
  cut back to this rank's share, so checkpoints move between the two and between DP sizes.
"""

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.optim.adam import adam as adam_update

from megatron.core.config import ConfigError
from megatron.optimizer.torch_base import OptimizerBase

# Newton-Schulz coefficients (a, b, c) per step, as Megatron-Core's --muon-coefficient-type.
COEFFICIENTS = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959),
            (2.7573, -3.2939, 1.4254), (2.7215, -3.0494, 1.3169)),
}
SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
NS_EPS = 1e-7


def ns_coefficients(kind: str, steps: int) -> List[Tuple[float, float, float]]:
    """The ``steps`` coefficient triples of table ``kind``: ``simple`` repeats its one triple,
    ``polar_express`` needs at least its 8 and repeats the last, the others repeat whole."""
    if kind not in COEFFICIENTS:
        raise ConfigError(f"--muon-coefficient-type must be one of {sorted(COEFFICIENTS)}, "
                          f"got {kind!r}")
    if steps < 1:
        raise ConfigError(f"--muon-num-ns-steps must be >= 1, got {steps}")
    table = list(COEFFICIENTS[kind])
    if kind == "simple":
        return table * steps
    if kind == "polar_express":
        if steps < len(table):
            raise ConfigError(f"--muon-num-ns-steps must be >= {len(table)} with "
                              f"--muon-coefficient-type polar_express, got {steps}")
        return table + [table[-1]] * (steps - len(table))
    if steps % len(table):
        raise ConfigError(f"--muon-num-ns-steps must be a multiple of {len(table)} with "
                          f"--muon-coefficient-type {kind}, got {steps}")
    return table * (steps // len(table))


def newton_schulz(x: torch.Tensor, coefficients, bf16: bool) -> torch.Tensor:
    """Approximate orthogonal polar factor of the 2-D fp32 ``x`` (same shape, fp32)."""
    wide = x.size(0) <= x.size(1)
    X = x if wide else x.mT
    X = X / X.norm().clamp_min(NS_EPS)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in coefficients:
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)   # b A + c A A
        X = torch.addmm(X, B, X, beta=a)             # a X + B X
    X = X.to(torch.float32)
    return X if wide else X.mT


def muon_scale(size_out: int, size_in: int, mode: str) -> float:
    """The update scale of an ``size_out x size_in`` matrix under ``--muon-scale-mode``."""
    if mode == "spectral":
        return math.sqrt(max(size_out, size_in))
    if mode == "unit_rms_norm":
        return math.sqrt(size_out / size_in)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, size_out / size_in))
    raise ConfigError(f"--muon-scale-mode must be one of {SCALE_MODES}, got {mode!r}")


class Muon(OptimizerBase):
    """Muon over groups marked ``use_muon``, torch's AdamW over the others.

    Groups carry ``lr`` and ``weight_decay`` (the scheduler sets them); Muon groups
    ``momentum`` and ``nesterov``, AdamW groups ``betas`` and ``eps``. State per parameter:
    ``momentum_buffer`` (Muon) or torch AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``, so a
    saved state dict is a plain torch one.

    Args:
        params: param groups; each with ``use_muon`` (default False).
        coefficient_type, num_ns_steps, scale_mode, extra_scale_factor, fp32_matmul_prec:
            the ``--muon-*`` flags of the same names.
        tp_group / expert_tp_group: where tensor-parallel shards (``tensor_model_parallel``
            with ``partition_dim``) of dense / expert (``allreduce = False``) weights are
            gathered from; None: one rank.
        dp_group: ``--optimizer dist_muon``'s data-parallel group the parameters are dealt
            over; None: every rank steps every parameter (``--optimizer muon``).
    """

    def __init__(self, params, *, lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.9, nesterov: bool = False,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 coefficient_type: str = "quintic", num_ns_steps: int = 5,
                 scale_mode: str = "spectral", extra_scale_factor: float = 1.0,
                 fp32_matmul_prec: str = "medium", tp_group=None, expert_tp_group=None,
                 dp_group=None):
        if fp32_matmul_prec not in ("medium", "high"):
            raise ConfigError("--muon-fp32-matmul-prec low is not built (the lowest precision "
                              "here is medium: the iteration in bfloat16); use medium or high")
        muon_scale(1, 1, scale_mode)
        self.coefficients = ns_coefficients(coefficient_type, num_ns_steps)
        self.scale_mode, self.extra_scale_factor = scale_mode, extra_scale_factor
        self.bf16 = fp32_matmul_prec == "medium"
        self.tp_group, self.expert_tp_group = tp_group, expert_tp_group
        self.dp_group = dp_group if dp_group is not None and dist.get_world_size(
            dp_group) > 1 else None
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        betas=betas, eps=eps, use_muon=False)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    if p.dim() != 2:
                        raise ValueError(f"Muon takes 2-D weights only, got shape "
                                         f"{tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        owners = self._owners()
        for group, row in zip(self.param_groups, owners):
            mine = [p for p, owner in zip(group["params"], row) if self._is_mine(owner)]
            if group["use_muon"]:
                self._muon_step(group, mine)
            else:
                self._adam_step(group, mine)
        if self.dp_group is not None:
            for group, row in zip(self.param_groups, owners):
                for p, owner in zip(group["params"], row):
                    if owner >= 0:
                        dist.broadcast(p.data, dist.get_global_rank(self.dp_group, owner),
                                       group=self.dp_group)
        return None

    # -- the layer-wise deal (dist_muon) ---------------------------------------------------

    def _owners(self) -> List[List[int]]:
        """The data-parallel rank stepping each parameter, group by group: dense parameters
        round-robin (one counter through all groups), -1 for every rank (expert parameters,
        or no ``dp_group``)."""
        size = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        owners, count = [], 0
        for group in self.param_groups:
            row = []
            for p in group["params"]:
                if self.dp_group is None or not getattr(p, "allreduce", True):
                    row.append(-1)
                else:
                    row.append(count % size)
                    count += 1
            owners.append(row)
        return owners

    def _is_mine(self, owner: int) -> bool:
        return owner < 0 or owner == dist.get_rank(self.dp_group)

    def _share_state(self, p: torch.Tensor, use_muon: bool, owner: int) -> None:
        """Broadcast ``p``'s state from its owner (nothing when it has none yet)."""
        src = dist.get_global_rank(self.dp_group, owner)
        mine = self._is_mine(owner)
        state = self.state[p] if mine else {}
        present = torch.tensor([1.0 if state else 0.0], device=p.device)
        dist.broadcast(present, src, group=self.dp_group)
        if not present.item():
            self.state.pop(p, None)
            return
        fields = ("momentum_buffer",) if use_muon else ("exp_avg", "exp_avg_sq")
        if not mine:
            state = {field: torch.empty_like(p) for field in fields}
        for field in fields:
            dist.broadcast(state[field], src, group=self.dp_group)
        if not use_muon:
            step = torch.tensor([float(state["step"]) if mine else 0.0], device=p.device)
            dist.broadcast(step, src, group=self.dp_group)
            state["step"] = torch.tensor(step.item(), dtype=torch.float32)
        self.state[p] = state

    def _keep_own_state(self) -> None:
        for group, row in zip(self.param_groups, self._owners()):
            for p, owner in zip(group["params"], row):
                if not self._is_mine(owner):
                    self.state.pop(p, None)

    def state_dict(self) -> dict:
        """Torch's state dict; with ``dp_group``, collective: every parameter's state gathered
        from its owner, so it is the state dict ``--optimizer muon`` would hold."""
        if self.dp_group is None:
            return super().state_dict()
        for group, row in zip(self.param_groups, self._owners()):
            for p, owner in zip(group["params"], row):
                if owner >= 0:
                    self._share_state(p, group["use_muon"], owner)
        saved = super().state_dict()
        self._keep_own_state()
        return saved

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self.dp_group is not None:
            self._keep_own_state()

    def _muon_step(self, group: dict, params: List[torch.Tensor]) -> None:
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        for p in params:
            if p.grad is None:
                continue
            grad = p.grad
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            if wd != 0.0:
                p.add_(p, alpha=-lr * wd)
            buf.lerp_(grad, 1.0 - beta)
            update = grad.lerp(buf, beta) if group["nesterov"] else buf
            p.add_(self.orthogonalize(p, update.float()).to(p.dtype), alpha=-lr)

    def _adam_step(self, group: dict, mine: List[torch.Tensor]) -> None:
        params, grads, avgs, avg_sqs, steps = [], [], [], [], []
        for p in mine:
            if p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam_update(params, grads, avgs, avg_sqs, [], steps, foreach=False,
                    decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                    lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False)

    def orthogonalize(self, p: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
        """The scaled, orthogonalised ``update`` of parameter ``p`` (this rank's piece)."""
        group, dim = self._shard_group(p)
        full = gather_shards(update, group, dim)
        return own_shard(self.orthogonalize_full(p, full), group, dim)

    def orthogonalize_full(self, p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The scaled, orthogonalised update of ``p``'s whole matrix ``full`` (the fused
        query/key/value weight as its three parts, with ``muon_qkv_split``)."""
        split = getattr(p, "muon_qkv_split", None)
        if split is None:
            return self._orthogonalize_matrix(full)
        rows = sum(split)
        if full.size(0) % rows:
            raise ValueError(f"--muon-split-qkv: {full.size(0)} rows are not whole query "
                             f"groups of {split}")
        cols = full.size(1)
        per_group = full.view(full.size(0) // rows, rows, cols)
        parts = [self._orthogonalize_matrix(part.reshape(-1, cols))
                 .view(per_group.size(0), -1, cols)
                 for part in torch.split(per_group, list(split), dim=1)]
        return torch.cat(parts, dim=1).view_as(full)

    def _shard_group(self, p: torch.Tensor):
        """(group, dim) a tensor-parallel shard of ``p`` is cut along, or (None, None)."""
        if not getattr(p, "tensor_model_parallel", False):
            return None, None
        dim = getattr(p, "partition_dim", -1)
        group = self.tp_group if getattr(p, "allreduce", True) else self.expert_tp_group
        if dim not in (0, 1) or group is None or dist.get_world_size(group) == 1:
            return None, None
        return group, dim

    def _orthogonalize_matrix(self, full: torch.Tensor) -> torch.Tensor:
        scale = muon_scale(full.size(0), full.size(1), self.scale_mode) * self.extra_scale_factor
        return newton_schulz(full, self.coefficients, self.bf16) * scale


def gather_shards(local: torch.Tensor, group, dim) -> torch.Tensor:
    """The whole matrix of which ``local`` is this rank's piece along ``dim`` of ``group``
    (``local`` itself when ``group`` is None)."""
    if group is None:
        return local
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)


def own_shard(full: torch.Tensor, group, dim) -> torch.Tensor:
    """This rank's piece of ``full`` along ``dim`` of ``group`` (``full`` when None)."""
    if group is None:
        return full
    return full.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


def check_muon_settings(settings) -> None:
    """Refuse, in one line each, the Muon settings not built here or out of range.

    ``settings``: anything with Megatron's dests as attributes (the parsed args, or an
    ``OptimizerConfig``): ``optimizer``, ``muon_*``, ``use_distributed_optimizer``, ``fp16``.
    """
    if settings.muon_tp_mode != "duplicated":
        raise ConfigError(f"--muon-tp-mode {settings.muon_tp_mode} is not built: its numbers "
                          "depend on the tensor-parallel layout; use --muon-tp-mode duplicated")
    if settings.muon_use_syrk:
        raise ConfigError("--muon-use-syrk (a Triton kernel) is not built; drop it")
    if settings.muon_scalar_optimizer != "adam":
        raise ConfigError(f"--muon-scalar-optimizer {settings.muon_scalar_optimizer} is not "
                          "built; use adam")
    if settings.use_distributed_optimizer and settings.optimizer in ("muon", "dist_muon"):
        raise ConfigError("--optimizer muon does not run with --use-distributed-optimizer "
                          "(Muon needs each weight matrix whole); drop the flag")
    if settings.fp16:
        raise ConfigError("--optimizer muon does not run with --fp16 (no loss scaling for "
                          "Muon, as in Megatron-Core); use --bf16")
    if settings.muon_fp32_matmul_prec not in ("medium", "high"):
        raise ConfigError("--muon-fp32-matmul-prec low is not built (the lowest precision "
                          "here is medium: the iteration in bfloat16); use medium or high")
    if not 0.0 <= settings.muon_momentum < 1.0:
        raise ConfigError(f"--muon-momentum must be in [0, 1), got {settings.muon_momentum}")
    ns_coefficients(settings.muon_coefficient_type, settings.muon_num_ns_steps)
    muon_scale(1, 1, settings.muon_scale_mode)


def mark_qkv_weights(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Mark each fused query/key/value weight with ``muon_qkv_split``: its rows per query group
    (queries of the group's heads, their output gates with --attention-output-gate, key,
    value)."""
    for chunk in model_chunks:
        for module in chunk.modules():
            qkv = getattr(module, "query_key_value", None)
            per_group = getattr(module, "heads_per_group", None)
            head_dim = getattr(module, "hidden_size_per_head", None)
            if qkv is None or per_group is None or head_dim is None:
                continue
            weight = getattr(qkv, "weight", None)
            if weight is not None and weight.dim() == 2:
                queries = (per_group * head_dim,) * (2 if getattr(module, "output_gate", False)
                                                     else 1)
                weight.muon_qkv_split = (*queries, head_dim, head_dim)


def split_muon_groups(param_groups: List[dict]) -> List[dict]:
    """``param_groups`` with each group cut into its Muon part (2-D, not embedding or output)
    and its AdamW part, Muon parts first, empty parts dropped."""
    muon, adam = [], []
    for group in param_groups:
        mine = [p for p in group["params"] if _takes_muon(p)]
        rest = [p for p in group["params"] if not _takes_muon(p)]
        if mine:
            muon.append(dict(group, params=mine, use_muon=True))
        if rest:
            adam.append(dict(group, params=rest, use_muon=False))
    return muon + adam


def _takes_muon(p: torch.Tensor) -> bool:
    return p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False)


def build_muon(config, param_groups: List[dict], tp_group=None,
               expert_tp_group=None, dp_group=None) -> Muon:
    """The :class:`Muon` optimizer of ``config`` (an ``OptimizerConfig``) over
    ``param_groups`` (already split by :func:`split_muon_groups`); ``dp_group`` is read for
    ``--optimizer dist_muon`` only."""
    return Muon(param_groups, lr=config.lr, weight_decay=config.weight_decay,
                momentum=config.muon_momentum, nesterov=config.muon_nesterov,
                betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                coefficient_type=config.muon_coefficient_type,
                num_ns_steps=config.muon_num_ns_steps, scale_mode=config.muon_scale_mode,
                extra_scale_factor=config.muon_extra_scale_factor,
                fp32_matmul_prec=config.muon_fp32_matmul_prec, tp_group=tp_group,
                expert_tp_group=expert_tp_group,
                dp_group=dp_group if config.optimizer == "dist_muon" else None)
