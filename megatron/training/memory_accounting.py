"""Theoretical memory of one rank, for comparison with what a run actually uses.

Two parts, as in Megatron's ``theoretical_memory_usage``:

**Weights, gradients and optimizer state**: parameters on this rank times bytes per parameter.
With mixed precision (fp16/bf16 weights, fp32 gradients, an fp32 master copy and Adam's two fp32
moments) that is Megatron's 2 + 4 + 4 + 8 = 18 bytes, or 2 + 4 + (4 + 8) / DP = 6 + 12 / DP with
the distributed optimizer, which shards the master copy and the moments over the data-parallel
group. The same count gives 4 + 4 + 8 = 16 bytes for fp32 training (no master copy), and fewer
with fp16 gradients or SGD. Parameters are counted exactly for this rank's layers, biases and
position embeddings included.

**Activations**: the per-layer bytes of Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models" (Table 2), on which Megatron's formula rests. For one micro-batch
with ``e``-byte activations (2 for fp16/bf16) and 1-byte dropout masks, a layer keeps::

    sbh (4e + 2)          replicated over TP: inputs of QKV and of the MLP, two dropout
                          masks, two norm inputs      (split by t with sequence parallelism)
    sbh 4e + sbf 2e       split by TP: Q, K, V, the input of ``dense``, the MLP's inner
                          activations (3e with SwiGLU)
    a s^2 b (2e + 1)      split by TP: softmax output, its dropout mask and output; gone with
                          selective recomputation (or flash attention)

which is Megatron's ``sbh (34 + 5as/h)`` for e = 2, f = 4h, and ``sbh (10 + 24/t + 5as/(ht))``,
``sbh (34/t + 5as/(ht))`` and ``sbh 34/t`` with TP, SP and SP + selective recomputation. With full
recomputation a checkpointed group of layers keeps only its input (``sbh e``, ``/t`` with SP),
plus, once per rank, the activations of the group being recomputed. The first virtual stage adds
Megatron's embedding terms (8sb for the input ids, a 1-byte dropout mask sbh), the last the
output layer's (2e sbh for its inputs, 4sbV/t for the fp32 logits of the loss).

With context parallelism (``cp`` ranks per sequence) a rank keeps its ``s / cp`` tokens, so every
``sbh`` and ``sbf`` term falls by ``cp``; its attention scores cover its ``s / cp`` queries and all
``s`` keys, ``a (s / cp) s b (2e + 1)`` (the blockwise kernel keeps them per key block, in fp32,
but only the blocks the causal mask leaves: about the same count). The distributed optimizer
shards over the data x context-parallel ranks.

How many micro-batches are alive at once comes from walking this rank's order of forwards and
backwards (:func:`~megatron.core.pipeline_parallel.schedules.pipeline_order`): ``min(p - r, m)``
on stage ``r`` under 1F1B, so the first stage holds ``p x L/p = L`` layers' worth, Megatron's
figure; under interleaving the first stage holds ``L (1 + (p - 1) / (p v))`` layers' worth, again
Megatron's.
"""

import math
import resource
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from megatron.core import device
from megatron.core.config import TransformerConfig
from megatron.core.pipeline_parallel.schedules import pipeline_order
from megatron.model import block_causal
from megatron.model.moe.config import AUX_LOSS_NAMES
from megatron.model.transformer import get_num_layers_and_offset

MB = 1024 * 1024


@dataclass(frozen=True)
class MemoryEstimate:
    """Theoretical bytes of one rank."""

    num_parameters: int
    bytes_per_parameter: float
    activation_bytes: float

    @property
    def weight_and_optimizer_bytes(self) -> float:
        return self.num_parameters * self.bytes_per_parameter

    @property
    def total_bytes(self) -> float:
        return self.weight_and_optimizer_bytes + self.activation_bytes


# ------------------------------------------------------------------------- parameters

def _norm_params(config: TransformerConfig, size: int = 0) -> int:
    size = size or config.hidden_size
    return 2 * size if config.normalization == "LayerNorm" else size


