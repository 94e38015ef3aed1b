"""Typed config of the transformer (the parallel degrees are checked by the layout object,
:func:`megatron.core.parallel_state.check_degrees`).

``megatron/training/configs.py`` turns Megatron's flags into these; core code takes only these
(never the argparse namespace). Each config checks its own consistency in ``__post_init__``
and names the flags involved, so a wrong combination fails before any process group is
created.
"""

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch

from megatron.core.mup import (mup_flag_problem, mup_model_conflict, resolve_output_mult,
                               resolve_width_mult)

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# --recompute-modules built here (Megatron-Core's names).
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts", "mhc",
                     "mla_up_proj")


def mhc_conflict(config) -> Optional[str]:
    """Why the hyper-connection settings cannot run (None: they can, or are off)."""
    if config.enable_mhc_connections:
        if config.mhc_num_residual_streams < 1:
            return ("--mhc-num-residual-streams must be >= 1, got "
                    f"{config.mhc_num_residual_streams}")
        if config.mhc_sinkhorn_iterations < 1:
            return ("--mhc-sinkhorn-iterations must be >= 1, got "
                    f"{config.mhc_sinkhorn_iterations}")
        if config.apply_residual_connection_post_layernorm or config.fp32_residual_connection:
            return ("--enable-mhc-connections cannot be combined with "
                    "--apply-residual-connection-post-layernorm or --fp32-residual-connection")
    elif "mhc" in config.recompute_modules and config.recompute_granularity == "selective":
        return "--recompute-modules mhc needs --enable-mhc-connections"
    if config.recompute_granularity == "selective" and "mhc" in config.recompute_modules:
        if "mlp" in config.recompute_modules:
            return "--recompute-modules mhc and mlp cannot be used together"
    if config.mhc_recompute_layer_num is not None and config.mhc_recompute_layer_num < 1:
        return f"--mhc-recompute-layer-num must be >= 1, got {config.mhc_recompute_layer_num}"
    return None


class ConfigError(ValueError):
    """An impossible combination of settings; the message names the flags and values."""


