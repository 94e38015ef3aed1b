"""The experts of a mixture-of-experts layer, and its optional shared expert.

Each expert is an MLP ``linear_fc2(act(linear_fc1(x)))`` with ``linear_fc1`` ``[ffn, h]`` and
``linear_fc2`` ``[h, ffn]`` (Megatron-Core's names, so checkpoints map key for key:
``experts.local_experts.<i>.linear_fc1.weight`` is local expert ``i``). The activation is exact
(erf) GeLU, as Megatron-Core's experts use without biases or with ``--no-bias-gelu-fusion``
(with biases and the fusion, Megatron's default, the loop over experts runs the fused
tanh-approximation bias-GeLU as Megatron-Core's SequentialMLP does; the grouped experts refuse
it, as Megatron-Core's do); with ``--swiglu`` ``linear_fc1`` holds
``[gate; value]`` (``2 ffn`` rows) and the activation is ``silu(gate) * value``
(``--quick-geglu``: ``quick_gelu(gate) * value``, each with ``--glu-linear-offset`` and
``--activation-func-clamp-value`` as :func:`megatron.model.utils.gated_linear_unit` applies them);
``--squared-relu`` and ``--openai-gelu`` select those activations instead. Biases only with
``add_bias_linear``. With ``--moe-mlp-glu-interleave-size`` N (the shared expert:
``--moe-shared-expert-glu-interleave-size``) a gated fc1 holds its rows in blocks
``[gate (N); value (N)]`` instead of two halves, and is split over TP in whole blocks; with
``--moe-latent-size`` the experts take and give latent-width rows.

Expert tensor parallelism (``--expert-tensor-parallel-size``, over the explicit
``expert_tp_group``): ``linear_fc1`` is split by rows (SwiGLU: each rank holds
``[gate_r; value_r]``) and ``linear_fc2`` by columns, and the partial outputs are summed over
the group. The ranks of one expert-TP group must hold the same rows. Weights are initialised on
the full shape from a seed of the global layer and expert number, then split, so the experts do
not depend on the expert-parallel or expert-TP layout.

Two ways to run the local experts, with the same parameters:

* :class:`SequentialMLP`: a loop over the local experts;
* :class:`GroupedMLP` (``--moe-grouped-gemm``): the rows are laid out ``[experts, max rows, h]``
  (zero-padded) and each projection is one batched matmul over the experts.

Expert parameters carry ``allreduce = False`` (Megatron's mark): their gradients are to be
summed over the expert-data-parallel ranks, not the data-parallel ones.
"""

from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from megatron.core import device, tensor_parallel
from megatron.core.collectives import get_group_size
from megatron.core.config import TransformerConfig
from megatron.core.utils import get_init_method, get_output_layer_init_method
from megatron.fused_kernels.bias_gelu import bias_gelu_impl
from megatron.model.moe.config import MoEConfig
from megatron.model.utils import glu_activation, init_rng, openai_gelu, squared_relu


