"""The router of a mixture-of-experts layer: which experts each token goes to, with what weight.

``logits = x W^T + b`` with ``W`` ``[num_experts, h]`` and, with ``add_bias_linear`` (as in
Megatron-Core; gpt-oss's router has one), a trained bias ``b`` ``[num_experts]``
(``router.bias``). The probabilities:

* softmax (default): the top-k logits, then a softmax over those k, so a token's weights sum
  to 1 over its chosen experts; with ``--moe-router-pre-softmax`` a softmax over all experts,
  then the top-k of those probabilities (which sum to less than 1);
* sigmoid: the top-k of ``sigmoid(logits)``, divided by their sum when k > 1;
* sqrtsoftplus (DeepSeek-V4): the same with ``sqrt(softplus(logits))`` as the scores;
* ``--moe-router-topk-scaling-factor`` multiplies the result.

``--moe-router-num-groups G --moe-router-group-topk g`` limits each token to the experts of its
best g of G groups (DeepSeek-V3). ``--moe-router-enable-expert-bias`` (sigmoid or
sqrtsoftplus) adds a per-expert bias to the scores to choose the experts, not to weigh them; the
bias is not trained but moved by ``--moe-router-bias-update-rate`` after each step towards
equal load (:func:`update_expert_biases`). ``--moe-router-dtype fp32|fp64`` computes the
router's logits and probabilities in that precision.

The chosen experts are listed in descending score order. Load balancing
(``--moe-router-load-balancing-type``): ``aux_loss`` adds the Switch-Transformer loss
``E * sum_e f_e P_e`` (f_e: share of the token choices routed to expert e, P_e: mean over tokens
of e's score over all experts; logged as ``load_balancing_loss``), ``seq_aux_loss`` the same per
sequence averaged over sequences (``seq_load_balancing_loss``),
``global_aux_loss`` (Megatron-Core's global load balancing) the same ``f_e`` counted over every
data x context (x sequence-slicing tensor) parallel rank and averaged over the step's
micro-batches so far (:func:`global_load_balancing_loss`, logged as
``global_load_balancing_loss``), ``sinkhorn`` picks experts from Sinkhorn-balanced logits
while training, ``none`` nothing. Several of the three losses may be given at once
(``--moe-router-load-balancing-type aux_loss global_aux_loss --moe-aux-loss-coeff 1e-3 1e-4``):
each is attached with its own coefficient and logged under its own name.
``--moe-z-loss-coeff`` adds ``mean_t logsumexp(logits_t)^2``. Both losses are computed only in
training with gradients on, and reach the gradients through
:func:`~megatron.model.moe.tracker.attach_aux_loss`.

The benchmark switches ``--moe-router-force-load-balancing`` and ``--moe-router-force-biased``
replace the logits by random draws before routing (:mod:`~megatron.model.moe.forced_logits`).

Scores and probabilities are computed in at least float32 and returned in the logits' dtype.
Tokens are the ``[s, b]`` positions flattened in that order (token ``i * b + j`` is position
``i`` of sequence ``j``).
"""

import math
from typing import Optional, Tuple

import torch

from megatron.core import device
from megatron.core.collectives import all_gather_into_tensor, all_reduce, get_group_size
from megatron.core.config import TransformerConfig
from megatron.core.utils import get_init_method
from megatron.model.moe.config import AUX_LOSS_NAMES, MoEConfig
from megatron.model.moe.forced_logits import ForcedLogits
from megatron.model.moe.tracker import MoELossTracker, attach_aux_loss
from megatron.model.moe.router_replay import RouterReplay
from megatron.model.utils import init_rng