def _moe_mlp_parameters(config: TransformerConfig, moe, tp_size: int) -> int:
    """An MoE layer's MLP on one tensor-parallel rank (expert TP = TP): the router ``E x h``
    and, with biases, ``E`` (whole on every rank), the fc1 and fc2 of each of this expert-parallel rank's experts
    (split), and the shared expert (split; its gate ``1 x h`` whole)."""
    h, t, bias = config.hidden_size, tp_size, config.add_bias_linear
    ffn = moe.moe_ffn_hidden_size or config.ffn_hidden_size
    inner = 2 * ffn if config.gated_linear_unit else ffn
    width = getattr(moe, "moe_latent_size", None) or h    # the experts' input and output
    expert = (inner * width // t + (inner // t if bias else 0) + width * ffn // t
              + (width if bias else 0))
    count = moe.num_moe_experts * (h + (1 if bias else 0)) + moe.num_local_experts * expert
    if width != h:   # --moe-latent-size: the two projections, whole on every rank
        count += 2 * h * width + ((width + h) if bias else 0)
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None:
        count += (2 * shared if config.gated_linear_unit else shared) * h // t + h * shared // t
        count += h if moe.moe_shared_expert_gate else 0
    return count


def layer_parameters(config: TransformerConfig, tp_size: int, moe=None) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank; ``moe`` (a
    :class:`~megatron.model.moe.MoEConfig`) when the layer's MLP is an MoE layer."""
    h, t = config.hidden_size, tp_size
    q = config.num_attention_heads * config.kv_channels
    qkv = q + 2 * config.num_query_groups * config.kv_channels
    inner = 2 * config.ffn_hidden_size if config.gated_linear_unit else config.ffn_hidden_size
    bias = config.add_bias_linear
    count = 2 * _norm_params(config)
    if config.qk_layernorm:
        count += 2 * _norm_params(config, config.kv_channels)                 # q/k_layernorm
    count += qkv * h // t + (qkv // t if bias or config.add_qkv_bias else 0)   # query_key_value
    count += h * q // t + (h if bias else 0)                                  # dense (row)
    if moe is not None:
        return count + _moe_mlp_parameters(config, moe, tp_size)
    count += inner * h // t + (inner // t if bias else 0)                     # dense_h_to_4h
    count += h * config.ffn_hidden_size // t + (h if bias else 0)             # dense_4h_to_h
    return count


def num_parameters_on_rank(config: TransformerConfig, tp_size: int = 1, pp_size: int = 1,
                           pp_rank: int = 0, vp_size: Optional[int] = None, moe=None) -> int:
    """Parameters this rank holds over all its model chunks (``moe``: the MoE config of an MoE
    model, whose ``is_moe_layer`` layers count their experts).

    The first stage holds the word (``V/t x h``) and position embeddings; the last the final
    norm and, when untied, the output layer, or, when tied and ``pp > 1``, the copy
    ``word_embeddings_for_head``.
    """
    vocab = config.padded_vocab_size // tp_size * config.hidden_size
    total = 0
    for chunk in range(vp_size or 1):
        layers, offset = get_num_layers_and_offset(config, pp_size, pp_rank, vp_size,
                                                   chunk if vp_size else None)
        for number in range(offset + 1, offset + layers + 1):
            is_moe = moe is not None and moe.is_moe_layer(number)
            total += layer_parameters(config, tp_size, moe if is_moe else None)
        pre = pp_rank == 0 and chunk == 0
        post = pp_rank == pp_size - 1 and chunk == (vp_size or 1) - 1
        if pre:
            total += vocab
            if config.position_embedding_type == "learned_absolute":
                total += config.max_position_embeddings * config.hidden_size
        if post:
            total += _norm_params(config)
            if config.untie_embeddings_and_output_weights or not pre:
                total += vocab
    return total