def remove_glu_interleaving(x: torch.Tensor, interleave_size: int) -> torch.Tensor:
    """``[..., 2 f]`` laid out in blocks ``[gate (N) | value (N)] * (f / N)`` -> the usual
    ``[gate (f) | value (f)]`` (``--moe-mlp-glu-interleave-size`` N, as Megatron-Core lays out
    the fc1 output of its experts for fused grouped kernels)."""
    width = x.size(-1)
    if width % (2 * interleave_size):
        raise ValueError(f"GLU interleave size {interleave_size}: the fc1 output width {width} "
                         f"is not a whole number of [gate | value] blocks of {interleave_size}")
    blocks = x.reshape(*x.shape[:-1], width // (2 * interleave_size), 2, interleave_size)
    return blocks.transpose(-3, -2).reshape(x.shape)


def expert_activation(config: TransformerConfig, glu_interleave_size: Optional[int] = None
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation on ``linear_fc1``'s output (for SwiGLU, ``[..., 2 f]`` -> ``[..., f]``;
    with ``glu_interleave_size`` the gate and value rows come in interleaved blocks)."""
    if config.gated_linear_unit:
        glu = glu_activation(config)
        if glu_interleave_size is None:
            return glu
        return lambda x: glu(remove_glu_interleaving(x, glu_interleave_size))
    if config.squared_relu:
        return squared_relu
    if config.openai_gelu:
        return openai_gelu
    return F.gelu


def expert_bias_gelu(config: TransformerConfig, bias: bool) -> bool:
    """Whether experts with ``bias`` run Megatron's fused bias-GeLU (tanh approximation).

    As in Megatron-Core's SequentialMLP: a GeLU expert with biases and ``bias_gelu_fusion``
    computes ``gelu_tanh(x W^T + b)``; without biases Megatron turns the fusion off and the
    expert computes exact (erf) GeLU, as it does with ``--no-bias-gelu-fusion``. Its grouped
    experts refuse the fusion (:class:`GroupedMLP` does too)."""
    gelu = not (config.gated_linear_unit or config.squared_relu or config.openai_gelu)
    return gelu and bias and config.bias_gelu_fusion


def _fc1_size(config: TransformerConfig, ffn: int) -> int:
    return 2 * ffn if config.gated_linear_unit else ffn


def _fc1_stride(config: TransformerConfig, glu_interleave_size: Optional[int]) -> int:
    """How fc1's rows split over tensor-parallel ranks: ``[gate_r; value_r]`` (stride 2) for a
    gated unit in two halves; whole contiguous runs of blocks when interleaved (each rank's
    rows are then themselves interleaved, as Megatron-Core keeps them)."""
    return 2 if config.gated_linear_unit and glu_interleave_size is None else 1


def check_glu_interleave(flag: str, interleave: Optional[int], ffn: int, tp_size: int) -> None:
    """Each tensor-parallel rank's share of the FFN must be whole interleave blocks."""
    if interleave is not None and (ffn % tp_size or (ffn // tp_size) % interleave):
        raise ValueError(f"{flag} {interleave}: each of the {tp_size} tensor-parallel ranks' "
                         f"share of the FFN size {ffn} must be a multiple of it")


class ExpertMLP(torch.nn.Module):
    """One expert: ``[n, h]`` rows -> ``[n, h]``; split over ``expert_tp_group`` (and its
    weights' rows over ``weight_shard_group``, the expert weight-shard group)."""

    def __init__(self, config: TransformerConfig, ffn_hidden_size: int, expert_tp_group,
                 bias: bool, glu_interleave_size: Optional[int] = None,
                 input_size: Optional[int] = None, weight_shard_group=None):
        super().__init__()
        input_size = input_size or config.hidden_size
        self.bias_gelu = expert_bias_gelu(config, bias)
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            input_size, _fc1_size(config, ffn_hidden_size),
            init_method=get_init_method(config), tp_group=expert_tp_group, bias=bias,
            gather_output=False, params_dtype=config.params_dtype,
            stride=_fc1_stride(config, glu_interleave_size), skip_bias_add=self.bias_gelu,
            weight_shard_group=weight_shard_group)
        self.activation_func = expert_activation(config, glu_interleave_size)
        self.linear_fc2 = tensor_parallel.RowParallelLinear(
            ffn_hidden_size, input_size,
            init_method=get_output_layer_init_method(config), tp_group=expert_tp_group,
            bias=bias, input_is_parallel=True, params_dtype=config.params_dtype,
            weight_shard_group=weight_shard_group)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        intermediate, bias = self.linear_fc1(rows)               # [n, (2) ffn / etp]
        if self.bias_gelu:
            intermediate = bias_gelu_impl(intermediate, bias)    # [n, ffn / etp]
        else:
            intermediate = self.activation_func(intermediate)
        output, _ = self.linear_fc2(intermediate)                # [n, h]
        return output


class SequentialMLP(torch.nn.Module):
    """The local experts, run one after the other.

    Args:
        config: the transformer config (hidden size, activation, bias, init, dtype).
        moe_config: the MoE settings (expert count, expert FFN size).
        layer_number: 1-based global layer number (initialisation seeds).
        ep_rank / ep_size: this rank's place in the expert-parallel group: it holds global
            experts ``ep_rank * E / ep_size ...``.
        expert_tp_group: the expert-tensor-parallel group (None: none).
        init_seed: the model's initialisation seed.
        weight_shard_group: the expert weight-shard group (None: none): each expert weight is
            kept as this rank's block of rows and gathered for the matmuls
            (:mod:`megatron.core.tensor_parallel.weight_shards`).
    """

    def __init__(self, config: TransformerConfig, moe_config: MoEConfig, layer_number: int,
                 ep_rank: int = 0, ep_size: int = 1, expert_tp_group=None,
                 init_seed: int = 1234, weight_shard_group=None):
        super().__init__()
        self.num_local_experts = moe_config.num_moe_experts // ep_size
        self.expert_tp_group = expert_tp_group
        self.weight_shard_group = weight_shard_group
        interleave = moe_config.moe_mlp_glu_interleave_size if config.gated_linear_unit else None
        self.activation_func = expert_activation(config, interleave)
        ffn = moe_config.moe_ffn_hidden_size or config.ffn_hidden_size
        check_glu_interleave("--moe-mlp-glu-interleave-size", interleave, ffn,
                             get_group_size(expert_tp_group))
        first = ep_rank * self.num_local_experts
        experts = []
        for i in range(self.num_local_experts):
            with init_rng(init_seed, f"layer.{layer_number - 1}.mlp.experts.{first + i}"):
                experts.append(ExpertMLP(config, ffn, expert_tp_group, config.add_bias_linear,
                                         interleave, moe_config.moe_latent_size,
                                         weight_shard_group))
        self.local_experts = torch.nn.ModuleList(experts)
        for param in self.parameters():
            param.allreduce = False

    def forward(self, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """``rows [N, h]`` grouped by local expert, ``counts[i]`` rows for expert ``i`` ->
        the experts' outputs ``[N, h]`` in the same order."""
        pieces = rows.split(counts)
        return torch.cat([expert(piece) for expert, piece in zip(self.local_experts, pieces)])


class GroupedMLP(SequentialMLP):
    """The local experts as batched matmuls over ``[experts, max rows, h]``; the same
    parameters (and checkpoint keys) as :class:`SequentialMLP`, the same result."""

    def __init__(self, config: TransformerConfig, moe_config: MoEConfig, *args, **kwargs):
        if expert_bias_gelu(config, config.add_bias_linear):
            raise ValueError("--moe-grouped-gemm: the grouped experts have no fused bias-GeLU "
                             "(Megatron-Core refuses it); add --no-bias-gelu-fusion")
        super().__init__(config, moe_config, *args, **kwargs)

    def _stacked(self, name: str, attr: str) -> Optional[torch.Tensor]:
        tensors = [getattr(getattr(e, name), attr) for e in self.local_experts]
        if tensors[0] is None:
            return None
        if attr == "weight":
            tensors = [tensor_parallel.gather_weight_shards(t, self.weight_shard_group)
                       for t in tensors]
        return torch.stack(tensors)

    @staticmethod
    def fc1(grouped: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor]) -> torch.Tensor:
        """Every local expert's first projection at once, ``[El, max, h]`` ->
        ``[El, max, (2) f / etp]`` (what ``--offload-modules expert_fc1`` covers here)."""
        hidden_states = torch.bmm(grouped, w1.transpose(1, 2))
        return hidden_states if b1 is None else hidden_states + b1.unsqueeze(1)

    def forward(self, rows: torch.Tensor, counts: List[int]) -> torch.Tensor:
        num_rows, hidden = rows.shape
        counts_t = torch.tensor(counts, dtype=torch.long, device=rows.device)   # [El]
        expert_of_row = torch.repeat_interleave(
            torch.arange(len(counts), device=rows.device), counts_t)            # [N]
        starts = torch.cumsum(counts_t, 0) - counts_t
        slot = torch.arange(num_rows, device=rows.device) - starts[expert_of_row]
        width = max(counts) if counts else 0
        rows = tensor_parallel.copy_to_tensor_model_parallel_region(rows, self.expert_tp_group)
        grouped = rows.new_zeros(len(counts), width, hidden).index_put(
            (expert_of_row, slot), rows)                                   # [El, max, h]
        w1, b1 = self._stacked("linear_fc1", "weight"), self._stacked("linear_fc1", "bias")
        w2, b2 = self._stacked("linear_fc2", "weight"), self._stacked("linear_fc2", "bias")
        hidden_states = self.fc1(grouped, w1, b1)                        # [El, max, (2)f/etp]
        hidden_states = self.activation_func(hidden_states)              # [El, max, f/etp]
        output = torch.bmm(hidden_states, w2.transpose(1, 2))             # [El, max, h] partial
        output = output[expert_of_row, slot]                              # [N, h]
        output = tensor_parallel.reduce_from_tensor_model_parallel_region(
            output, self.expert_tp_group)
        if b2 is not None:
            output = output + b2[expert_of_row]
        return output


class SharedExpertMLP(torch.nn.Module):
    """A dense MLP every token goes through, added to the routed experts' output
    (``--moe-shared-expert-intermediate-size``); tensor-parallel over ``tp_group``.

    With ``--moe-shared-expert-gate`` its output is multiplied per token by
    ``sigmoid(x . gate_weight)`` (``gate_weight`` ``[1, h]``). Megatron-Core has no bias in
    shared experts, so ``add_bias_linear`` is refused. With ``sequence_parallel`` the input and
    output are this rank's slice ``[s/tp, b, h]``, as for the dense MLP.
    """

    def __init__(self, config: TransformerConfig, moe_config: MoEConfig, layer_number: int,
                 tp_group=None, init_seed: int = 1234, sequence_parallel: bool = False):
        super().__init__()
        if config.add_bias_linear:
            raise ValueError("--moe-shared-expert-intermediate-size: shared experts have no "
                             "bias; add --disable-bias-linear")
        size = moe_config.moe_shared_expert_intermediate_size
        interleave = (moe_config.moe_shared_expert_glu_interleave_size
                      if config.gated_linear_unit else None)
        check_glu_interleave("--moe-shared-expert-glu-interleave-size", interleave, size,
                             get_group_size(tp_group))
        with init_rng(init_seed, f"layer.{layer_number - 1}.mlp.shared_experts"):
            self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, _fc1_size(config, size), init_method=get_init_method(config),
                tp_group=tp_group, bias=False, gather_output=False,
                params_dtype=config.params_dtype, stride=_fc1_stride(config, interleave),
                sequence_parallel=sequence_parallel)
            self.linear_fc2 = tensor_parallel.RowParallelLinear(
                size, config.hidden_size, init_method=get_output_layer_init_method(config),
                tp_group=tp_group, bias=False, input_is_parallel=True,
                params_dtype=config.params_dtype, sequence_parallel=sequence_parallel)
            if moe_config.moe_shared_expert_gate:
                gate = torch.empty(1, config.hidden_size,
                                   dtype=torch.promote_types(config.params_dtype, torch.float32))
                get_init_method(config)(gate)
                self.gate_weight = torch.nn.Parameter(
                    gate.to(device=device.current_device(), dtype=config.params_dtype))
                if sequence_parallel:   # it sees only this rank's tokens
                    self.gate_weight.sequence_parallel = True
            else:
                self.gate_weight = None
        self.activation_func = expert_activation(config, interleave)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]`` (``[s/tp, b, h]`` with sequence parallelism)."""
        intermediate, _ = self.linear_fc1(hidden_states)               # [s, b, (2) f / tp]
        output, _ = self.linear_fc2(self.activation_func(intermediate))  # [s, b, h]
        if self.gate_weight is not None:
            output = output * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return output


def check_expert_tp(moe_config: MoEConfig, config: TransformerConfig, expert_tp_group) -> None:
    """The expert FFN must split over the expert-TP group, whose size must match the config."""
    etp = get_group_size(expert_tp_group)
    want = moe_config.expert_tensor_parallel_size
    if want is not None and want != etp:
        raise ValueError(f"--expert-tensor-parallel-size is {want} but the expert_tp_group "
                         f"passed has {etp} ranks")
    ffn = moe_config.moe_ffn_hidden_size or config.ffn_hidden_size
    if ffn % etp:
        raise ValueError(f"--moe-ffn-hidden-size ({ffn}) must be divisible by "
                         f"--expert-tensor-parallel-size ({etp})")
