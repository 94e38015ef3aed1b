"""The settings of a mixture-of-experts MLP, under Megatron-Core's field names.

Each field is the ``TransformerConfig`` field Megatron-Core fills from the flag of the same name
(``--num-experts`` fills ``num_moe_experts``; every other flag is the field with ``--`` and
dashes). The config checks its own consistency and names the flags in its messages, so a wrong
combination fails before any layer or process group is built.
"""

import ast
import dataclasses
import math
from typing import Optional, Tuple, Union

from megatron.core.config import ConfigError

SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                        "quantile_balancing", "none")
# The balancing losses, in the order a router attaches them, and the names they are logged under.
AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}
ROUTER_DTYPES = ("fp32", "fp64")
DISPATCHER_TYPES = ("allgather", "alltoall")
DROP_POLICIES = ("probs", "position")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts settings; ``num_moe_experts=None`` means a dense MLP."""

    num_moe_experts: Optional[int] = None              # --num-experts
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"          # softmax | sigmoid | sqrtsoftplus
    moe_router_pre_softmax: bool = False                # softmax over all experts, then top-k
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_apply_probs_on_input: bool = False              # probability x input, not x output
    moe_router_num_groups: Optional[int] = None         # experts split into this many groups
    moe_router_group_topk: Optional[int] = None         # groups a token may choose from
    moe_router_enable_expert_bias: bool = False         # aux-loss-free balancing (sigmoid)
    moe_router_bias_update_rate: float = 1e-3
    moe_router_dtype: Optional[str] = None              # None (the input's) | fp32 | fp64
    # One of LOAD_BALANCING_TYPES, or several (a list) with one --moe-aux-loss-coeff each.
    moe_router_load_balancing_type: Union[str, Tuple[str, ...]] = "aux_loss"
    moe_aux_loss_coeff: Union[float, Tuple[float, ...]] = 0.0
    moe_router_quantile_balancing_ema: float = 0.0      # quantile_balancing: old bias's weight
    moe_z_loss_coeff: Optional[float] = None
    moe_input_jitter_eps: Optional[float] = None
    moe_token_dispatcher_type: str = "allgather"        # allgather | alltoall
    moe_grouped_gemm: bool = False
    # Megatron-Core's TransformerEngine grouped-tensor path (same computation here) and its
    # parameter layouts: one weight / bias tensor for all local experts (grouped_tensor.py).
    moe_use_grouped_tensor: bool = False
    moe_single_grouped_weight: bool = False
    moe_single_grouped_bias: bool = False
    moe_expert_capacity_factor: Optional[float] = None  # None (or < 0): no token is dropped
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"                # probs | position
    moe_ffn_hidden_size: Optional[int] = None           # default: --ffn-hidden-size
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False                # sigmoid gate on the shared expert
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None   # default: --tensor-model-parallel-size
    moe_per_layer_logging: bool = False
    moe_router_force_load_balancing: bool = False       # benchmark: random router logits
    # Benchmark: random logits plus a random per-expert bias of this std (< 0: kept for the
    # run, > 0: drawn again each forward); see megatron/model/moe/forced_logits.py.
    moe_router_force_biased: Optional[float] = None
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1     # every N-th layer, or one 0/1 per layer
    moe_latent_size: Optional[int] = None               # routed experts work in this width
    moe_mlp_glu_interleave_size: Optional[int] = None   # experts' fc1: gate/value in N-row blocks
    moe_shared_expert_glu_interleave_size: Optional[int] = None   # the same, shared expert
    moe_enable_routing_replay: bool = False             # routers record / replay their choice

    def __post_init__(self):
        for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.moe_expert_capacity_factor is not None and self.moe_expert_capacity_factor < 0:
            # Megatron's convention: a negative factor means no capacity limit.
            object.__setattr__(self, "moe_expert_capacity_factor", None)
        if self.num_moe_experts is None:
            return
        experts, topk = self.num_moe_experts, self.moe_router_topk
        if experts < 1:
            raise ConfigError(f"--num-experts must be >= 1, got {experts}")
        if not 1 <= topk <= experts:
            raise ConfigError(f"--moe-router-topk ({topk}) must be between 1 and --num-experts "
                              f"({experts})")
        if self.moe_apply_probs_on_input and topk != 1:
            raise ConfigError(f"--moe-apply-probs-on-input needs --moe-router-topk 1, got {topk}")
        self._check_choice("--moe-router-score-function", self.moe_router_score_function,
                           SCORE_FUNCTIONS)
        self._check_load_balancing_types()
        self._check_choice("--moe-token-dispatcher-type", self.moe_token_dispatcher_type,
                           DISPATCHER_TYPES)
        self._check_choice("--moe-token-drop-policy", self.moe_token_drop_policy,
                           DROP_POLICIES)
        if self.expert_model_parallel_size < 1 or experts % self.expert_model_parallel_size:
            raise ConfigError(f"--num-experts ({experts}) must be divisible by "
                              f"--expert-model-parallel-size "
                              f"({self.expert_model_parallel_size})")
        if self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size < 1:
            raise ConfigError("--expert-tensor-parallel-size must be >= 1, got "
                              f"{self.expert_tensor_parallel_size}")
        self._check_losses()
        self._check_router()
        self._check_capacity()
        self._check_sizes()
        self._check_grouped_tensor()

    def _check_grouped_tensor(self) -> None:
        """Megatron-Core's chain: the single grouped weight / bias live in the grouped-tensor
        path, which is a way of running the grouped GEMM."""
        for flag, on, needs, have in (
                ("--moe-use-grouped-tensor", self.moe_use_grouped_tensor,
                 "--moe-grouped-gemm", self.moe_grouped_gemm),
                ("--moe-single-grouped-weight", self.moe_single_grouped_weight,
                 "--moe-use-grouped-tensor", self.moe_use_grouped_tensor),
                ("--moe-single-grouped-bias", self.moe_single_grouped_bias,
                 "--moe-use-grouped-tensor", self.moe_use_grouped_tensor)):
            if on and not have:
                raise ConfigError(f"{flag} needs {needs} (as in Megatron-Core)")
        single = [flag for flag, on in (("--moe-single-grouped-weight",
                                         self.moe_single_grouped_weight),
                                        ("--moe-single-grouped-bias",
                                         self.moe_single_grouped_bias)) if on]
        variants = [flag for flag, on in (
            ("--moe-latent-size", self.moe_latent_size is not None),
            ("--moe-mlp-glu-interleave-size", self.moe_mlp_glu_interleave_size is not None)) if on]
        if single and variants:
            raise ConfigError(f"{single[0]} with {variants[0]} is not built here (the grouped-"
                              "linear expert layout holds full-width, two-half GLU experts); "
                              f"drop {single[0]} (the same computation in the per-expert layout)")

    @staticmethod
    def _check_choice(flag: str, value: str, choices) -> None:
        if value not in choices:
            raise ConfigError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")

    def _check_load_balancing_types(self) -> None:
        types, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        for kind in self.load_balancing_types:
            self._check_choice("--moe-router-load-balancing-type", kind, LOAD_BALANCING_TYPES)
        if isinstance(types, str):
            if isinstance(coeffs, tuple):
                raise ConfigError(f"--moe-aux-loss-coeff {' '.join(map(str, coeffs))}: one "
                                  "coefficient per --moe-router-load-balancing-type, which "
                                  f"names one type ({types})")
            return
        given = coeffs if isinstance(coeffs, tuple) else (coeffs,)
        if len(given) != len(types):
            raise ConfigError(f"--moe-router-load-balancing-type {' '.join(types)} needs one "
                              f"--moe-aux-loss-coeff per type, got {' '.join(map(str, given))}")
        if len(set(types)) != len(types):
            raise ConfigError(f"--moe-router-load-balancing-type {' '.join(types)} names a type "
                              "twice")
        if "sinkhorn" in types and len(types) > 1:
            raise ConfigError(f"--moe-router-load-balancing-type {' '.join(types)}: sinkhorn "
                              "routes by itself and does not combine with other types")

    @property
    def load_balancing_types(self) -> Tuple[str, ...]:
        """The balancing types as a tuple (one or several)."""
        types = self.moe_router_load_balancing_type
        return (types,) if isinstance(types, str) else tuple(types)

    @property
    def uses_sinkhorn(self) -> bool:
        return "sinkhorn" in self.load_balancing_types

    @property
    def uses_quantile_balancing(self) -> bool:
        return "quantile_balancing" in self.load_balancing_types

    def aux_loss_coeff(self, kind: str) -> float:
        """The coefficient of balancing loss ``kind`` (0 when it is not one of the types)."""
        types, coeffs = self.load_balancing_types, self.moe_aux_loss_coeff
        if kind not in types:
            return 0.0
        return coeffs[types.index(kind)] if isinstance(coeffs, tuple) else coeffs

    def _check_losses(self) -> None:
        coeffs = self.moe_aux_loss_coeff
        for coeff in coeffs if isinstance(coeffs, tuple) else (coeffs,):
            if coeff < 0:
                raise ConfigError(f"--moe-aux-loss-coeff must be >= 0, got {coeff}")
        if self.uses_sinkhorn and self.aux_loss_coeff("sinkhorn"):
            raise ConfigError("--moe-router-load-balancing-type sinkhorn balances by itself; "
                              f"--moe-aux-loss-coeff must be 0, got {self.moe_aux_loss_coeff}")
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff < 0:
            raise ConfigError(f"--moe-z-loss-coeff must be >= 0, got {self.moe_z_loss_coeff}")
        eps = self.moe_input_jitter_eps
        if eps is not None and not 0 < eps < 1:
            raise ConfigError(f"--moe-input-jitter-eps must be in (0, 1), got {eps}")
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and factor <= 0:
            raise ConfigError(f"--moe-router-topk-scaling-factor must be > 0, got {factor}")

    def _check_router(self) -> None:
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (group_topk is None):
            raise ConfigError("--moe-router-num-groups and --moe-router-group-topk go together; "
                              f"got {groups} and {group_topk}")
        if groups is not None:
            experts, topk = self.num_moe_experts, self.moe_router_topk
            if groups < 1 or experts % groups:
                raise ConfigError(f"--num-experts ({experts}) must be divisible by "
                                  f"--moe-router-num-groups ({groups})")
            if not 1 <= group_topk <= groups:
                raise ConfigError(f"--moe-router-group-topk ({group_topk}) must be between 1 "
                                  f"and --moe-router-num-groups ({groups})")
            if topk % group_topk or topk // group_topk > experts // groups:
                raise ConfigError(f"--moe-router-topk ({topk}) must be a multiple of "
                                  f"--moe-router-group-topk ({group_topk}) and at most "
                                  f"{experts // groups} per group")
            if self.uses_sinkhorn:
                raise ConfigError("--moe-router-num-groups works with the top-k routers, not "
                                  "--moe-router-load-balancing-type sinkhorn")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function == "softmax":
            raise ConfigError("--moe-router-enable-expert-bias needs "
                              "--moe-router-score-function sigmoid or sqrtsoftplus, got "
                              f"{self.moe_router_score_function}")
        if self.moe_router_enable_expert_bias and self.moe_router_bias_update_rate < 0:
            raise ConfigError("--moe-router-bias-update-rate must be >= 0, got "
                              f"{self.moe_router_bias_update_rate}")
        std = self.moe_router_force_biased
        if std is not None and not math.isfinite(std):
            raise ConfigError(f"--moe-router-force-biased must be a finite number, got {std}")
        if self.moe_router_dtype is not None:
            self._check_choice("--moe-router-dtype", self.moe_router_dtype, ROUTER_DTYPES)
        if self.uses_quantile_balancing:
            self._check_quantile_balancing()
        if self.moe_enable_routing_replay and (self.uses_sinkhorn
                                               or self.uses_quantile_balancing):
            raise ConfigError("--moe-enable-routing-replay replays top-k routing; "
                              "--moe-router-load-balancing-type sinkhorn and quantile_balancing "
                              "choose by other rules")

    def _check_quantile_balancing(self) -> None:
        """Megatron-Core's conditions on ``quantile_balancing``, and the combinations not built."""
        kind = "--moe-router-load-balancing-type quantile_balancing"
        losses = [k for k in AUX_LOSS_NAMES if self.aux_loss_coeff(k)]
        if losses:
            raise ConfigError(f"{kind} balances through its per-expert bias; the balancing "
                              f"losses must be off, but {', '.join(losses)} has a non-zero "
                              "--moe-aux-loss-coeff: set it to 0")
        if self.moe_router_num_groups is not None:
            raise ConfigError(f"{kind} does not support group-limited routing "
                              "(--moe-router-num-groups), as in Megatron-Core")
        if self.moe_router_enable_expert_bias:
            raise ConfigError(f"{kind} with --moe-router-enable-expert-bias is not built: "
                              "use one of the two per-expert biases")
        if self.moe_router_topk >= self.num_moe_experts:
            raise ConfigError(f"{kind} needs --moe-router-topk ({self.moe_router_topk}) below "
                              f"--num-experts ({self.num_moe_experts})")
        ema = self.moe_router_quantile_balancing_ema
        if not 0.0 <= ema <= 1.0:
            raise ConfigError(f"--moe-router-quantile-balancing-ema must be in [0, 1], "
                              f"got {ema}")

    def _check_capacity(self) -> None:
        factor = self.moe_expert_capacity_factor
        if factor is None:
            if self.moe_pad_expert_input_to_capacity:
                raise ConfigError("--moe-pad-expert-input-to-capacity needs "
                                  "--moe-expert-capacity-factor")
            return
        if factor == 0:
            raise ConfigError("--moe-expert-capacity-factor must be > 0 (or negative for no "
                              "limit), got 0")
        if self.uses_sinkhorn:
            raise ConfigError("--moe-expert-capacity-factor works with "
                              "--moe-router-load-balancing-type aux_loss, seq_aux_loss or none, "
                              "not sinkhorn")

    def _check_sizes(self) -> None:
        for flag, value in (("--moe-ffn-hidden-size", self.moe_ffn_hidden_size),
                            ("--moe-shared-expert-intermediate-size",
                             self.moe_shared_expert_intermediate_size)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if self.moe_shared_expert_gate and self.moe_shared_expert_intermediate_size is None:
            raise ConfigError("--moe-shared-expert-gate needs "
                              "--moe-shared-expert-intermediate-size")
        if self.moe_latent_size is not None and self.moe_latent_size < 1:
            raise ConfigError(f"--moe-latent-size must be >= 1, got {self.moe_latent_size}")
        for flag, value in (("--moe-mlp-glu-interleave-size", self.moe_mlp_glu_interleave_size),
                            ("--moe-shared-expert-glu-interleave-size",
                             self.moe_shared_expert_glu_interleave_size)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be >= 1, got {value}")
        if (self.moe_shared_expert_glu_interleave_size is not None
                and self.moe_shared_expert_intermediate_size is None):
            raise ConfigError("--moe-shared-expert-glu-interleave-size needs "
                              "--moe-shared-expert-intermediate-size")

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (1-based) has an MoE MLP: with an integer
        ``--moe-layer-freq`` N the layers 0, N, 2N, ... (0-based); with a list, those marked 1."""
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return (layer_number - 1) % freq == 0
        return bool(freq[layer_number - 1])

    @property
    def num_local_experts(self) -> int:
        """Experts held by one expert-parallel rank."""
        return self.num_moe_experts // self.expert_model_parallel_size

    @property
    def drops_tokens(self) -> bool:
        return self.moe_expert_capacity_factor is not None


def _evaluate_layer_list(node):
    """A list expression of Megatron's ``--moe-layer-freq`` form (list literals of 0/1, ``+``,
    ``*`` by an integer, parentheses) -> list of ints; anything else is refused."""
    if isinstance(node, ast.Expression):
        return _evaluate_layer_list(node.body)
    if isinstance(node, ast.List):
        values = [_evaluate_layer_list(e) for e in node.elts]
        if not all(isinstance(v, int) for v in values):
            raise ValueError("list entries must be 0 or 1")
        return values
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _evaluate_layer_list(node.left), _evaluate_layer_list(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
            return left * right
        if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, list):
            return right * left
    raise ValueError("only list literals, + and * by an integer are allowed")


def parse_moe_layer_freq(text: str, flag: str = "--moe-layer-freq"
                         ) -> Union[int, Tuple[int, ...]]:
    """``--moe-layer-freq``: an integer N, or Megatron's list form such as ``"([0]+[1]*23)"``
    (read without ``eval``: only list literals, ``+`` and ``*`` are accepted). ``flag`` names
    the option in errors (``--window-attn-skip-freq`` has the same form)."""
    text = str(text).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        values = _evaluate_layer_list(ast.parse(text, mode="eval"))
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"{flag} {text!r}: expected an integer or a list such as "
                         f"'([0]+[1]*23)' ({err})") from None
    if not isinstance(values, list) or any(v not in (0, 1) for v in values):
        raise ValueError(f"{flag} {text!r}: the list must hold only 0 and 1")
    return tuple(values)