def bytes_per_parameter(params_dtype: torch.dtype, grad_dtype: torch.dtype,
                        optimizer: str = "adam", sgd_momentum: float = 0.9,
                        use_distributed_optimizer: bool = False, dp_size: int = 1,
                        fully_sharded: bool = False, accumulates: bool = False) -> float:
    """Weight + gradient + optimizer bytes of one parameter (Megatron's 18 for bf16 + Adam).

    ``fully_sharded`` (``--use-torch-fsdp2``): the fp32 weight (the main weight, also under
    bf16), its fp32 gradient and the optimizer state are all split over ``dp_size``; with
    ``accumulates`` (several micro-batches) the whole fp32 gradient is also kept between them,
    since the reduce-scatter waits for the last one. The layer gathered for compute comes on
    top (one unit at a time).
    """
    if optimizer in ("adam", "muon", "dist_muon"):
        # Muon keeps one fp32 buffer per weight matrix and Adam's two for the rest: Adam's
        # 8 bytes bound it from above. dist_muon deals whole parameters' state over DP.
        states = 8 / dp_size if optimizer == "dist_muon" else 8
    elif optimizer in ("soap", "adaptive_muon"):
        # Two fp32 moments per element (adamuon's second moment is per element too); SOAP's
        # Kronecker factors and bases (4 (m^2 + n^2) per m x n matrix) are not counted.
        # --use-distributed-optimizer deals whole parameters' state over DP.
        states = 8 / dp_size if use_distributed_optimizer else 8
        use_distributed_optimizer = False
    elif optimizer == "sgd":
        states = 4 if sgd_momentum else 0
    elif optimizer == "lion":
        states = 4  # its momentum, fp32
    else:
        raise ValueError(f"--optimizer must be adam, sgd, lion, muon, dist_muon, soap or "
                         f"adaptive_muon, got {optimizer!r}")
    if fully_sharded:
        return (4 + 4 + states) / dp_size + (4 if accumulates else 0)
    weight = torch.tensor([], dtype=params_dtype).element_size()
    grad = torch.tensor([], dtype=grad_dtype).element_size()
    master = 4 if params_dtype != torch.float32 else 0
    sharded = master + states
    if use_distributed_optimizer:
        sharded /= dp_size
    return weight + grad + sharded


# ------------------------------------------------------------------------- activations

def layer_activation_bytes(config: TransformerConfig, micro_batch_size: int, tp_size: int = 1,
                           sequence_parallel: bool = False, element_bytes: int = 2,
                           cp_size: int = 1, attention_in_blocks: bool = False) -> float:
    """Bytes one layer keeps for backward for one micro-batch (no full recomputation).

    ``attention_in_blocks``: the explicit attention body runs in blocks of query rows
    (:mod:`megatron.model.block_causal`, see :func:`attention_runs_in_blocks`), keeping only the
    probabilities of the blocks on and below the diagonal, and no dropout mask."""
    b, h, t, e = micro_batch_size, config.hidden_size, tp_size, element_bytes
    s_full = config.seq_length
    s = s_full / cp_size                                     # this rank's tokens
    sbh = s * b * h
    inner = (3 if config.gated_linear_unit else 2) * e * s * b * config.ffn_hidden_size
    replicated = sbh * (4 * e + 2)
    split = sbh * 4 * e + inner
    scores = 0.0
    if config.recompute_granularity != "selective" and not config.use_flash_attn:
        if attention_in_blocks:
            scores = config.num_attention_heads * block_causal.kept_elements(s_full) * b * e
        else:
            scores = config.num_attention_heads * s * s_full * b * (2 * e + 1)
    return (replicated / t if sequence_parallel else replicated) + (split + scores) / t


def moe_mlp_activation_bytes(config: TransformerConfig, moe, micro_batch_size: int,
                             tp_size: int = 1, element_bytes: int = 2,
                             cp_size: int = 1) -> float:
    """Bytes an MoE layer's MLP keeps for backward for one micro-batch, with balanced routing.

    When the experts are split over the tensor-parallel group (expert-TP = TP, the default) the
    layer sees this rank's whole ``T = s/cp * b`` tokens (under sequence parallelism its input
    is gathered over the tensor-parallel ranks), and its experts process ``N = k T`` rows on
    average over the expert-parallel ranks. Kept: the input (``T h``), the dispatched rows, the
    experts' output rows and their probability-weighted copy (``3 N h``), the experts' inner
    activations (``2 N f``, SwiGLU ``4 N f``, split over expert-TP), the routing indices and
    probabilities (``12 T k + 12 N`` bytes), the fp32 scores of the auxiliary and z losses
    (``4 T E`` each) and the shared expert's inner activations.

    With another expert-TP size each rank routes its own tokens (``T / tp`` under sequence
    parallelism) and the experts run on the rows of the whole expert-TP group: they keep
    ``etp N`` input rows and ``etp N`` rows of inner activations (of ``f / etp`` each), the
    rest stays per rank.
    """
    e = element_bytes
    etp = moe.expert_tensor_parallel_size or tp_size
    own_tokens = etp != tp_size
    whole = config.seq_length / cp_size * micro_batch_size
    tokens = whole / tp_size if own_tokens else whole
    k, experts, h = moe.moe_router_topk, moe.num_moe_experts, config.hidden_size
    rows = k * tokens
    expert_rows = etp * rows if own_tokens else rows
    ffn = (moe.moe_ffn_hidden_size or config.ffn_hidden_size) / etp
    inner = 4 if config.gated_linear_unit else 2
    total = (tokens * h * e + (expert_rows + 2 * rows) * h * e + inner * expert_rows * ffn * e
             + 12 * (tokens * k + rows))
    if any(moe.aux_loss_coeff(kind) for kind in AUX_LOSS_NAMES):
        total += 4 * tokens * experts
    if moe.moe_z_loss_coeff:
        total += 4 * tokens * experts
    if moe.moe_shared_expert_intermediate_size:
        total += inner * whole * moe.moe_shared_expert_intermediate_size / tp_size * e
    return total