SINKHORN_TOLERANCE = 1e-4
ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def _score_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``scores [T, E]`` among the experts of each token's best ``group_topk`` groups.

    The ``E`` experts form ``num_groups`` consecutive groups; a group's score is the sum of its
    best ``topk / group_topk`` scores; experts outside the token's chosen groups count as
    ``-inf``. Returns (values, expert ids), each ``[T, k]``, best first."""
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)     # [T, G]
    chosen = torch.topk(group_scores, group_topk, dim=-1).indices                  # [T, g]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)  # [T, E]
    return torch.topk(scores.masked_fill(~keep, float("-inf")), topk, dim=-1)


def _topk(scores: torch.Tensor, topk: int, num_groups: Optional[int],
          group_topk: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    if num_groups:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax",
                 pre_softmax: bool = False, scaling_factor: Optional[float] = None,
                 num_groups: Optional[int] = None, group_topk: Optional[int] = None,
                 expert_bias: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (probabilities ``[T, k]``, expert ids ``[T, k]``), best first.

    ``num_groups`` / ``group_topk``: group-limited routing (:func:`group_limited_topk`).
    ``expert_bias`` ``[E]`` (sigmoid only): added to the scores to choose the experts, never to
    their probabilities."""
    dtype = _score_dtype(logits)
    if score_function == "softmax":
        if pre_softmax:
            probs, indices = _topk(torch.softmax(logits, dim=-1, dtype=dtype), topk,
                                   num_groups, group_topk)
        else:
            top, indices = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top, dim=-1, dtype=dtype)
    elif score_function in ("sigmoid", "sqrtsoftplus"):
        scores = _pointwise_scores(logits.to(dtype), score_function)
        if expert_bias is None:
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        else:
            _, indices = _topk(scores + expert_bias.to(dtype), topk, num_groups, group_topk)
            probs = torch.gather(scores, 1, indices)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"--moe-router-score-function must be softmax, sigmoid or "
                         f"sqrtsoftplus, got {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    return probs.to(logits.dtype), indices


def probs_of_chosen(logits: torch.Tensor, indices: torch.Tensor, score_function: str = "softmax",
                    pre_softmax: bool = False, scaling_factor: Optional[float] = None
                    ) -> torch.Tensor:
    """The probabilities ``[T, k]`` of experts ``indices [T, k]`` chosen by other means than
    the top-k of the scores (quantile balancing), as :func:`topk_routing` weighs its own
    choice: softmax over the chosen logits (over all of them with ``pre_softmax``), or the
    chosen sigmoid / sqrtsoftplus scores divided by their sum when k > 1; times
    ``scaling_factor``."""
    dtype = _score_dtype(logits)
    if score_function == "softmax":
        if pre_softmax:
            probs = torch.gather(torch.softmax(logits, dim=-1, dtype=dtype), 1, indices)
        else:
            probs = torch.softmax(torch.gather(logits, 1, indices), dim=-1, dtype=dtype)
    else:
        probs = torch.gather(_pointwise_scores(logits.to(dtype), score_function), 1, indices)
        if indices.size(1) > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    return probs.to(logits.dtype)