@dataclass
class TransformerConfig:
    """Shape and numerics of a GPT-style transformer (Megatron flag names in comments)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    max_position_embeddings: int
    seq_length: int
    ffn_hidden_size: Optional[int] = None          # --ffn-hidden-size (default 4h)
    kv_channels: Optional[int] = None              # --kv-channels (default h / heads)
    num_query_groups: Optional[int] = None         # --num-query-groups with --group-query-attention
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5                # --norm-epsilon
    normalization: str = "LayerNorm"               # LayerNorm | RMSNorm
    apply_residual_connection_post_layernorm: bool = False
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | yarn | none
    # --cp-comm-type (with --context-parallel-size): one type, or a tuple of one per layer
    cp_comm_type: Union[str, Tuple[str, ...]] = "p2p"
    rotary_percent: float = 1.0
    rotary_base: int = 10000
    rotary_interleaved: bool = False               # rotate pairs (2i, 2i+1), not the halves
    # --sft: rotary angles follow the batch's position ids, which restart at 0 for every
    # packed sequence (as Megatron's packed THD attention rotates each sequence from 0);
    # otherwise the angles are those of 0 .. s-1 whatever the position ids.
    rotary_from_position_ids: bool = False
    rotary_seq_len_interpolation_factor: Optional[int] = None  # positions divided by it
    use_rope_scaling: bool = False                 # Llama 3.1 frequency rescaling (rope)
    rope_scaling_factor: float = 8.0
    # YaRN (position_embedding_type yarn); None: Megatron-Core's default (rotary_pos_embedding).
    yarn_rotary_scaling_factor: float = 1.0        # --rotary-scaling-factor
    yarn_original_max_position_embeddings: Optional[int] = None
    yarn_beta_fast: Optional[float] = None
    yarn_beta_slow: Optional[float] = None
    yarn_mscale: float = 1.0                       # --mscale
    yarn_mscale_all_dim: float = 0.0               # --mscale-all-dim
    yarn_correction_range_round_to_int: Optional[bool] = None
    swiglu: bool = False
    openai_gelu: bool = False
    squared_relu: bool = False                     # MLP activation relu(x)^2
    # --quick-geglu: a gated unit like SwiGLU with x * sigmoid(1.702 x) on the gate half.
    # --glu-linear-offset is added to the linear half of a gated unit; with
    # --activation-func-clamp-value v the gate is clamped to <= v and the linear half to [-v, v]
    # before the activation (gpt-oss's MLP: quick GeGLU, offset 1, clamp 7).
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    apply_layernorm_1p: bool = False               # norm weight stored as gamma - 1 (zeros)
    qk_layernorm: bool = False                     # a norm over head_dim on query and key
    init_method_xavier_uniform: bool = False       # xavier-uniform instead of N(0, std^2)
    perform_initialization: bool = True            # --no-initialization: weights not drawn
    add_bias_linear: bool = True                   # --disable-bias-linear sets False
    add_qkv_bias: bool = False
    untie_embeddings_and_output_weights: bool = False
    params_dtype: torch.dtype = torch.float32      # --fp16 / --bf16
    fp16: bool = False
    bf16: bool = False
    fp32_residual_connection: bool = False
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    masked_softmax_fusion: bool = True
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    bias_swiglu_fusion: bool = True
    use_flash_attn: bool = False
    recompute_granularity: Optional[str] = None    # full | selective
    recompute_method: Optional[str] = None         # uniform | block
    recompute_num_layers: Optional[int] = None
    # --distribute-saved-activations: each tensor-parallel rank keeps 1/tp of the input of every
    # fully recomputed chunk and the chunk all-gathers it back before recomputing.
    distribute_saved_activations: bool = False
    # With selective recomputation, what is recomputed (--recompute-modules): see
    # RECOMPUTE_MODULES; Megatron-Core's default is core attention alone.
    recompute_modules: Tuple[str, ...] = ("core_attn",)
    # --mlp-chunks-for-training: in training, the MLP (or MoE) block runs on this many pieces
    # of the sequence one after the other (less peak memory, the same function).
    mlp_chunks_for_training: int = 1
    # --cpu-offloading-num-layers: the first N layers keep what they save for backward on the
    # host (megatron/model/activation_offload.py); 0: off.
    cpu_offloading_num_layers: int = 0
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    # --fine-grained-activation-offloading: the modules of --offload-modules keep the saved
    # tensors of at least --min-offloaded-tensor-size elements in host memory
    # (megatron/model/fine_grained_offload.py, with its choice of groups).
    fine_grained_activation_offloading: bool = False
    offload_modules: Tuple[str, ...] = ()
    min_offloaded_tensor_size: int = 1048576
    delta_offload_bytes_across_pp_ranks: int = 0
    activation_offload_fraction: float = 1.0
    first_pipeline_num_layers: Optional[int] = None  # --decoder-first-pipeline-num-layers
    last_pipeline_num_layers: Optional[int] = None   # --decoder-last-pipeline-num-layers
    pipeline_model_parallel_layout: Optional[str] = None  # every stage written out
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    fp16_lm_cross_entropy: bool = False
    # --output-logit-dtype: the output layer's product in this dtype (None: the hidden states').
    logit_dtype: Optional[torch.dtype] = None
    # The chunked cross entropy kernel, its backward written into the logits' storage.
    cross_entropy_loss_fusion: bool = True
    # --calculate-per-token-loss: the losses are sums over tokens and the gradients are divided
    # by the global batch's token count, so the auxiliary losses (MoE, multi-token prediction)
    # attach their values multiplied by token counts (see the router and the GPT model).
    calculate_per_token_loss: bool = False
    # Sliding-window attention: (left, right) keys a query sees besides itself, -1 = no limit on
    # that side (--window-size); which layers keep full attention (--window-attn-skip-freq: an
    # int N = every N-th layer, or one 1 (window) / 0 (full) per layer).
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: Optional[Union[int, Tuple[int, ...]]] = None
    # --softmax-type: vanilla, off-by-one (an extra zero logit per head in the denominator) or
    # learnable (that logit a per-head parameter, gpt-oss's attention sinks).
    softmax_type: str = "vanilla"
    # Multi-latent attention (--multi-latent-attention): queries (optionally through a
    # --q-lora-rank bottleneck), keys and values from a --kv-lora-rank latent, per-head
    # dims --qk-head-dim (+ --qk-pos-emb-head-dim rotary channels) and --v-head-dim.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # --cache-mla-latents: generation caches each token's normalised kv latent and rotated
    # shared key channels (kv_lora_rank + qk_pos_emb_head_dim values per layer) and absorbs the
    # key/value up projection into the query and the output. --mla-down-proj-fusion: the query
    # and key/value down projections are one linear_qkv_down_proj (needs --q-lora-rank).
    cache_mla_latents: bool = False
    mla_down_proj_fusion: bool = False
    # --rope-type: rope or yarn for MLA's rotary channels (None: yarn); standard attention
    # accepts only rope (its YaRN is --position-embedding-type yarn), as in Megatron-Core.
    rope_type: Optional[str] = None
    # Attention variants of Megatron-Core: --qk-l2-norm (query and key scaled to unit RMS over
    # head_dim, no weight: Llama 4), --attention-output-gate (a sigmoid gate per head channel,
    # its rows in the QKV projection: Qwen3-Next), --no-rope-freq (layers without rotary
    # positions: an int N = every N-th layer, or one 1 (no rope) / 0 per layer).
    qk_l2_norm: bool = False
    attention_output_gate: bool = False
    no_rope_freq: Optional[Union[int, Tuple[int, ...]]] = None
    # --embedding-init-method-std: N(0, std^2) for the embedding tables (None: as other weights).
    embedding_init_method_std: Optional[float] = None
    # QK-clip (--qk-clip): after each optimizer step, the query and key weights of heads whose
    # largest pre-softmax logit exceeded --qk-clip-threshold are scaled down (eta^alpha on the
    # query side, eta^(1 - alpha) on the key side, eta = threshold / max logit).
    # --log-max-attention-logit tracks and logs that maximum without clipping.
    qk_clip: bool = False
    qk_clip_alpha: float = 0.5
    qk_clip_threshold: float = 100.0
    log_max_attention_logit: bool = False
    # --heterogeneous-layers-config-path / -encoded-json: one BlockConfig per layer
    # (megatron.core.heterogeneous), None for a model whose layers are all alike.
    heterogeneous_blocks: Optional[Tuple[Any, ...]] = None

    # --experimental-attention-variant: gdn (gated delta net linear attention, Qwen3-Next) or
    # dsa (below). Gated delta net:
    # which layers (--linear-attention-freq: an int N = every N-th layer keeps standard
    # attention, or one 1 (linear) / 0 (standard) per layer) and its head sizes.
    experimental_attention_variant: Optional[str] = None
    linear_attention_freq: Optional[Union[int, Tuple[int, ...]]] = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # DeepSeek sparse attention (--experimental-attention-variant dsa, megatron/model/dsa.py):
    # an indexer of --dsa-indexer-n-heads heads of --dsa-indexer-head-dim picks each query's
    # --dsa-indexer-topk keys for multi-latent attention.
    dsa_indexer_n_heads: Optional[int] = None
    dsa_indexer_head_dim: Optional[int] = None
    dsa_indexer_topk: Optional[int] = None
    dsa_indexer_loss_coeff: Optional[float] = None
    dsa_indexer_use_sparse_loss: bool = False
    dsa_indexer_rope_interleaved: bool = False
    dsa_indexer_rotate_activation: bool = True
    dsa_indexer_scoring_relu: bool = True
    dsa_indexer_k_norm_epsilon: Optional[float] = None
    dsa_indexer_k_norm_fp32: bool = False

    @property
    def tracks_max_attention_logit(self) -> bool:
        """Whether attention records each head's largest logit during training forwards."""
        return self.qk_clip or self.log_max_attention_logit

    # Maximal update parametrization (--use-mup and --mup-*; megatron/core/mup.py). After
    # __post_init__, mup_width_mult is the resolved width multiplier and mup_output_mult the
    # logit multiplier in effect.
    use_mup: bool = False
    mup_width_mult: float = 1.0
    mup_base_hidden_size: Optional[int] = None
    mup_embedding_mult: float = 1.0
    mup_output_mult: float = 1.0
    mup_base_head_dim: Optional[float] = None
    mup_attn_scale_power: float = 1.0
    # Manifold-constrained hyper-connections (--enable-mhc-connections;
    # megatron/model/hyper_connection.py): n residual streams mixed by per-token matrices, the
    # residual one projected onto doubly stochastic matrices by Sinkhorn-Knopp iterations.
    # --mhc-recompute-layer-num: layers per recompute group of the 'mhc' recompute module
    # (None: all layers of a pipeline stage form one group).
    enable_mhc_connections: bool = False
    mhc_num_residual_streams: int = 4
    mhc_sinkhorn_iterations: int = 20
    mhc_init_gating_factor: float = 0.01
    mhc_recompute_layer_num: Optional[int] = None
    # --config-logger-dir: where the models write their constructor arguments, initial
    # weights and forward inputs/logits (megatron/core/config_logger.py); '' for nowhere
    config_logger_dir: str = ""

    @property
    def residual_stream_size(self) -> int:
        """Width of the activations between layers and pipeline stages: ``n * h`` with
        hyper-connections, else ``h``."""
        if self.enable_mhc_connections:
            return self.mhc_num_residual_streams * self.hidden_size
        return self.hidden_size

    def _resolve_mup(self) -> Optional[str]:
        """Check the muP settings and resolve the width and logit multipliers (None: fine)."""
        problem = mup_flag_problem(self.use_mup, self.hidden_size, self.mup_width_mult,
                                   self.mup_base_hidden_size, self.mup_embedding_mult,
                                   self.mup_output_mult, self.mup_base_head_dim,
                                   self.mup_attn_scale_power) or mup_model_conflict(
                                       self.use_mup, self.multi_latent_attention,
                                       self.init_method_xavier_uniform)
        if problem is None and self.use_mup:
            self.mup_width_mult = resolve_width_mult(self.hidden_size, self.mup_width_mult,
                                                     self.mup_base_hidden_size)
            self.mup_output_mult = resolve_output_mult(self.mup_output_mult,
                                                       self.mup_width_mult)
        return problem

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLP's first projection holds ``[gate; linear]`` halves (2 ffn rows)."""
        return self.swiglu or self.quick_geglu

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            if self.swiglu:
                # Keeps the parameter count of a 4h GeLU MLP, rounded down to a multiple of 64.
                self.ffn_hidden_size = int((4 * self.hidden_size * 2 / 3) / 64) * 64
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ConfigError(
                    f"--hidden-size ({self.hidden_size}) must be divisible by "
                    f"--num-attention-heads ({self.num_attention_heads}) unless --kv-channels "
                    "is given")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ConfigError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                f"--num-query-groups ({self.num_query_groups})")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"--normalization must be LayerNorm or RMSNorm, "
                              f"got {self.normalization!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope", "yarn", "none"):
            raise ConfigError("--position-embedding-type must be learned_absolute, rope, yarn or "
                              f"none, got {self.position_embedding_type!r}")
        problem = (rope_variant_conflict(self) or mla_conflict(self)
                   or attention_variant_conflict(self) or gdn_conflict(self)
                   or self._resolve_mup() or mhc_conflict(self))
        if problem is not None:
            raise ConfigError(problem)
        if (self.position_embedding_type == "learned_absolute"
                and self.seq_length > self.max_position_embeddings):
            raise ConfigError(
                f"--seq-length ({self.seq_length}) exceeds --max-position-embeddings "
                f"({self.max_position_embeddings})")
        if self.mlp_chunks_for_training < 1:
            raise ConfigError(f"--mlp-chunks-for-training must be >= 1, got "
                              f"{self.mlp_chunks_for_training}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError("--recompute-granularity must be full or selective, "
                              f"got {self.recompute_granularity!r}")
        if self.recompute_granularity == "full":
            if self.recompute_method not in ("uniform", "block"):
                raise ConfigError("--recompute-granularity full needs --recompute-method "
                                  f"uniform or block, got {self.recompute_method!r}")
            if self.recompute_num_layers is None or self.recompute_num_layers < 1:
                raise ConfigError("--recompute-granularity full needs --recompute-num-layers "
                                  f">= 1, got {self.recompute_num_layers}")
        elif self.recompute_granularity == "selective" and self.recompute_method is not None:
            raise ConfigError("--recompute-method applies only to --recompute-granularity full")
        unknown = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(f"--recompute-modules {' '.join(unknown)}: not built; choose from "
                              f"{', '.join(RECOMPUTE_MODULES)}")
        if self.recomputes("mla_up_proj") and not self.multi_latent_attention:
            raise ConfigError("--recompute-modules mla_up_proj recomputes multi-latent "
                              "attention's up projections: it needs --multi-latent-attention")
        if self.recomputes("mla_up_proj") and self.experimental_attention_variant == "dsa":
            raise ConfigError("--recompute-modules mla_up_proj with --experimental-attention-"
                              "variant dsa is not built yet (the indexer reads the query "
                              "latent); drop mla_up_proj")
        if not 0 <= self.cpu_offloading_num_layers < self.num_layers:
            raise ConfigError(f"--cpu-offloading-num-layers must be in [0, --num-layers="
                              f"{self.num_layers}), got {self.cpu_offloading_num_layers}")
        if self.fp16 and self.bf16:
            raise ConfigError("--fp16 and --bf16 cannot both be given")
        problem = numerics_flag_conflict(self)
        if problem is not None:
            raise ConfigError(problem)
        if (self.rotary_seq_len_interpolation_factor is not None
                and self.rotary_seq_len_interpolation_factor <= 0):
            raise ConfigError("--rotary-seq-len-interpolation-factor must be > 0, got "
                              f"{self.rotary_seq_len_interpolation_factor}")
        check_window_settings(self.window_size, self.window_attn_skip_freq, self.num_layers)
        if not isinstance(self.cp_comm_type, str):
            self.cp_comm_type = tuple(self.cp_comm_type)
            if len(self.cp_comm_type) != self.num_layers:
                raise ConfigError(
                    f"--cp-comm-type takes one type, or one per layer: got "
                    f"{len(self.cp_comm_type)} for --num-layers {self.num_layers}")
        if self.softmax_type not in SOFTMAX_TYPES:
            raise ConfigError(f"--softmax-type must be one of {', '.join(SOFTMAX_TYPES)}, got "
                              f"{self.softmax_type!r}")
        if self.qk_clip and not 0.0 <= self.qk_clip_alpha <= 1.0:
            raise ConfigError(f"--qk-clip-alpha must lie in [0, 1], got {self.qk_clip_alpha}")
        if self.qk_clip and not self.qk_clip_threshold > 0:
            raise ConfigError(f"--qk-clip-threshold must be > 0, got {self.qk_clip_threshold}")
        if self.apply_query_key_layer_scaling:
            # The scores are multiplied back by the layer number inside the softmax, which must
            # therefore run in fp32 (as Megatron sets it).
            self.attention_softmax_in_fp32 = True

    def layer_cp_comm_type(self, layer_number: int) -> str:
        """The context-parallel exchange of 1-based ``layer_number`` (``--cp-comm-type``); a
        layer after the last (multi-token prediction's) takes the last layer's."""
        if isinstance(self.cp_comm_type, str):
            return self.cp_comm_type
        return self.cp_comm_type[min(layer_number, self.num_layers) - 1]

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation covers ``module`` (a --recompute-modules name)."""
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    def layer_window(self, layer_number: int) -> Optional[Tuple[int, int]]:
        """The ``(left, right)`` window of 1-based ``layer_number``, None for full attention.

        Without --window-attn-skip-freq every layer is windowed; an int N leaves layers N, 2N,
        ... with full attention; a list gives 1 (window) or 0 (full) per layer, first layer
        first.
        """
        if self.window_size is None:
            return None
        freq = self.window_attn_skip_freq
        if freq is None:
            return self.window_size
        if isinstance(freq, int):
            return None if layer_number % freq == 0 else self.window_size
        return self.window_size if freq[layer_number - 1] else None

    def layer_uses_rope(self, layer_number: int) -> bool:
        """False for the 1-based layers --no-rope-freq leaves without rotary positions: an int
        N names layers N, 2N, ...; a list holds 1 for a layer without rope."""
        freq = self.no_rope_freq
        if freq is None or layer_number > self.num_layers:  # multi-token prediction layers
            return True
        if isinstance(freq, int):
            return layer_number % freq != 0
        return not freq[layer_number - 1]

    def check_splittable(self, tp_size: int, pp_size: int = 1) -> None:
        """Reject shapes that cannot be split over ``tp_size`` x ``pp_size`` ranks."""
        checks = [
            ("--num-attention-heads", self.num_attention_heads, "--tensor-model-parallel-size",
             tp_size),
            ("--ffn-hidden-size", self.ffn_hidden_size, "--tensor-model-parallel-size", tp_size),
            ("padded vocab size", self.padded_vocab_size, "--tensor-model-parallel-size", tp_size),
        ]
        if (self.pipeline_model_parallel_layout is not None
                or self.account_for_embedding_in_pipeline_split
                or self.account_for_loss_in_pipeline_split):
            pass  # their stage counts are checked by pipeline_parallel.layer_layout
        elif self.first_pipeline_num_layers is None and self.last_pipeline_num_layers is None:
            checks.append(("--num-layers", self.num_layers, "--pipeline-model-parallel-size",
                           pp_size))
        else:
            pipeline_layer_counts(self.num_layers, pp_size, self.first_pipeline_num_layers,
                                  self.last_pipeline_num_layers)
        if self.num_query_groups != self.num_attention_heads:
            checks.append(("--num-query-groups", self.num_query_groups,
                           "--tensor-model-parallel-size", tp_size))
        for name, value, by_name, by in checks:
            if value % by != 0:
                raise ConfigError(f"{name} ({value}) must be divisible by {by_name} ({by})")


def check_window_settings(window_size, skip_freq, num_layers: int) -> None:
    """Refuse a malformed --window-size / --window-attn-skip-freq, naming the flag."""
    if window_size is None:
        if skip_freq is not None:
            raise ConfigError("--window-attn-skip-freq needs --window-size (it picks which "
                              "layers skip the window)")
        return
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(not isinstance(v, int) or v < -1 for v in window_size)):
        raise ConfigError(f"--window-size must be two integers 'left,right', each >= 0 or -1 "
                          f"(no limit), got {window_size!r}")
    if isinstance(skip_freq, int):
        if skip_freq < 1:
            raise ConfigError(f"--window-attn-skip-freq must be >= 1, got {skip_freq}")
    elif skip_freq is not None and (len(skip_freq) != num_layers
                                    or any(v not in (0, 1) for v in skip_freq)):
        raise ConfigError(f"--window-attn-skip-freq: a list needs one 0 (full) or 1 (window) "
                          f"per layer (--num-layers {num_layers}), got {list(skip_freq)}")


def numerics_flag_conflict(flags) -> Optional[str]:
    """One line naming two numerics flags that cannot be combined, or None.

    ``flags`` is a :class:`TransformerConfig` or the parsed namespace (same field names).
    Megatron's RMSNorm has no 1p form, and its squared ReLU replaces GeLU but not the gated
    SwiGLU unit; the tanh GeLU would silently win over it in the MLP, so that pair is refused too.
    """
    if flags.apply_layernorm_1p and flags.normalization == "RMSNorm":
        return ("--apply-layernorm-1p applies to LayerNorm only; it cannot be combined with "
                "--normalization RMSNorm")
    if flags.squared_relu and flags.swiglu:
        return "--squared-relu cannot be combined with --swiglu (one MLP activation)"
    if flags.squared_relu and flags.openai_gelu:
        return "--squared-relu cannot be combined with --openai-gelu (one MLP activation)"
    quick = getattr(flags, "quick_geglu", False)
    for other, name in ((flags.swiglu, "--swiglu"), (flags.squared_relu, "--squared-relu"),
                        (flags.openai_gelu, "--openai-gelu")):
        if quick and other:
            return f"--quick-geglu cannot be combined with {name} (one MLP activation)"
    gated = flags.swiglu or quick
    offset = getattr(flags, "glu_linear_offset", 0.0)
    clamp = getattr(flags, "activation_func_clamp_value", None)
    if not gated and (offset or clamp is not None):
        flag = "--glu-linear-offset" if offset else "--activation-func-clamp-value"
        return f"{flag} applies to a gated MLP only; add --swiglu or --quick-geglu"
    if clamp is not None and not clamp > 0:
        return f"--activation-func-clamp-value must be > 0, got {clamp}"
    return None


def pipeline_layer_counts(num_layers: int, pp_size: int, first: Optional[int] = None,
                          last: Optional[int] = None) -> list:
    """Layers held by each pipeline stage.

    Even split by default; ``first`` / ``last`` (``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers``) fix the first or last stage's count and the remaining
    layers are split evenly over the other stages, e.g. 10 layers, pp 4, first 1, last 3 ->
    [1, 3, 3, 3].
    """
    if first is None and last is None:
        if num_layers % pp_size != 0:
            raise ConfigError(f"--num-layers ({num_layers}) must be divisible by "
                              f"--pipeline-model-parallel-size ({pp_size})")
        return [num_layers // pp_size] * pp_size
    if pp_size == 1:
        return [num_layers]  # one stage holds everything, whatever the per-stage settings
    for flag, value in (("--decoder-first-pipeline-num-layers", first),
                        ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    fixed = [n for n in (first, last) if n is not None]
    middle = pp_size - len(fixed)
    remaining = num_layers - sum(fixed)
    if remaining < 0 or (middle == 0 and remaining != 0) or (middle > 0 and (
            remaining == 0 or remaining % middle != 0)):
        raise ConfigError(
            f"--num-layers ({num_layers}) minus --decoder-first-pipeline-num-layers ({first}) "
            f"and --decoder-last-pipeline-num-layers ({last}) leaves {remaining} layers, which "
            f"cannot be split evenly over the other {middle} pipeline stage(s)")
    per = remaining // middle if middle else 0
    counts = [per] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def mla_conflict(config: TransformerConfig) -> Optional[str]:
    """Why the multi-latent attention flags of ``config`` cannot be built (None: they can)."""
    if not config.multi_latent_attention:
        for flag, on in (("--cache-mla-latents", config.cache_mla_latents),
                         ("--mla-down-proj-fusion", config.mla_down_proj_fusion)):
            if on:
                return f"{flag} applies to --multi-latent-attention only: add it or drop {flag}"
        return None
    if config.mla_down_proj_fusion and config.q_lora_rank is None:
        return ("--mla-down-proj-fusion fuses the query and key/value down projections: it "
                "needs --q-lora-rank (the query has no down projection without it)")
    if config.position_embedding_type not in ("rope", "yarn"):
        return ("--multi-latent-attention needs --position-embedding-type rope or yarn, got "
                f"{config.position_embedding_type}")
    if config.num_query_groups != config.num_attention_heads:
        return "--multi-latent-attention does not combine with --group-query-attention"
    if config.rotary_percent != 1.0:
        return "--multi-latent-attention rotates all --qk-pos-emb-head-dim channels: drop " \
            f"--rotary-percent {config.rotary_percent}"
    for flag, on in (("--use-rope-scaling", config.use_rope_scaling),
                     ("--rotary-seq-len-interpolation-factor",
                      config.rotary_seq_len_interpolation_factor not in (None, 1, 1.0))):
        if on:
            return (f"{flag} does not apply to multi-latent attention's rotary channels (plain "
                    "rope or YaRN, chosen by --rope-type): drop it")
    sizes = [("--kv-lora-rank", config.kv_lora_rank), ("--qk-head-dim", config.qk_head_dim),
             ("--qk-pos-emb-head-dim", config.qk_pos_emb_head_dim),
             ("--v-head-dim", config.v_head_dim)]
    if config.q_lora_rank is not None:
        sizes.append(("--q-lora-rank", config.q_lora_rank))
    for flag, value in sizes:
        if value is None or value <= 0:
            return f"{flag} must be a positive integer with --multi-latent-attention, got {value}"
    if config.qk_pos_emb_head_dim % 2:
        return f"--qk-pos-emb-head-dim must be even (rotary pairs), got " \
            f"{config.qk_pos_emb_head_dim}"
    return None


def attention_variant_conflict(config: TransformerConfig) -> Optional[str]:
    """Why --qk-l2-norm, --attention-output-gate, --no-rope-freq or
    --embedding-init-method-std cannot be built as given (None: they can)."""
    if config.rope_type not in (None, "rope") and not config.multi_latent_attention:
        return (f"--rope-type {config.rope_type} applies to --multi-latent-attention only; "
                "standard attention takes --rope-type rope (for YaRN use "
                "--position-embedding-type yarn)")
    if config.multi_latent_attention:
        for flag, on in (("--qk-l2-norm", config.qk_l2_norm),
                         ("--attention-output-gate", config.attention_output_gate)):
            if on:
                return f"{flag} applies to standard self-attention, not --multi-latent-attention"
        if config.no_rope_freq is not None:
            return "--no-rope-freq is not built for --multi-latent-attention (its rotary " \
                "channels are part of every head); drop one"
    std = config.embedding_init_method_std
    if std is not None and std < 0:
        return f"--embedding-init-method-std must be >= 0, got {std}"
    freq = config.no_rope_freq
    if freq is None:
        return None
    if config.position_embedding_type not in ("rope", "yarn"):
        return ("--no-rope-freq picks layers without rotary positions: it needs "
                f"--position-embedding-type rope or yarn, got {config.position_embedding_type}")
    if isinstance(freq, int):
        if freq < 1 or config.num_layers % freq:
            return (f"--no-rope-freq {freq}: an int must be >= 1 and divide --num-layers "
                    f"({config.num_layers})")
    elif len(freq) != config.num_layers or any(v not in (0, 1) for v in freq):
        return (f"--no-rope-freq: a list needs one 1 (no rope) or 0 per layer (--num-layers "
                f"{config.num_layers}), got {list(freq)}")
    return None


def rope_variant_conflict(config: TransformerConfig) -> Optional[str]:
    """Why the rotary flags of ``config`` cannot be computed together (None: they can).

    YaRN rescales the frequencies of the whole head on its own (as Megatron-Core's
    ``YarnRotaryEmbedding``): the other rotary rescalings, a partial rotary and interleaved pairs
    do not combine with it.
    """
    if config.use_rope_scaling and config.rope_scaling_factor <= 0:
        return f"--rope-scaling-factor must be > 0, got {config.rope_scaling_factor}"
    if config.position_embedding_type != "yarn":
        return None
    others = [(config.use_rope_scaling, "--use-rope-scaling"),
              (config.rotary_seq_len_interpolation_factor is not None,
               "--rotary-seq-len-interpolation-factor"),
              (config.rotary_percent != 1.0, f"--rotary-percent {config.rotary_percent}"),
              (config.rotary_interleaved, "--rotary-interleaved")]
    for present, flag in others:
        if present:
            return f"--position-embedding-type yarn does not combine with {flag}"
    if config.yarn_rotary_scaling_factor <= 0:
        return f"--rotary-scaling-factor must be > 0, got {config.yarn_rotary_scaling_factor}"
    for name, flag in (("yarn_original_max_position_embeddings",
                        "--yarn-original-max-position-embeddings"),
                       ("yarn_beta_fast", "--yarn-beta-fast"),
                       ("yarn_beta_slow", "--yarn-beta-slow")):
        value = getattr(config, name)
        if value is not None and value <= 0:
            return f"{flag} must be > 0, got {value}"
    return None


def gdn_conflict(config: TransformerConfig) -> Optional[str]:
    """Why --experimental-attention-variant and the --linear-* flags cannot be built as given
    (None: they can)."""
    variant = config.experimental_attention_variant
    if variant is None:
        return None
    if variant == "dsa":
        return None                 # megatron.model.dsa; checked with the --dsa-* flags
    if variant not in ("gdn", "gated_delta_net"):
        return f"--experimental-attention-variant {variant}: not built yet (gdn and dsa are)"
    if config.multi_latent_attention:
        return "--experimental-attention-variant gdn with --multi-latent-attention: not built"
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    sizes = (nk, nv, config.linear_key_head_dim, config.linear_value_head_dim,
             config.linear_conv_kernel_dim)
    if min(sizes) < 1:
        return f"the --linear-* sizes must be >= 1, got {sizes}"
    if nv % nk:
        return (f"--linear-num-value-heads ({nv}) must be a multiple of "
                f"--linear-num-key-heads ({nk})")
    freq = config.linear_attention_freq
    if freq is None:
        return ("--experimental-attention-variant gdn needs --linear-attention-freq (an int N: "
                "every N-th layer keeps standard attention; or a 0/1 list, 1 = linear)")
    if isinstance(freq, int):
        return None if freq >= 1 else f"--linear-attention-freq {freq}: must be >= 1"
    if len(freq) != config.num_layers or any(v not in (0, 1) for v in freq):
        return (f"--linear-attention-freq: a list needs one 1 (linear) or 0 per layer "
                f"(--num-layers {config.num_layers}), got {list(freq)}")
    return None