def _layer_bytes(config, moe, number: int, dense: float, b: int, t: int, sp: bool, e: int,
                 cp: int) -> float:
    """One layer's kept bytes: ``dense``, or with an MoE MLP in place of the dense one."""
    if moe is None or not moe.is_moe_layer(number):
        return dense
    sbh = config.seq_length / cp * b * config.hidden_size
    dense_mlp = (e * sbh + (3 if config.gated_linear_unit else 2) * e * sbh / config.hidden_size
                 * config.ffn_hidden_size) / t                # fc1 input, inner activations
    return dense - dense_mlp + moe_mlp_activation_bytes(config, moe, b, t, e, cp)


def _chunk_activation_bytes(config, layers: int, per_layer: float, layer_input: float
                            ) -> Tuple[float, float]:
    """(bytes kept per micro-batch, transient recomputation bytes) of ``layers`` layers."""
    if config.recompute_granularity != "full" or layers == 0:
        return layers * per_layer, 0.0
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return math.ceil(layers / n) * layer_input, min(n, layers) * per_layer
    checkpointed = min(n, layers)
    kept = checkpointed * layer_input + (layers - checkpointed) * per_layer
    return kept, per_layer if checkpointed else 0.0


def _mixed_chunk_activation_bytes(config, per_layer: List[float], layer_input: float
                                  ) -> Tuple[float, float]:
    """:func:`_chunk_activation_bytes` for layers of different sizes (an MoE model)."""
    layers = len(per_layer)
    if config.recompute_granularity != "full" or layers == 0:
        return sum(per_layer), 0.0
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        groups = [sum(per_layer[i:i + n]) for i in range(0, layers, n)]
        return len(groups) * layer_input, max(groups)
    checkpointed = min(n, layers)
    kept = checkpointed * layer_input + sum(per_layer[checkpointed:])
    return kept, max(per_layer[:checkpointed]) if checkpointed else 0.0