def quantile_choice(logits: torch.Tensor, topk: int,
                    beta: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantile balancing (Megatron-Core's dual update): ``logits [T, E]`` (float32), the
    per-expert bias ``beta [E]`` -> (each token's experts ``[T, k]``: the top k of
    ``logits - beta``; this batch's bias ``[E]``). Token t's threshold ``a_t`` is its
    (k+1)-th largest ``logits - beta``; expert e's new bias is the ``(T k // E + 1)``-th
    largest of ``logits[:, e] - a`` over the tokens, the value that would let about
    ``T k / E`` tokens (the balanced load) choose e."""
    num_tokens, num_experts = logits.shape
    top = torch.topk(logits - beta, topk + 1, dim=1)
    target = num_tokens * topk // num_experts
    threshold = top.values[:, -1:]
    batch_beta = torch.topk(logits - threshold, target + 1, dim=0).values[-1]
    return top.indices[:, :-1], batch_beta


def updated_quantile_bias(beta: torch.Tensor, batch_beta: torch.Tensor,
                          ema: float) -> torch.Tensor:
    """The bias after a step: ``ema * beta + (1 - ema) * batch_beta`` (``batch_beta``: the
    step's mean batch bias), shifted to mean zero over the experts (last dimension)."""
    new = ema * beta + (1.0 - ema) * batch_beta
    return new - new.mean(dim=-1, keepdim=True)


def _pointwise_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Each expert's score on its own: ``sigmoid(x)``, or ``sqrt(softplus(x))`` (sqrtsoftplus,
    DeepSeek-V4's score: positive, unbounded, close to ``sqrt(x)`` for large ``x``)."""
    if score_function == "sigmoid":
        return torch.sigmoid(logits)
    return torch.nn.functional.softplus(logits).sqrt()


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Every expert's score of every token, ``[T, E]``, each row summing to 1: the softmax of the
    logits, or their sigmoid (sqrtsoftplus) divided by its row sum. Float32 or wider."""
    dtype = _score_dtype(logits)
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=dtype)
    scores = _pointwise_scores(logits.to(dtype), score_function)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                               topk: int) -> torch.Tensor:
    """``E * sum_e f_e P_e`` with ``f_e = n_e / (k T)`` and ``P_e = sum_t scores[t, e] / T``;
    1 for perfectly balanced routing.

    Args:
        scores: ``[T, E]`` (:func:`scores_for_aux_loss`).
        tokens_per_expert: ``[E]``, the number of the ``k T`` token choices that picked each
            expert (before any capacity drop).
        topk: k.
    """
    num_tokens, num_experts = scores.shape
    per_expert = scores.sum(dim=0)                                           # [E]
    return (per_expert * tokens_per_expert.to(scores.dtype)).sum() * (
        num_experts / (topk * num_tokens * num_tokens))


def sequence_load_balancing_loss(scores: torch.Tensor, routing_map: torch.Tensor,
                                 seq_length: int, batch: int, topk: int) -> torch.Tensor:
    """:func:`switch_load_balancing_loss` of each sequence on its own, averaged over the batch.

    Args:
        scores: ``[s * b, E]`` in the ``[s, b]`` token order.
        routing_map: ``[s * b, E]`` bool, the top-k choices before any capacity drop.
    """
    num_experts = scores.size(1)
    per_seq_scores = scores.view(seq_length, batch, num_experts).sum(dim=0)        # [b, E]
    per_seq_counts = routing_map.view(seq_length, batch, num_experts).sum(dim=0)   # [b, E]
    total = (per_seq_scores * per_seq_counts.to(scores.dtype)).sum()
    return total * (num_experts / (topk * seq_length * seq_length)) / batch


def _switch_share(scores: torch.Tensor, counts: torch.Tensor, topk: int,
                  total: int) -> torch.Tensor:
    """This rank's share of the switch loss of ``total`` tokens spread over several ranks: its
    tokens' scores ``[T, E]`` against the token choices ``counts [E]`` of all ``total``."""
    num_experts = scores.size(1)
    per_expert = scores.sum(dim=0)                                           # [E]
    return (per_expert * counts.to(scores.dtype)).sum() * (
        num_experts / (topk * total * total))


def global_load_balancing_loss(scores: torch.Tensor, mean_counts: torch.Tensor, topk: int,
                               num_ranks: int) -> torch.Tensor:
    """One rank's term of Megatron-Core's ``global_aux_loss`` (before its coefficient):
    ``E / (k N^2) * sum_e S_e c_e`` with ``S_e`` this rank's scores of expert e summed over its
    ``T`` tokens, ``c_e`` the token choices of expert e counted over all ``num_ranks`` ranks of
    the data x context (x sequence-slicing tensor) parallel group and averaged over the
    micro-batches of the step so far, and ``N = T * num_ranks``. The sum of the terms over the
    group is the switch loss of the whole global micro-batch.

    Megatron-Core attaches each rank's term as it is, and data-parallel ranks average their
    gradients: at DP size d the loss's gradient is 1/d of the one-process run's over the same
    tokens (the value logged, the sum of the terms, does not change). That is its definition
    and is kept here, so a launch configuration trains as under Megatron-LM; it is not
    layout-invariant over DP (context parallelism is, as for ``aux_loss``).
    """
    return _switch_share(scores, mean_counts, topk, num_ranks * scores.size(0))


def _sequence_loss_share(scores: torch.Tensor, counts: torch.Tensor, seq_length: int,
                         batch: int, topk: int) -> torch.Tensor:
    """This rank's share of :func:`sequence_load_balancing_loss`: its tokens' scores
    (``[s / cp * b, E]``) against each whole sequence's counts ``[b, E]`` (``seq_length``: the
    whole sequence)."""
    num_experts = scores.size(1)
    per_seq_scores = scores.view(-1, batch, num_experts).sum(dim=0)                 # [b, E]
    total = (per_seq_scores * counts.to(scores.dtype)).sum()
    return total * (num_experts / (topk * seq_length * seq_length)) / batch


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2`` (ST-MoE's router z-loss, before its coefficient)."""
    return torch.logsumexp(logits.to(_score_dtype(logits)), dim=-1).square().mean()


def sinkhorn(logits: torch.Tensor, tol: float = SINKHORN_TOLERANCE,
             max_iterations: int = 10_000) -> torch.Tensor:
    """``exp(logits) [T, E]`` scaled by one factor per token and one per expert so that rows sum
    to ``1 / T`` and columns to ``1 / E``: alternate the two normalisations (columns starting
    at factor 1) until the expert factors change by less than ``tol`` on average."""
    cost = torch.exp(logits)
    num_tokens, num_experts = cost.shape
    eps = 1e-8
    expert_factor = torch.ones(num_experts, dtype=cost.dtype, device=cost.device)
    for _ in range(max_iterations):
        token_factor = 1.0 / (num_tokens * ((cost * expert_factor).sum(dim=1) + eps))
        new = 1.0 / (num_experts * ((cost * token_factor.unsqueeze(1)).sum(dim=0) + eps))
        change = (new - expert_factor).abs().mean()
        expert_factor = new
        if change <= tol:
            break
    return cost * token_factor.unsqueeze(1) * expert_factor


def expert_capacity(num_tokens: int, num_experts: int, topk: int,
                    capacity_factor: float) -> int:
    """Token choices one expert takes from one rank: ``ceil(T k / E * factor)``."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int,
                       policy: str) -> torch.Tensor:
    """The routing map ``[T, E]`` with at most ``capacity`` tokens left per expert.

    ``probs`` keeps each expert's highest routing probabilities; ``position`` its earliest
    tokens (in the ``[s, b]`` token order)."""
    if capacity >= routing_map.size(0):
        return routing_map
    if policy == "probs":
        # Unrouted entries rank below every routed one, whatever its probability.
        ranked = probs.detach().masked_fill(~routing_map, -1.0)
        chosen = torch.topk(ranked, capacity, dim=0).indices                  # [C, E]
        within = torch.zeros_like(routing_map).scatter(0, chosen, True)
        return routing_map & within
    if policy == "position":
        return routing_map & (routing_map.long().cumsum(dim=0) <= capacity)
    raise ValueError(f"--moe-token-drop-policy must be probs or position, got {policy!r}")


def _scatter_to_experts(values: torch.Tensor, indices: torch.Tensor,
                        num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[T, k]`` choices -> dense ``[T, E]`` probabilities and bool map."""
    shape = (values.size(0), num_experts)
    probs = torch.zeros(shape, dtype=values.dtype, device=values.device).scatter(1, indices,
                                                                                 values)
    chosen = torch.zeros(shape, dtype=torch.bool, device=values.device).scatter(1, indices, True)
    return probs, chosen


class TopKRouter(torch.nn.Module):
    """``[s, b, h]`` -> routing probabilities ``[s*b, E]`` (zero where not routed) and the bool
    routing map ``[s*b, E]``, after any capacity drop.

    Args:
        config: the transformer config (hidden size, init, params dtype).
        moe_config: the MoE settings.
        layer_number: 1-based global layer number (logging, and the initialisation seed).
        tracker: where the auxiliary losses are logged, and their gradient scale; None: not
            logged, scale 1.
        init_seed: the model's initialisation seed; the weight depends on it and on the layer
            number only.
        cp_group: the context-parallel group (None: whole sequences here). With more than one
            rank the load-balancing loss counts the token choices of the whole sequence (summed
            over the group), each rank adding its own tokens' scores: the sum over the group
            of each rank's value is the one-rank loss, so each rank records and attaches its
            value times the group size (the gradients and the logged values are averaged over
            data x context-parallel ranks). The z loss is a mean over equally many tokens per
            rank and needs nothing. Sinkhorn and capacity dropping, which depend on which
            tokens share a rank, are refused.
        sp_group: the tensor-parallel group when its ranks each route their own slice of the
            sequence (sequence parallelism with an expert-TP size other than TP); None: this
            rank routes all of it (up to CP). The load-balancing loss then counts over this
            group too, but the router's gradients are summed over it (the weight is marked
            ``sequence_parallel``), so each rank attaches its own share, and the z loss its
            mean divided by the group size; the recorded values are the group's totals, so
            every rank logs what one rank would. Sinkhorn and capacity dropping are refused
            here as well.
    """

    def __init__(self, config: TransformerConfig, moe_config: MoEConfig, layer_number: int,
                 tracker: Optional[MoELossTracker] = None, init_seed: int = 1234,
                 cp_group=None, sp_group=None, dp_group=None):
        super().__init__()
        self.dp_group = dp_group
        self.dp_size = get_group_size(dp_group)
        self.cp_group = cp_group
        self.cp_size = get_group_size(cp_group)
        self.sp_group = sp_group
        self.sp_size = get_group_size(sp_group)
        for size, why in ((self.cp_size, "--context-parallel-size > 1"),
                          (self.sp_size, "--sequence-parallel and an "
                                         "--expert-tensor-parallel-size other than TP")):
            if size == 1:
                continue
            if moe_config.uses_sinkhorn:
                raise ValueError("--moe-router-load-balancing-type sinkhorn balances the tokens "
                                 f"of one rank; with {why} it would route differently from one "
                                 "rank: use aux_loss, seq_aux_loss or none")
            if moe_config.drops_tokens:
                raise ValueError("--moe-expert-capacity-factor drops tokens by the capacity of "
                                 f"one rank's tokens; with {why} it would drop other tokens "
                                 "than one rank: drop the flag")
        self.moe_config = moe_config
        self.per_token_loss = config.calculate_per_token_loss
        self.layer_number = layer_number
        self.router_replay = RouterReplay() if moe_config.moe_enable_routing_replay else None
        self.forced_logits = ForcedLogits(moe_config, init_seed, layer_number)
        self.tracker = tracker
        self.num_experts = moe_config.num_moe_experts
        self.topk = moe_config.moe_router_topk
        master_dtype = torch.promote_types(config.params_dtype, torch.float32)
        master = torch.empty(self.num_experts, config.hidden_size, dtype=master_dtype)
        bias = master.new_empty(self.num_experts) if config.add_bias_linear else None
        with init_rng(init_seed, f"layer.{layer_number - 1}.mlp.router"):
            get_init_method(config)(master)
            if bias is not None:   # drawn after the weight, which stays what it was
                torch.nn.init.normal_(bias, mean=0.0, std=config.init_method_std)
        self.weight = torch.nn.Parameter(master.to(device=device.current_device(),
                                                   dtype=config.params_dtype))
        self.bias = None if bias is None else torch.nn.Parameter(
            bias.to(device=device.current_device(), dtype=config.params_dtype))
        for param in (self.weight, self.bias):
            if param is not None and self.sp_size > 1:
                param.sequence_parallel = True
        self.router_dtype = ROUTER_DTYPES.get(moe_config.moe_router_dtype)
        if moe_config.moe_router_enable_expert_bias:
            # Megatron-Core's buffers: the bias is saved (``...router.expert_bias``), the token
            # choices counted since the last bias update are not.
            self.register_buffer("expert_bias", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device.current_device()))
            self.register_buffer("local_tokens_per_expert", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device.current_device()),
                persistent=False)
        else:
            self.expert_bias = None
        if moe_config.uses_quantile_balancing:
            # Megatron-Core's buffers: the bias is saved (``...router.qb_beta``); the batch
            # biases summed since the last update and their number are not.
            self.register_buffer("qb_beta", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device.current_device()))
            self.register_buffer("qb_beta_accum", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device.current_device()),
                persistent=False)
            self.register_buffer("qb_beta_count", torch.zeros(
                (), dtype=torch.long, device=device.current_device()), persistent=False)
        else:
            self.qb_beta = None
        if moe_config.aux_loss_coeff("global_aux_loss"):
            # Megatron-Core's running sums of a step (not saved): the token choices counted
            # over the global micro-batches so far, and how many there were.
            self.register_buffer("global_tokens_per_expert", torch.zeros(
                self.num_experts, dtype=torch.float32, device=device.current_device()),
                persistent=False)
            self.register_buffer("ga_steps", torch.zeros(
                (), dtype=torch.float32, device=device.current_device()), persistent=False)
        else:
            self.global_tokens_per_expert = None

    def reset_global_aux_loss_tracker(self) -> None:
        """Start a new step's running average of ``global_aux_loss`` (after each step)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.ga_steps.zero_()

    def _global_loss_share(self, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's ``global_aux_loss`` term (:func:`global_load_balancing_loss`); the running
        average takes this micro-batch's counts over the whole group."""
        counts = self._count_over_sequence(counts.to(torch.float32))
        if self.dp_size > 1:
            all_reduce(counts, self.dp_group)
        with torch.no_grad():
            self.global_tokens_per_expert += counts
            self.ga_steps += 1
        mean_counts = self.global_tokens_per_expert / self.ga_steps
        ranks = self.dp_size * self.cp_size * self.sp_size
        return global_load_balancing_loss(scores, mean_counts, self.topk, ranks)

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.half()``...: the expert and quantile biases and their sums stay float32
        (a bf16 bias could not take small update steps, and the checkpoint keeps it in
        float32)."""
        module = super()._apply(fn, *args, **kwargs)
        for name in ("expert_bias", "local_tokens_per_expert", "qb_beta", "qb_beta_accum"):
            buffer = self._buffers.get(name)
            if buffer is not None and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return module

    def gating(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> logits ``[s, b, E]``; in training, with ``--moe-input-jitter-eps``,
        the input is first multiplied by noise drawn uniformly from ``[1 - eps, 1 + eps]``."""
        eps = self.moe_config.moe_input_jitter_eps
        if eps is not None and self.training:
            noise = torch.empty_like(hidden_states).uniform_(1.0 - eps, 1.0 + eps)
            hidden_states = hidden_states * noise
        return self.logits(hidden_states)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., h]`` -> ``[..., E]``: the linear map alone (no input jitter, so no random
        draw: the routing trace recomputes a router's logits with it)."""
        if self.router_dtype is not None:
            hidden_states = hidden_states.to(self.router_dtype)
        bias = None if self.bias is None else self.bias.to(hidden_states.dtype)
        return torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype),
                                          bias)

    def _losses_on(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _record(self, name: str, value: torch.Tensor) -> None:
        if self.tracker is not None:
            self.tracker.record(name, self.layer_number, value)

    def _with_z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        coeff = self.moe_config.moe_z_loss_coeff
        if coeff is None or not self._losses_on():
            return logits
        value = z_loss(logits) / self.sp_size
        self._record("z_loss", self._over_sequence_group(value))
        return attach_aux_loss(logits, self._per_token(value * coeff, logits.size(0)),
                               self.tracker)

    def _per_token(self, loss: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The attached ``loss`` under ``--calculate-per-token-loss``, as Megatron-Core scales
        it: the gradients are divided by the global batch's token count instead of by the
        micro-batches and data-parallel ranks, so the loss is multiplied by ``num_tokens``,
        the token rows this rank routed (the local sequence length for ``seq_aux_loss``), and
        divided by the context-parallel size that the attached values here carry (Megatron-Core
        puts that factor into the scale of the averaged case instead)."""
        if not self.per_token_loss:
            return loss
        return loss * (num_tokens / self.cp_size)

    def _over_sequence_group(self, share: torch.Tensor) -> torch.Tensor:
        """A value to record from this rank's ``share`` of a loss: summed over ``sp_group``."""
        if self.sp_size == 1:
            return share
        return all_reduce(share.detach().clone(), self.sp_group)

    def _count_over_sequence(self, counts: torch.Tensor) -> torch.Tensor:
        """Token choices summed over the ranks holding other parts of the same sequences."""
        for size, group in ((self.cp_size, self.cp_group), (self.sp_size, self.sp_group)):
            if size > 1:
                all_reduce(counts, group)
        return counts

    def _with_load_balancing_loss(self, probs: torch.Tensor, logits: torch.Tensor,
                                  indices: torch.Tensor, seq_length: int,
                                  batch: int) -> torch.Tensor:
        """``probs`` with each balancing loss of ``--moe-router-load-balancing-type`` that has a
        non-zero coefficient attached (aux_loss, seq_aux_loss, global_aux_loss, in this order,
        as Megatron-Core attaches them), each logged under its own name."""
        cfg = self.moe_config
        kinds = [kind for kind in AUX_LOSS_NAMES if cfg.aux_loss_coeff(kind)]
        if not kinds or not self._losses_on():
            return probs
        scores = scores_for_aux_loss(logits, cfg.moe_router_score_function)
        for kind in kinds:
            coeff = cfg.aux_loss_coeff(kind)
            if kind == "global_aux_loss":
                counts = self._choice_counts(indices)
                # Logged: the sum of the group's terms, which the logging's mean over data x
                # context-parallel ranks recovers from each rank's term times dp x cp.
                value = self._global_loss_share(scores, counts)
                self._record(AUX_LOSS_NAMES[kind],
                             self.dp_size * self.cp_size * self._over_sequence_group(value))
                probs = attach_aux_loss(
                    probs, self._per_token(self.cp_size * value * coeff, scores.size(0)),
                    self.tracker)
                continue
            if kind == "aux_loss":
                value, num_tokens = self._switch_loss(scores, indices), scores.size(0)
            else:
                value = self._sequence_loss(scores, probs, indices, seq_length, batch)
                num_tokens = seq_length
            self._record(AUX_LOSS_NAMES[kind], self._over_sequence_group(value))
            probs = attach_aux_loss(probs, self._per_token(value * coeff, num_tokens),
                                    self.tracker)
        return probs

    def _choice_counts(self, indices: torch.Tensor) -> torch.Tensor:
        """``[E]``: how many of this rank's token choices picked each expert."""
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=indices.device)
        return counts.scatter_add_(0, indices.flatten(), torch.ones_like(indices.flatten()))

    def _switch_loss(self, scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """This rank's ``aux_loss`` value (its share times cp when the sequence is split)."""
        counts = self._choice_counts(indices)
        ranks = self.cp_size * self.sp_size
        if ranks == 1:
            return switch_load_balancing_loss(scores, counts, self.topk)
        counts = self._count_over_sequence(counts)
        return self.cp_size * _switch_share(scores, counts, self.topk, ranks * scores.size(0))

    def _sequence_loss(self, scores: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor,
                       seq_length: int, batch: int) -> torch.Tensor:
        """This rank's ``seq_aux_loss`` value (its share times cp when the sequence is split)."""
        _, chosen = _scatter_to_experts(probs.detach(), indices, self.num_experts)
        ranks = self.cp_size * self.sp_size
        if ranks == 1:
            return sequence_load_balancing_loss(scores, chosen, seq_length, batch, self.topk)
        chosen = chosen.view(seq_length, batch, self.num_experts).sum(dim=0)        # [b, E]
        chosen = self._count_over_sequence(chosen)
        return self.cp_size * _sequence_loss_share(scores, chosen, seq_length * ranks, batch,
                                                   self.topk)

    def _sinkhorn_routing(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        dtype = _score_dtype(logits)
        if self.topk == 1:
            scores = torch.sigmoid(logits.to(dtype))
        else:
            scores = torch.softmax(logits, dim=-1, dtype=dtype)
        if self.training:
            with torch.no_grad():
                indices = torch.topk(sinkhorn(logits.detach().to(dtype)), self.topk,
                                     dim=-1).indices
        else:
            indices = torch.topk(scores, self.topk, dim=-1).indices
        return torch.gather(scores, 1, indices).to(logits.dtype), indices

    def _quantile_indices(self, logits: torch.Tensor) -> torch.Tensor:
        """Quantile balancing: each token's experts, the top k of ``logits - qb_beta``; in
        training with gradients on, this micro-batch's batch bias (over the whole sequence:
        the logits gathered over the context- and sequence-splitting ranks) is added to
        ``qb_beta_accum`` (:func:`update_quantile_biases` uses it after the step)."""
        accumulate = self._losses_on()
        with torch.no_grad():
            local = logits.detach().float()
            beta = self.qb_beta.float()
            if not accumulate:
                return torch.topk(local - beta, self.topk, dim=1).indices
            full = local
            for size, group in ((self.cp_size, self.cp_group), (self.sp_size, self.sp_group)):
                if size > 1:
                    gathered = full.new_empty(size * full.size(0), full.size(1))
                    all_gather_into_tensor(gathered, full.contiguous(), group)
                    full = gathered
            indices, batch_beta = quantile_choice(full, self.topk, beta)
            self.qb_beta_accum += batch_beta
            self.qb_beta_count += 1
            if full is not local:   # a token's choice depends on its own row only
                indices = torch.topk(local - beta, self.topk, dim=1).indices
            return indices

    def _topk_or_replayed(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing, or with ``--moe-enable-routing-replay`` the experts replayed
        (:mod:`~megatron.model.moe.router_replay`) weighed under these logits."""
        cfg, replay = self.moe_config, self.router_replay
        indices = None if replay is None else replay.replayed_indices(
            logits.size(0), self.topk, self.num_experts, logits.device)
        if indices is not None:
            return probs_of_chosen(logits, indices, cfg.moe_router_score_function,
                                   cfg.moe_router_pre_softmax,
                                   cfg.moe_router_topk_scaling_factor), indices
        probs, indices = topk_routing(logits, self.topk, cfg.moe_router_score_function,
                                      cfg.moe_router_pre_softmax,
                                      cfg.moe_router_topk_scaling_factor,
                                      cfg.moe_router_num_groups, cfg.moe_router_group_topk,
                                      self.expert_bias)
        if replay is not None:
            replay.record(indices)
        return probs, indices

    def route(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[s, b, E]`` -> (probabilities ``[s*b, E]``, routing map ``[s*b, E]``)."""
        cfg = self.moe_config
        seq_length, batch = logits.shape[:2]
        logits = self._with_z_loss(logits.reshape(-1, self.num_experts))      # [T, E]
        if cfg.uses_sinkhorn:
            probs, indices = self._sinkhorn_routing(logits)
        elif cfg.uses_quantile_balancing:
            indices = self._quantile_indices(logits)
            probs = probs_of_chosen(logits, indices, cfg.moe_router_score_function,
                                    cfg.moe_router_pre_softmax,
                                    cfg.moe_router_topk_scaling_factor)
        else:
            probs, indices = self._topk_or_replayed(logits)                  # [T, k]
            probs = self._with_load_balancing_loss(probs, logits, indices, seq_length, batch)
        probs, routing_map = _scatter_to_experts(probs, indices, self.num_experts)
        if cfg.drops_tokens:
            capacity = expert_capacity(logits.size(0), self.num_experts, self.topk,
                                       cfg.moe_expert_capacity_factor)
            routing_map = drop_over_capacity(probs, routing_map, capacity,
                                             cfg.moe_token_drop_policy)
            probs = probs * routing_map
        if self.expert_bias is not None and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
        return probs, routing_map

    def forward(self, hidden_states: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        logits = self.forced_logits(self.gating(hidden_states))
        return self.route(logits)


def updated_expert_bias(expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                        rate: float) -> torch.Tensor:
    """Aux-loss-free balancing: each expert's bias moves by ``rate`` towards balance, up when
    it took fewer token choices than the mean over experts, down when more (unchanged when
    equal). ``tokens_per_expert``: ``[..., E]`` counts of one step over all data-parallel
    ranks; ``expert_bias`` the same shape."""
    counts = tokens_per_expert.to(expert_bias.dtype)
    mean = counts.sum(dim=-1, keepdim=True) / counts.size(-1)
    return expert_bias + torch.sign(mean - counts) * rate


def update_expert_biases(modules, groups=()) -> int:
    """After an optimizer step: update the expert bias of every router (with
    ``--moe-router-enable-expert-bias``) in ``modules`` from the token choices it counted since
    the last update, summed over each of ``groups`` in turn (together: every rank of this
    pipeline stage that routes other tokens, data x context x tensor parallel; ranks routing
    the same tokens only scale the counts, which leaves the update unchanged), and reset the
    counts. One all-reduce per group for all the routers. Returns the number of routers
    updated."""
    routers = [m for module in modules for m in module.modules()
               if isinstance(m, TopKRouter) and m.expert_bias is not None]
    if not routers:
        return 0
    counts = torch.stack([r.local_tokens_per_expert for r in routers])       # [R, E]
    for group in groups:
        all_reduce(counts, group)
    with torch.no_grad():
        for router, count in zip(routers, counts):
            rate = router.moe_config.moe_router_bias_update_rate
            router.expert_bias.copy_(updated_expert_bias(router.expert_bias, count, rate))
            router.local_tokens_per_expert.zero_()
    return len(routers)


def update_quantile_biases(modules, group=None) -> int:
    """After a step (Megatron-Core does it as it finalises the gradients): every router in
    training with quantile balancing in ``modules`` sets ``qb_beta`` from the mean of the batch
    biases of its micro-batches (:func:`quantile_choice`), averaged over ``group`` (the data x
    context-parallel ranks), by :func:`updated_quantile_bias`, and resets the sums. One
    all-reduce for all the routers. Returns the number of routers updated."""
    routers = [m for module in modules for m in module.modules()
               if isinstance(m, TopKRouter) and m.qb_beta is not None and m.training]
    if not routers:
        return 0
    means = torch.stack([r.qb_beta_accum / r.qb_beta_count.clamp(min=1).float()
                         for r in routers])                                   # [R, E]
    size = get_group_size(group)
    if size > 1:
        all_reduce(means, group)
        means = means / size
    with torch.no_grad():
        for router, mean in zip(routers, means):
            ema = router.moe_config.moe_router_quantile_balancing_ema
            router.qb_beta.copy_(updated_quantile_bias(router.qb_beta, mean, ema))
            router.qb_beta_accum.zero_()
            router.qb_beta_count.zero_()
    return len(routers)