def activation_bytes_on_rank(config: TransformerConfig, *, micro_batch_size: int,
                             num_microbatches: int, tp_size: int = 1, pp_size: int = 1,
                             pp_rank: int = 0, vp_size: Optional[int] = None,
                             sequence_parallel: bool = False, element_bytes: int = 2,
                             cp_size: int = 1, moe=None,
                             microbatch_group_size: Optional[int] = None,
                             attention_in_blocks: bool = False) -> float:
    """Peak activation bytes of this rank over one step of its pipeline schedule (``moe``: the
    MoE config of an MoE model, whose MoE layers count :func:`moe_mlp_activation_bytes`;
    ``microbatch_group_size``: the interleaved schedule's
    --microbatch-group-size-per-virtual-pipeline-stage)."""
    s, b, h, t = config.seq_length / cp_size, micro_batch_size, config.hidden_size, tp_size
    per_layer = layer_activation_bytes(config, b, t, sequence_parallel, element_bytes, cp_size,
                                       attention_in_blocks)
    sbh_local = s * b * h / (t if sequence_parallel else 1)
    # What a full-recompute checkpoint keeps: its input, 1/tp of it with
    # --distribute-saved-activations.
    saved_input = sbh_local * element_bytes / (
        t if config.distribute_saved_activations and not sequence_parallel else 1)
    v = vp_size or 1
    unit, workspace = [], 0.0
    for chunk in range(v):
        layers, offset = get_num_layers_and_offset(config, pp_size, pp_rank, vp_size,
                                                   chunk if vp_size else None)
        if moe is None or moe.num_moe_experts is None:
            kept, recompute = _chunk_activation_bytes(config, layers, per_layer, saved_input)
        else:
            sizes = [_layer_bytes(config, moe, offset + i + 1, per_layer, b, t,
                                  sequence_parallel, element_bytes, cp_size)
                     for i in range(layers)]
            kept, recompute = _mixed_chunk_activation_bytes(config, sizes, saved_input)
        workspace = max(workspace, recompute)
        if pp_rank == 0 and chunk == 0:
            kept += 8 * s * b + sbh_local                        # input ids, dropout mask
        if pp_rank == pp_size - 1 and chunk == v - 1:
            kept += 2 * element_bytes * sbh_local + 4 * s * b * config.padded_vocab_size / t
        unit.append(kept)
    alive = peak = 0.0
    for kind, chunk, _ in pipeline_order(pp_size, pp_rank, num_microbatches, vp_size,
                                         group_size=microbatch_group_size if vp_size else None):
        alive += unit[chunk] if kind == "F" else -unit[chunk]
        peak = max(peak, alive)
    return peak + workspace


# ------------------------------------------------------------------------- from the flags

def attention_runs_in_blocks(args, config: TransformerConfig) -> bool:
    """Whether a GPT run of these flags computes attention in blocks of query rows (what
    :meth:`~megatron.model.attention.CoreAttention._in_blocks` decides per call): CPU, float32
    or float64 attention (the parameters' dtype), the explicit body, plain causal self-attention of at least
    ``block_causal.MIN_SEQ`` tokens on one context-parallel rank, nothing needing the whole
    probability matrix."""
    on_cpu = device.resolves_to_cpu(getattr(args, "device", "auto"))
    return (on_cpu and args.params_dtype in (torch.float32, torch.float64)
            and not config.use_flash_attn and getattr(args, "context_parallel_size", 1) == 1
            and config.seq_length >= block_causal.MIN_SEQ and config.softmax_type == "vanilla"
            and config.window_size is None and config.attention_dropout == 0
            and not config.tracks_max_attention_logit
            and not config.apply_query_key_layer_scaling
            and not getattr(args, "reset_attention_mask", False))


def estimate_memory(args, pp_rank: int, num_microbatches: int,
                    config: Optional[TransformerConfig] = None) -> MemoryEstimate:
    """The estimate of pipeline stage ``pp_rank`` for validated ``args``."""
    from megatron.training.arguments import build_configs

    configs = build_configs(args)
    config = config or configs.model
    grad_dtype = torch.float32 if args.accumulate_allreduce_grads_in_fp32 else args.params_dtype
    act_dtype = torch.float32 if args.fp32_residual_connection else args.params_dtype
    tp, pp, vp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                  args.virtual_pipeline_model_parallel_size)
    cp = getattr(args, "context_parallel_size", 1)
    return MemoryEstimate(
        num_parameters=num_parameters_on_rank(config, tp, pp, pp_rank, vp, configs.moe),
        bytes_per_parameter=bytes_per_parameter(
            args.params_dtype, grad_dtype, args.optimizer, args.sgd_momentum,
            args.use_distributed_optimizer, args.data_parallel_size * cp,
            fully_sharded=getattr(args, "use_torch_fsdp2", False),
            accumulates=num_microbatches > 1),
        activation_bytes=activation_bytes_on_rank(
            config, micro_batch_size=args.micro_batch_size, num_microbatches=num_microbatches,
            tp_size=tp, pp_size=pp, pp_rank=pp_rank, vp_size=vp,
            sequence_parallel=args.sequence_parallel,
            element_bytes=torch.tensor([], dtype=act_dtype).element_size(), cp_size=cp,
            moe=configs.moe,
            microbatch_group_size=getattr(args, "microbatch_group_size_per_vp_stage", None),
            attention_in_blocks=attention_runs_in_blocks(args, config)))


def measured_peak_bytes() -> Tuple[float, str]:
    """(peak bytes, what was measured): the allocator's peak on CUDA, else the process's peak
    resident set (which also counts the Python interpreter and libraries)."""
    if device.is_cuda():
        return float(torch.cuda.max_memory_allocated(device.current_device())), \
            "torch.cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return float(rss if sys.platform == "darwin" else rss * 1024), "max resident set size"


# ------------------------------------------------------------------------- limits

def meminfo_total_bytes(path: str = "/proc/meminfo") -> Optional[int]:
    """MemTotal of this machine, or None where /proc/meminfo does not exist."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1)
    except OSError:
        return None
    return None


def rank_memory_limits(on_cuda: bool, ranks_per_node: int, budget_gb: Optional[float] = None,
                       meminfo_path: str = "/proc/meminfo") -> List[Tuple[float, str]]:
    """``(bytes, description)`` of each limit one rank's memory must stay under: the GPU's
    memory on CUDA, the machine's MemTotal shared by its ranks on CPU, and ``budget_gb``."""
    gb = 1024 ** 3
    limits = []
    if on_cuda:
        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(0).total_memory
            limits.append((total, f"the memory of {torch.cuda.get_device_name(0)} "
                                  f"({total / gb:.1f} GB)"))
    else:
        total = meminfo_total_bytes(meminfo_path)
        if total is not None:
            limits.append((total / ranks_per_node,
                           f"MemTotal {total / gb:.1f} GB / {ranks_per_node} ranks per "
                           f"node = {total / ranks_per_node / gb:.2f} GB"))
    if budget_gb is not None:
        limits.append((budget_gb * gb, f"--memory-budget-gb {budget_gb:g}"))
    return limits


def startup_memory_check(args, pstate, num_microbatches: int, ranks_per_node: int,
                         meminfo_path: str = "/proc/meminfo") -> List[str]:
    """Before anything is built: this rank's predicted memory, and a warning when it exceeds
    what the rank will have (lines for the log; the run goes on, the user decides).

    Args:
        num_microbatches: at the full global batch (the most a ramp-up reaches).
        ranks_per_node: processes sharing this machine's memory (CPU).
    """
    est = estimate_memory(args, pstate.pp_rank, num_microbatches)
    gb = 1024 ** 3
    lines = [f"[Rank {pstate.rank}] (tensor, pipeline) rank ({pstate.tp_rank}, {pstate.pp_rank}) "
             f"predicted memory before start-up: {est.total_bytes / gb:.2f} GB "
             f"(weights+grads+optimizer {est.weight_and_optimizer_bytes / gb:.2f} GB, "
             f"activations {est.activation_bytes / gb:.2f} GB)"
             + _context_parallel_note(pstate)]
    for limit, description in rank_memory_limits(device.is_cuda(), ranks_per_node,
                                                 meminfo_path=meminfo_path):
        if est.total_bytes > limit:
            lines.append(f"WARNING: pipeline stage {pstate.pp_rank} is predicted to need "
                         f"{est.total_bytes / gb:.2f} GB per rank, more than {description}; "
                         f"the run may fail to allocate or swap (see tools/estimate_memory.py "
                         f"for every stage; more tensor/pipeline parallelism, "
                         f"--use-distributed-optimizer, --recompute-activations or a smaller "
                         f"--micro-batch-size lower it)")
    return lines


def memory_report(args, pstate, num_microbatches: int) -> str:
    """One line: theoretical memory of this rank next to its measured peak."""
    est = estimate_memory(args, pstate.pp_rank, num_microbatches)
    peak, source = measured_peak_bytes()
    return (f"[Rank {pstate.rank}] (tensor, pipeline) rank ({pstate.tp_rank}, {pstate.pp_rank}) "
            f"theoretical memory (MB): weights+grads+optimizer "
            f"{est.weight_and_optimizer_bytes / MB:.2f} ({est.num_parameters} parameters x "
            f"{est.bytes_per_parameter:.2f} bytes) | activations {est.activation_bytes / MB:.2f} "
            f"| total {est.total_bytes / MB:.2f} | measured peak (MB): {peak / MB:.2f} "
            f"({source})" + _context_parallel_note(pstate))


def _context_parallel_note(pstate) -> str:
    cp = getattr(pstate, "cp_size", 1)
    return f" [context-parallel {cp}: activations of s/{cp} tokens]" if cp > 1 else ""
