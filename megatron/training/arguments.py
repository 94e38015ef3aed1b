"""Megatron's command-line surface for GPT and BERT pretraining.

The flag names, defaults and groups follow Megatron-LM, so launch scripts written for it parse
unchanged. :func:`validate_args` derives every size (data-parallel size, micro-batches, ffn size,
kv channels, ...) and rejects impossible combinations before any process group exists;
:func:`build_configs` then turns the namespace into the typed configs each component takes.

This module holds the flags, their parsing and the order of the checks. The checks themselves
are in :mod:`megatron.training.validation`, the config builders in
:mod:`megatron.training.configs`; both are re-exported here, so callers import everything from
:mod:`megatron.training.arguments`.
"""

import argparse
import functools
import os
import sys
from typing import Callable, List, Optional

from megatron.core.config import SOFTMAX_TYPES, ConfigError
from megatron.model.moe.config import (DISPATCHER_TYPES, DROP_POLICIES, LOAD_BALANCING_TYPES,
                                       ROUTER_DTYPES, SCORE_FUNCTIONS, parse_moe_layer_freq)
from megatron.training.configs import (Configs, build_configs,  # noqa: F401  (re-exported)
                                       build_data_config)
from megatron.training import flag_registry, megatron_flags
from megatron.tokenizer.flags import add_tokenizer_option_args
from megatron.training.validation import (  # noqa: F401  (BERT_*, validate_bert_args re-exported)
    BERT_TOKENIZER_TYPES, ArgumentsError, check_flags, validate_bert_args)

TOKENIZER_TYPES = [
    "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer", "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer",
    "NullTokenizer", "SFTTokenizer",
]


def _add_network_size_args(parser):
    g = parser.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--encoder-num-layers", type=int, default=None)
    g.add_argument("--decoder-num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", type=str, default="learned_absolute",
                   choices=["learned_absolute", "rope", "yarn", "none"])
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="older spelling of --position-embedding-type rope")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="rotate neighbouring channel pairs (2i, 2i+1) instead of the two halves")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="divide positions by this factor before taking the rotary angles")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1 rescaling of the rotary frequencies (with rope)")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0,
                   help="the factor of --use-rope-scaling")
    _add_yarn_args(g)
    _add_mla_args(g)
    _add_gdn_args(g)
    _add_mhc_args(g)
    _add_dsa_args(g)
    g.add_argument("--no-position-embedding", action="store_false",
                   dest="add_position_embedding")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--layernorm-epsilon", type=float, default=None,
                   help="older spelling of --norm-epsilon")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="LayerNorm weights hold gamma - 1 (start at zero): y = x_hat (1 + w) + b")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="a --normalization norm over head_dim on query and key, before rotary")
    g.add_argument("--qk-l2-norm", action="store_true",
                   help="scale query and key to unit RMS over head_dim (no weight), before "
                   "rotary; replaces --qk-layernorm (Llama 4)")
    g.add_argument("--qk-clip", action="store_true",
                   help="QK-clip: after each optimizer step, scale down the query and key "
                   "weights of heads whose largest attention logit of the step exceeded "
                   "--qk-clip-threshold")
    g.add_argument("--qk-clip-alpha", type=float, default=0.5,
                   help="the share of QK-clip's factor eta = threshold / max logit taken by "
                   "the query weights (eta^alpha; the key weights take eta^(1 - alpha))")
    g.add_argument("--qk-clip-threshold", type=float, default=100,
                   help="the largest attention logit QK-clip lets a head keep")
    g.add_argument("--attention-output-gate", action="store_true",
                   help="gate each head's attention output by sigmoid of a projection of the "
                   "layer input, projected with the queries (Qwen3-Next)")
    g.add_argument("--no-rope-freq", type=parse_no_rope_freq, default=None,
                   help="layers without rotary positions: N = every N-th layer (N, 2N, ...), "
                   "or a list with one 1 (no rope) / 0 per layer, e.g. \"[0,0,0,1]*2\"")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true")
    g.add_argument("--openai-gelu", action="store_true")
    g.add_argument("--squared-relu", action="store_true", help="MLP activation relu(x)^2")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--quick-geglu", action="store_true",
                   help="gated MLP with x * sigmoid(1.702 x) on the gate half (gpt-oss)")
    g.add_argument("--glu-linear-offset", type=float, default=0.0,
                   help="added to the linear half of a gated MLP unit (gpt-oss: 1)")
    g.add_argument("--activation-func-clamp-value", type=float, default=None,
                   help="clamp a gated unit's gate to <= v and its linear half to [-v, v] "
                   "before the activation (gpt-oss: 7)")
    g.add_argument("--onnx-safe", type=bool, required=False)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--bert-no-binary-head", action="store_false", dest="bert_binary_head",
                   help="BERT without the sentence-order (binary) head and its loss")
    g.add_argument("--window-size", type=parse_window_size, default=None,
                   help="sliding-window attention: 'left,right' keys a query sees on each "
                   "side besides itself (-1: no limit); default: full attention")
    g.add_argument("--window-attn-skip-freq", type=parse_window_attn_skip_freq, default=None,
                   help="layers that keep full attention: N = every N-th layer (N, 2N, ...), "
                   "or a list with one 1 (window) / 0 (full) per layer, e.g. \"[1,1,1,0]*3\"")
    g.add_argument("--heterogeneous-layers-config-path", type=str, default=None,
                   help="a JSON file (Hugging Face style, e.g. a Llama-Nemotron config.json) "
                   "whose \"block_configs\" give each layer's attention and MLP: no_op, "
                   "replace_with_linear, query groups, MLP size")
    g.add_argument("--heterogeneous-layers-config-encoded-json", type=str, default=None,
                   help="the same config as a JSON string (read from the file when that is "
                   "given; saved with the checkpoint's arguments)")
    g.add_argument("--softmax-type", default="vanilla", choices=list(SOFTMAX_TYPES),
                   help="off-by-one: an extra zero logit per head in the attention softmax; "
                   "learnable: that logit a learned per-head parameter (attention sinks)")


def parse_window_size(text: str):
    """``--window-size``: Megatron's tuple form ``"128,0"`` (or ``"(128,0)"``) -> (128, 0)."""
    try:
        values = tuple(int(v) for v in str(text).strip().strip("()").split(","))
    except ValueError:
        values = ()
    if len(values) != 2 or min(values) < -1:
        raise argparse.ArgumentTypeError(
            f"--window-size {text!r}: expected two integers 'left,right', each >= 0 or -1 "
            "(no limit on that side), e.g. '4096,0'")
    return values


def parse_window_attn_skip_freq(text: str):
    """``--window-attn-skip-freq``: an int N or a 0/1 list, read as --moe-layer-freq is."""
    try:
        return parse_moe_layer_freq(text, flag="--window-attn-skip-freq")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_no_rope_freq(text: str):
    """``--no-rope-freq``: an int N or a 0/1 list, read as --moe-layer-freq is."""
    try:
        return parse_moe_layer_freq(text, flag="--no-rope-freq")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_linear_attention_freq(text: str):
    """``--linear-attention-freq``: an int N or a 0/1 list, read as --moe-layer-freq is."""
    try:
        return parse_moe_layer_freq(text, flag="--linear-attention-freq")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _add_gdn_args(g):
    """Gated delta net linear attention (Qwen3-Next's linear layers)."""
    g.add_argument("--experimental-attention-variant", default=None,
                   choices=["gdn", "gdn2", "dsa", "gated_delta_net"],
                   help="gdn (or its older spelling gated_delta_net): gated delta net linear "
                   "attention on the layers --linear-attention-freq picks; dsa: DeepSeek "
                   "sparse attention over MLA (--dsa-*); gdn2 is refused (not built yet)")
    g.add_argument("--linear-attention-freq", type=parse_linear_attention_freq, default=None,
                   help="with gdn: N = every N-th layer (N, 2N, ...) keeps standard attention "
                   "and the others are linear, or a list with one 1 (linear) / 0 per layer")
    g.add_argument("--linear-conv-kernel-dim", type=int, default=4,
                   help="kernel of the causal depthwise convolution over query, key and value")
    g.add_argument("--linear-key-head-dim", type=int, default=128)
    g.add_argument("--linear-value-head-dim", type=int, default=128)
    g.add_argument("--linear-num-key-heads", type=int, default=16)
    g.add_argument("--linear-num-value-heads", type=int, default=32,
                   help="a multiple of --linear-num-key-heads")


def _add_mla_args(g):
    """Multi-latent attention (DeepSeek-V2/V3), with Megatron-Core's names and defaults."""
    g.add_argument("--multi-latent-attention", action="store_true", default=False,
                   help="multi-latent attention instead of standard self-attention")
    g.add_argument("--q-lora-rank", type=int, default=None,
                   help="MLA: rank of the query's low-rank projection (None: a full one)")
    g.add_argument("--kv-lora-rank", type=int, default=32,
                   help="MLA: rank of the compressed key/value latent")
    g.add_argument("--qk-head-dim", type=int, default=128,
                   help="MLA: per-head query/key channels without rotary position")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64,
                   help="MLA: per-head query/key rotary channels (the key's shared by heads)")
    g.add_argument("--v-head-dim", type=int, default=128, help="MLA: per-head value channels")
    g.add_argument("--rope-type", type=str, default=None, choices=["rope", "yarn"],
                   help="MLA: the rotary of the --qk-pos-emb-head-dim channels, plain rope or "
                        "YaRN (unset: yarn, Megatron-Core's MLA default); standard attention "
                        "takes only rope here (choose YaRN with --position-embedding-type)")
    g.add_argument("--cache-mla-latents", action="store_true", default=False,
                   help="MLA generation: cache each token's kv latent and rotary key "
                        "(kv_lora_rank + qk_pos_emb_head_dim values per layer) instead of the "
                        "expanded keys and values; the up projection is absorbed into the "
                        "query and output (generation only, refused in training)")
    g.add_argument("--mla-down-proj-fusion", action="store_true", default=False,
                   help="MLA: one linear_qkv_down_proj for the query and key/value down "
                        "projections (needs --q-lora-rank); checkpoints keep the separate "
                        "linear_q_down_proj / linear_kv_down_proj keys")


def _add_mhc_args(g):
    """Manifold-constrained hyper-connections (megatron/model/hyper_connection.py)."""
    g.add_argument("--enable-mhc-connections", action="store_true", default=False,
                   help="mHC: n residual streams mixed per token by learned matrices, the "
                        "residual one projected onto doubly stochastic matrices (GPT)")
    g.add_argument("--mhc-num-residual-streams", type=int, default=4,
                   help="mHC: number of residual streams n")
    g.add_argument("--mhc-sinkhorn-iterations", type=int, default=20,
                   help="mHC: Sinkhorn-Knopp iterations of the residual mixing matrix")
    g.add_argument("--mhc-init-gating-factor", type=float, default=0.01,
                   help="mHC: initial value of the alpha gates of the dynamic mappings")
    g.add_argument("--mhc-recompute-layer-num", type=int, default=None,
                   help="mHC: layers per recompute group of --recompute-modules mhc (default: "
                        "all layers of a pipeline stage)")


def _add_dsa_args(g):
    """DeepSeek sparse attention (DeepSeek-V3.2) for MLA, with Megatron-Core's names and
    defaults (megatron/model/dsa.py)."""
    g.add_argument("--dsa-indexer-n-heads", type=int, default=None,
                   help="DSA: the indexer's heads")
    g.add_argument("--dsa-indexer-head-dim", type=int, default=None,
                   help="DSA: the indexer's head dim (a power of two with the rotation)")
    g.add_argument("--dsa-indexer-topk", type=int, default=None,
                   help="DSA: keys each query attends to")
    g.add_argument("--dsa-indexer-topk-freq", type=int, default=1,
                   help="DSA: a layer in every N computes its top-k (only 1 is built)")
    g.add_argument("--dsa-indexer-skip-topk-offset", type=int, default=0,
                   help="DSA: layers before top-k sharing starts (with --dsa-indexer-topk-freq)")
    g.add_argument("--dsa-indexer-loss-coeff", type=float, default=None,
                   help="DSA: coefficient of the indexer's KL loss (unset or 0: no loss)")
    g.add_argument("--dsa-indexer-use-sparse-loss", action="store_true", default=False,
                   help="DSA: the indexer loss over the chosen keys only")
    g.add_argument("--dsa-kernel-backend", type=str, default="none",
                   choices=["none", "tilelang", "cudnn"],
                   help="DSA kernels (only none, plain PyTorch, is built)")
    g.add_argument("--dsa-indexer-rope-interleaved", action="store_true", default=False,
                   help="DSA: the indexer's rotary channels as neighbouring pairs, as MLA's")
    g.add_argument("--no-dsa-indexer-rotate-activation", "--disable-dsa-indexer-rotate-activation",
                   action="store_false", dest="dsa_indexer_rotate_activation", default=True,
                   help="DSA: no Hadamard rotation of the indexer's queries and keys")
    g.add_argument("--no-dsa-indexer-scoring-relu", "--disable-dsa-indexer-scoring-relu",
                   action="store_false", dest="dsa_indexer_scoring_relu", default=True,
                   help="DSA: no ReLU on the indexer's query-key products")
    g.add_argument("--dsa-indexer-k-norm-epsilon", type=float, default=None,
                   help="DSA: epsilon of the indexer's key LayerNorm (unset: --norm-epsilon)")
    g.add_argument("--dsa-indexer-k-norm-fp32", action="store_true", default=False,
                   help="DSA: the indexer's key LayerNorm in fp32")


def _add_yarn_args(g):
    """YaRN's flags (``--position-embedding-type yarn``); unset ones take Megatron-Core's
    defaults (4096 original positions, beta 32 / 1, rounded correction range)."""
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0,
                   help="YaRN: how many times the original positions the model runs at")
    g.add_argument("--yarn-original-max-position-embeddings", type=int, default=None,
                   help="YaRN: the positions the model was trained at (default 4096)")
    g.add_argument("--yarn-beta-fast", type=float, default=None,
                   help="YaRN: rotations bounding the unscaled frequencies (default 32)")
    g.add_argument("--yarn-beta-slow", type=float, default=None,
                   help="YaRN: rotations bounding the fully scaled frequencies (default 1)")
    g.add_argument("--mscale", type=float, default=1.0,
                   help="YaRN: numerator coefficient of the cos/sin concentration factor")
    g.add_argument("--mscale-all-dim", type=float, default=0.0,
                   help="YaRN: denominator coefficient of the concentration factor")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="YaRN: floor / ceil the correction range (the default)")
    g.add_argument("--no-yarn-correction-range-round-to-int", action="store_false",
                   dest="yarn_correction_range_round_to_int",
                   help="YaRN: keep the correction range fractional")


def _add_regularization_args(parser):
    g = parser.add_argument_group(title="regularization")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", type=str, default="constant",
                   choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-08)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--lion-beta1", type=float, default=0.95,
                   help="Lion: weight of the momentum in the sign of the update")
    g.add_argument("--lion-beta2", type=float, default=0.98,
                   help="Lion: decay of the momentum (exp_avg)")
    # Muon (--optimizer muon): megatron/optimizer/muon.py says what each does.
    g.add_argument("--muon-momentum", type=float, default=0.9,
                   help="Muon's momentum coefficient")
    g.add_argument("--muon-no-split-qkv", action="store_false", dest="muon_split_qkv",
                   help="orthogonalise the fused QKV weight as one matrix")
    g.add_argument("--muon-nesterov", action="store_true", help="Nesterov momentum for Muon")
    g.add_argument("--muon-scale-mode", type=str, default="spectral",
                   choices=["spectral", "unit_rms_norm", "shape_scaling"],
                   help="how Muon scales the orthogonalised update by the matrix shape")
    g.add_argument("--muon-fp32-matmul-prec", type=str, default="medium",
                   choices=["low", "medium", "high"],
                   help="Newton-Schulz precision: medium runs it in bf16, high in fp32")
    g.add_argument("--muon-coefficient-type", type=str, default="quintic",
                   help="Newton-Schulz coefficient table")
    g.add_argument("--muon-num-ns-steps", type=int, default=5,
                   help="Newton-Schulz iteration steps")
    g.add_argument("--muon-tp-mode", type=str, default="duplicated",
                   choices=["blockwise", "duplicated", "distributed"],
                   help="tensor-parallel shards: duplicated gathers the whole matrix")
    g.add_argument("--muon-use-syrk", action="store_true",
                   help="Triton SYRK kernel for Newton-Schulz (not built here)")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                   help="extra factor on Muon's update")
    g.add_argument("--muon-scalar-optimizer", type=str, default="adam", choices=["adam", "lion"],
                   help="optimizer of the parameters Muon does not take")


def _add_training_args(parser):
    g = parser.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--batch-size", type=int, default=None,
                   help="old alias of --micro-batch-size")
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs="*", default=None,
                   help="start increment samples, e.g. 16 16 5000000")
    g.add_argument("--step-batch-size-schedule", type=str, default=None,
                   help="global batch by consumed tokens: 'THRESHOLD:BATCH ...' with K/M/B/T "
                        "suffixes, first threshold 0, e.g. '0:256 100B:512'; thresholds are "
                        "tokens (divided by --seq-length into samples); needs --train-samples")
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="run the global batch rounded down to a multiple of micro batch x "
                        "data-parallel size instead of failing")
    g.add_argument("--recompute-activations", action="store_true",
                   help="shorthand for --recompute-granularity selective")
    g.add_argument("--recompute-granularity", type=str, default=None,
                   choices=["full", "selective"])
    g.add_argument("--distribute-saved-activations", action="store_true",
                   help="with --recompute-granularity full, each tensor-parallel rank keeps "
                   "1/tp of every recomputed chunk's input, all-gathered before the recompute")
    g.add_argument("--mlp-chunks-for-training", type=int, default=1,
                   help="in training, run each MLP / MoE block on this many pieces of the "
                   "sequence in turn (less peak memory; not with its recomputation)")
    g.add_argument("--recompute-method", type=str, default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="older spelling of --recompute-granularity selective with moe added to "
                   "--recompute-modules (each MoE layer recomputed in backward)")
    g.add_argument("--cpu-offloading-num-layers", type=int, default=0,
                   help="the first N layers keep the activations they save for backward in "
                   "host memory (megatron/model/activation_offload.py)")
    g.add_argument("--cpu-offloading-retain-pinned-cpu-buffers", action="store_true",
                   help="with --cpu-offloading-num-layers: reuse the pinned host buffers")
    g.add_argument("--fine-grained-activation-offloading", action="store_true",
                   help="the modules of --offload-modules keep what they save for backward in "
                   "host memory (megatron/model/fine_grained_offload.py; nothing to move on CPU)")
    g.add_argument("--offload-modules", nargs="*", type=str, default=[],
                   help="with --fine-grained-activation-offloading: any of attn_norm, "
                   "qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act")
    g.add_argument("--min-offloaded-tensor-size", type=int, default=1048576,
                   help="saved tensors with fewer elements stay on the device")
    g.add_argument("--delta-offload-bytes-across-pp-ranks", type=int, default=0,
                   help="pipeline rank r keeps r x this many bytes of its first groups on the "
                   "device (later ranks hold fewer micro-batches in flight)")
    g.add_argument("--activation-offload-fraction", type=float, default=1.0,
                   help="the share of the eligible groups that offload (the last ones stay)")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="old spelling of --recompute-granularity full --recompute-method uniform")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=int, default=None)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGINT, save a checkpoint at the end of the iteration "
                   "on every rank and exit with status 0")
    g.add_argument("--exit-signal-handler-for-dataloader", action="store_true",
                   help="with --exit-signal-handler: data-loader workers note the exit signal "
                        "instead of dying of it, so a signal sent to the whole process group "
                        "leaves them alive while the checkpoint is saved")
    g.add_argument("--exit-signal-handler-for-training", action="store_true",
                   help="on SIGINT or SIGTERM anywhere in pretrain, finish a checkpoint save "
                        "in flight (--async-save), leave the process group and exit with "
                        "status 0 in one line instead of a traceback (no new checkpoint: that "
                        "is --exit-signal-handler)")
    g.add_argument("--freeze-all-layers", action="store_true",
                   help="no parameter is trained: every step runs the forward pass only (no "
                        "backward, no optimizer step, no MoE expert-bias update) and logs "
                        "learning rate 0; the schedule and the data position still advance")
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--no-masked-softmax-fusion", action="store_false",
                   dest="masked_softmax_fusion")
    g.add_argument("--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion")
    g.add_argument("--no-bias-swiglu-fusion", action="store_false", dest="bias_swiglu_fusion")
    g.add_argument("--no-bias-dropout-fusion", action="store_false", dest="bias_dropout_fusion")
    # Megatron spells the opt-in; here the fusion is on by default, so both spellings exist.
    g.add_argument("--cross-entropy-loss-fusion", action="store_true", default=True)
    g.add_argument("--no-cross-entropy-loss-fusion", action="store_false",
                   dest="cross_entropy_loss_fusion")
    g.add_argument("--no-persist-layer-norm", action="store_true")
    g.add_argument("--use-flash-attn", action="store_true")
    g.add_argument("--attention-backend", type=megatron_flags.TYPES["attn_backend"],
                   default=megatron_flags.AttnBackend.auto,
                   choices=list(megatron_flags.AttnBackend),
                   help="flash: scaled_dot_product_attention; fused: the scaled masked softmax "
                   "kernel; unfused / local: the plain explicit body; auto: flash from "
                   "AUTO_FLASH_MIN_SEQ tokens (on CPU in float32 only above "
                   "AUTO_BLOCKS_MAX_SEQ), else as the other flags say "
                   "(megatron/model/attention_backend.py)")
    g.add_argument("--optimizer", type=str, default="adam",
                   choices=["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"],
                   help="soap and adaptive_muon: megatron/optimizer/soap.py, adaptive_muon.py")
    # megatron/optimizer/cpu_offload.py says what each does.
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep optimizer state on the host and step it there")
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0,
                   help="share of the parameters (by elements, in order) stepped on the host")
    g.add_argument("--use-torch-optimizer-for-cpu-offload", action="store_true",
                   help="with --optimizer-cpu-offload: torch's optimizer, not the fused one, "
                   "for the device part too")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="with --optimizer-cpu-offload: asynchronous gradient and parameter "
                   "copies, the device part stepping meanwhile")
    g.add_argument("--no-pin-cpu-grads", action="store_false", dest="pin_cpu_grads",
                   help="with --optimizer-cpu-offload: pageable host gradient buffers")
    g.add_argument("--no-pin-cpu-params", action="store_false", dest="pin_cpu_params",
                   help="with --optimizer-cpu-offload: pageable host parameter copies")
    g.add_argument("--dataloader-type", type=str, default=None,
                   choices=["single", "cyclic", "external"])
    g.add_argument("--no-async-tensor-model-parallel-allreduce", action="store_false",
                   dest="async_tensor_model_parallel_allreduce")
    g.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                   dest="gradient_accumulation_fusion")
    g.add_argument("--use-mcore-models", action="store_true", dest="deprecated_use_mcore_models")
    g.add_argument("--use-legacy-models", action="store_true")
    g.add_argument("--transformer-impl", default="local",
                   choices=["local", "transformer_engine"],
                   help="local: this project's own layers; transformer_engine (Megatron's "
                   "default) is accepted with a note: the same layers compute the same function")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collector off during training and "
                   "collect every --manual-gc-interval iterations, at the same point on every rank")
    g.add_argument("--manual-gc-interval", type=int, default=0,
                   help="with --manual-gc: iterations between collections (0: only at the start)")
    g.add_argument("--no-manual-gc-eval", "--disable-manual-gc-eval", action="store_false",
                   dest="manual_gc_eval",
                   help="with --manual-gc: no collection before and after each evaluation")
    g.add_argument("--iterations-to-skip", nargs="+", type=int, default=[],
                   help="iterations (as logged, from 1) whose batch is read and dropped: no "
                        "forward, optimizer or LR step; also those a "
                        "--result-rejected-tracker-filename file rejects")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   help="stop every rank before the optimizer step when a loss or (without "
                   "--fp16) a gradient holds an inf or nan, naming the iteration, rank and "
                   "tensor (on by default, as in Megatron; --no-check-for-nan-in-loss-and-grad "
                   "turns it off)")
    _add_rerun_args(g)
    g.add_argument("--skip-iterations-with-loss-spike", action="store_true",
                   help="skip the optimizer step of an iteration whose loss is not finite or "
                   "exceeds --loss-spike-factor x the mean loss of the last --loss-spike-window "
                   "steps taken; counted as a skipped iteration in the log line")
    g.add_argument("--loss-spike-factor", type=float, default=2.0)
    g.add_argument("--loss-spike-window", type=int, default=20)
    g.add_argument("--skip-train", action="store_true")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss is the mean over every unmasked token of the global batch "
                   "(all micro-batches and data-parallel ranks), not the mean of per-micro-batch "
                   "means; gradients are summed over data-parallel ranks and divided by the "
                   "global token count")


def _add_rerun_args(g):
    """Result validation (megatron/training/rerun.py) and the weight-hash check."""
    g.add_argument("--rerun-mode", default="validate_results",
                   choices=["disabled", "validate_results", "report_stats"],
                   help="validate_results (the default, as in Megatron): a step whose result a "
                   "check rejects runs again on the same data and RNG state; a different result "
                   "is a transient fault (exit 17, checkpoint saved), the same one is saved for "
                   "a re-run elsewhere (exit 16); a rejection in the first iteration of a "
                   "process stops at once. report_stats: re-run every step and report the "
                   "differences. disabled: the checks stop at once")
    g.add_argument("--error-injection-rate", type=int, default=0,
                   help="with --rerun-mode validate_results: reject a correct result with "
                   "probability 1/rate per rank and step, to exercise the re-run (0: never)")
    g.add_argument("--error-injection-type", default="transient_error",
                   choices=["correct_result", "transient_error", "persistent_error"],
                   help="what an injected error looks like to the re-runs")
    g.add_argument("--result-rejected-tracker-filename", default=None,
                   help="append one line per rejected result and re-run outcome to this file")
    g.add_argument("--check-for-spiky-loss", action="store_true",
                   help="re-run (validate_results) a step whose loss is at least 10x the largest "
                   "of the first 100 losses; reported, not fatal")
    g.add_argument("--check-for-large-grads", action="store_true",
                   help="the same for this rank's gradient norm before the data-parallel "
                   "reduction")
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None,
                   help="every this many iterations, compare each data-parallel replica's "
                   "weights by hash and stop on a mismatch, naming the ranks")


def _add_initialization_args(parser):
    g = parser.add_argument_group(title="initialization")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-parallel-random-init", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--init-method-xavier-uniform", action="store_true")
    g.add_argument("--embedding-init-method-std", type=float, default=None,
                   help="N(0, std^2) for the embedding tables (default: as other weights)")
    _add_mup_args(g)


def _add_mup_args(g):
    """Maximal update parametrization (megatron/core/mup.py says what each scales)."""
    g.add_argument("--use-mup", action="store_true",
                   help="muP: width-scaled init, per-group lr/eps, embedding, logit and "
                   "attention multipliers")
    g.add_argument("--mup-width-mult", type=float, default=1.0,
                   help="hidden size / base hidden size (derived from --mup-base-hidden-size "
                   "when that is given)")
    g.add_argument("--mup-base-hidden-size", type=int, default=None,
                   help="hidden size of the tuned base model (default: --hidden-size)")
    g.add_argument("--mup-embedding-mult", type=float, default=1.0,
                   help="multiplier of the embedding output")
    g.add_argument("--mup-output-mult", type=float, default=1.0,
                   help="multiplier of the output logits (left at 1.0: 1 / width mult)")
    g.add_argument("--mup-base-head-dim", type=int, default=None,
                   help="attention scale sqrt(this) / kv_channels^power (default: 1 / ...)")
    g.add_argument("--mup-attn-scale-power", type=float, default=1.0,
                   help="power of kv_channels in the attention scale (0.5: standard)")


def _add_learning_rate_args(parser):
    g = parser.add_argument_group(title="learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--lr-decay-style", type=str, default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    g.add_argument("--lr-wsd-decay-style", type=str, default="exponential",
                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None)
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--warmup", type=int, default=None, help="old alias of --lr-warmup-iters")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   action="store_true", dest="override_opt_param_scheduler")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler", action="store_true",
                   dest="use_checkpoint_opt_param_scheduler")
    g.add_argument("--decoupled-lr", type=float, default=None)
    g.add_argument("--decoupled-min-lr", type=float, default=None)


def _add_checkpointing_args(parser):
    g = parser.add_argument_group(title="checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    for what, where in (("params", "every parameter after the optimizer step, in "
                         "SAVE/params/iter_N/mp_rank_*.pth"),
                        ("activations", "the inputs and outputs of the linear, embedding and "
                         "router modules, in SAVE/activations/iter_N/mp_rank_*.pth"),
                        ("tokens-per-expert", "each MoE layer's tokens per local expert, "
                         "appended to SAVE/tokens_per_expert/rank<R>.jsonl"),
                        ("wgrads", "every parameter's reduced gradient, in "
                         "SAVE/wgrads/iter_N/mp_rank_*.pth"),
                        ("dgrads", "the gradients of the linear modules' inputs and outputs, in "
                         "SAVE/dgrads/iter_N/mp_rank_*.pth")):
        g.add_argument(f"--save-{what}-interval", type=int, default=None,
                       help=f"every N iterations, save {where} (debugging)")
    g.add_argument("--no-save-optim", action="store_true", default=None)
    g.add_argument("--no-save-rng", action="store_true", default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--pretrained-checkpoint", type=str, default=None,
                   help="when --load holds no checkpoint, start from this checkpoint's weights "
                   "as --finetune does")
    g.add_argument("--ckpt-step", type=int, default=None)
    g.add_argument("--override-ckpt-iteration", type=int, default=None,
                   help="after loading --load, continue as from this iteration: the iteration "
                        "counter, the consumed samples (N x the global batch size) and the "
                        "learning-rate schedule's position follow N, whatever the checkpoint "
                        "recorded")
    g.add_argument("--load-main-params-from-ckpt", action="store_true",
                   help="--bf16/--fp16 with the optimizer state not loaded (--no-load-optim, "
                        "--finetune): the fp32 main parameters take the checkpoint's values "
                        "at the precision it holds them, not the model's rounded copy")
    g.add_argument("--verify-integrity", action="store_true",
                   help="saving writes integrity.json (SHA-256 of every file) into each "
                        "checkpoint folder; loading re-hashes the files and stops, naming each "
                        "file that differs or is missing")
    g.add_argument("--use-checkpoint-args", action="store_true")
    g.add_argument("--no-initialization", action="store_false", dest="perform_initialization",
                   help="do not draw the initial weights (zeros until --load fills them): a "
                        "faster start when a checkpoint is loaded anyway")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="with --use-checkpoint-args: also take the tensor, pipeline and expert "
                        "parallel sizes from the checkpoint")
    g.add_argument("--no-use-tokenizer-model-from-checkpoint-args",
                   "--disable-use-tokenizer-model-from-checkpoint-args", action="store_false",
                   dest="use_tokenizer_model_from_checkpoint_args",
                   help="with --use-checkpoint-args: keep this run's tokenizer flags instead of "
                        "the checkpoint's --tokenizer-type, --tokenizer-model, --tiktoken-pattern")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true")
    g.add_argument("--ckpt-format", type=str, default="torch_dist",
                   choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
                   help="the format --save writes (--load detects the format of the folder it "
                        "reads): torch_dist (default, as Megatron-LM): Megatron-Core's "
                        "distributed checkpoint, every rank writing its own shards, loadable at "
                        "any other parallel layout; torch: one model_optim_rng.pt per (tensor, "
                        "pipeline) rank; fsdp_dtensor (fully "
                        "sharded runs only): a DCP folder of FSDP's DTensor shards under "
                        "Megatron-LM's keys for that format; torch_dcp (--use-torch-fsdp2 with "
                        "tensor and pipeline size 1): a DCP folder of Megatron-LM's torch-format "
                        "state dict with the FSDP2 model's DTensor shards")
    g.add_argument("--use-dist-ckpt", action="store_true",
                   help="older spelling of --ckpt-format torch_dist")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="accepted for Megatron's scripts, no effect here: loading always "
                        "detects the format of the checkpoint in --load")
    g.add_argument("--no-strict-fsdp-dtensor-load", "--disable-strict-fsdp-dtensor-load",
                   action="store_false", dest="strict_fsdp_dtensor_load",
                   help="--ckpt-format fsdp_dtensor: load the tensors the checkpoint has and "
                        "keep the current values of those it lacks (default: a missing tensor "
                        "stops the load, naming it)")
    g.add_argument("--ckpt-convert-format", type=str, default=None,
                   choices=["torch", "torch_dist"],
                   help="after loading --load, save it in this format to --ckpt-convert-save "
                        "and exit")
    g.add_argument("--ckpt-convert-save", type=str, default=None)
    g.add_argument("--ckpt-convert-update-legacy-dist-opt-format", action="store_true",
                   dest="ckpt_convert_update_legacy_dist_opt_format", default=False,
                   help="--ckpt-format torch with --use-distributed-optimizer: read a "
                        "distrib_optim.pt in Megatron-LM's legacy layout (one tensor per "
                        "bucket, written before Feb 2024) instead of the coalesced one")
    g.add_argument("--dist-ckpt-strictness", type=str, default="assume_ok_unexpected",
                   choices=["assume_ok_unexpected", "log_unexpected", "raise_unexpected",
                            "raise_all", "log_all", "ignore_all", "return_unexpected",
                            "return_all"],
                   help="torch_dist loads, as Megatron-Core's StrictHandling: what to do with "
                        "saved tensors the model has no place for and (the *_all modes) with "
                        "tensors the model needs that the checkpoint lacks, which then keep "
                        "their current values: ignore, log or raise; return_* ignore them (a "
                        "training run has no caller to return the keys to)")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   dest="ckpt_fully_parallel_save_deprecated",
                   help="accepted for Megatron's scripts, no effect here: every rank always "
                        "writes its own torch_dist shards")
    g.add_argument("--no-ckpt-fully-parallel-save", action="store_false",
                   dest="ckpt_fully_parallel_save",
                   help="accepted for Megatron's scripts, no effect here: every rank always "
                        "writes its own torch_dist shards (refused with "
                        "--dist-ckpt-save-pre-mcore-014 and the distributed optimizer)")
    g.add_argument("--dist-ckpt-save-pre-mcore-014", action="store_true",
                   help="torch_dist saves in the layout of Megatron-Core before 0.14, for "
                        "readers that predate it: no content_metadata, and the distributed "
                        "optimizer's state as its fully_sharded_model_space type (each "
                        "parameter's state N-D flattened per TP piece, each DP rank writing "
                        "its range). Loading reads either layout")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="accepted for Megatron's scripts, no effect here: every rank always "
                        "reads only the slices it needs")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints on a background thread while training goes on; the "
                   "tracker is updated once every rank's file is complete")
    g.add_argument("--non-persistent-save-interval", type=int, default=None,
                   help="iterations between non-persistent checkpoints, cheap ones kept only "
                   "until a newer one is written (--non-persistent-ckpt-type)")
    g.add_argument("--non-persistent-ckpt-type", type=str, default=None,
                   choices=["global", "local", "in_memory"],
                   help="global: a checkpoint in --non-persistent-global-ckpt-dir (default "
                   "SAVE/non_persistent), only the newest kept; local: every rank writes its own "
                   "state under --non-persistent-local-ckpt-dir (with --replication, copies on "
                   "peer ranks of other nodes); in_memory is refused, as Megatron-LM refuses "
                   "it (listed there as to be done). --load resumes from the newest complete "
                   "checkpoint, persistent or not")
    g.add_argument("--non-persistent-global-ckpt-dir", type=str, default=None)
    g.add_argument("--non-persistent-local-ckpt-dir", type=str, default=None)
    g.add_argument("--non-persistent-local-ckpt-algo", type=str, default="fully_parallel",
                   choices=["fully_parallel", "atomic"])
    g.add_argument("--replication", action="store_true",
                   help="local non-persistent checkpoints: each rank's file is also kept by "
                   "--replication-factor - 1 peer ranks, --replication-jump ranks apart")
    g.add_argument("--replication-jump", type=int, default=None,
                   help="rank distance between copies of a local checkpoint (default: the "
                   "processes per node, LOCAL_WORLD_SIZE, so the copies sit on other nodes)")
    g.add_argument("--replication-factor", type=int, default=2,
                   help="how many ranks hold each rank's local checkpoint, itself included")


def _add_mixed_precision_args(parser):
    g = parser.add_argument_group(title="mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--fp32-residual-connection", action="store_true")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true", default=False,
                   help="scale q k^T by 1 / layer number (undone in the fp32 softmax); also "
                   "sets --attention-softmax-in-fp32")
    g.add_argument("--no-query-key-layer-scaling", action="store_false", default=False,
                   dest="apply_query_key_layer_scaling",
                   help="older spelling of the default (no query-key layer scaling)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16, keep the gradient buffers (main_grad) in bf16: micro-batch "
                        "accumulation and the data-parallel reduction round to bf16 (the "
                        "default with --bf16 is fp32, as --accumulate-allreduce-grads-in-fp32)")
    g.add_argument("--fp16-lm-cross-entropy", action="store_true")
    g.add_argument("--output-logit-dtype", type=str, default=None, dest="logit_dtype",
                   choices=["bf16", "fp32"],
                   help="precision of the output layer's product (the logits): fp32 keeps the "
                        "full-precision sum of a bf16/fp16 run's half-precision matmul, bf16 "
                        "rounds it (default: the model's dtype)")


def _add_distributed_args(parser):
    g = parser.add_argument_group(title="distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--tensor-parallel-num-weight-shards", type=int, default=None,
                   help="cut each attention and MLP linear weight into N row blocks: the "
                   "tensor-parallel split times N / tp weight shards over data-parallel ranks "
                   "(all-gathered for the matmul); N a multiple of "
                   "--tensor-model-parallel-size")
    g.add_argument("--expert-tensor-parallel-num-weight-shards", type=int, default=None,
                   help="cut each routed expert's linear weights into N row blocks: the "
                   "expert-tensor-parallel split times N / expert-tp weight shards over "
                   "expert-data-parallel ranks (all-gathered for the matmul); N a multiple of "
                   "--expert-tensor-parallel-size")
    g.add_argument("--pipeline-model-parallel-split-rank", type=int, default=None)
    g.add_argument("--model-parallel-size", type=int, default=None,
                   help="old alias of --tensor-model-parallel-size")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-layout", type=str, default=None,
                   help="every pipeline stage written out, e.g. 'Et*3|(tt|)*29|tL': E the "
                   "embedding, t a transformer layer, L the loss, | ends a stage, x*n and "
                   "(...)*n repeat; pp x vp stages, stage i on pipeline rank i %% pp")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="the embedding takes the place of one transformer layer of the first "
                   "stage when the layers are split evenly")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="the loss takes the place of one transformer layer of the last stage "
                   "when the layers are split evenly")
    g.add_argument("--overlap-p2p-communication", action="store_true")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="number ranks tensor, context, pipeline, then data parallel "
                   "(Megatron's tp-cp-ep-pp-dp) instead of the default tp-cp-ep-dp-pp")
    g.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"])
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--hang-dump-timeout-s", type=float, default=None,
                   help="hang watchdog (default off): when one training step (or the "
                   "evaluation, logging and saving after it) runs longer than this many "
                   "seconds, every rank writes the Python stacks of all its threads to "
                   "--hang-dump-dir and the job stops, naming the rank(s) the others wait for; "
                   "must be below --distributed-timeout-minutes")
    g.add_argument("--hang-dump-dir", type=str, default=None,
                   help="folder of the hang watchdog's stack files (hang_rank<R>.txt); "
                   "default: --save, else --tensorboard-dir, else the working folder")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="bit-reproducible runs on GPUs: deterministic kernels only (an op "
                        "without one raises), pinned cuBLAS workspace and NCCL algorithm")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--no-delay-grad-reduce", action="store_false", dest="delay_grad_reduce")
    g.add_argument("--ddp-bucket-size", type=int, default=None)
    g.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true",
                   help="with --use-distributed-optimizer, reduce-scatter gradients as an "
                        "all-to-all of the buffer's dtype whose pieces each rank sums in fp32, "
                        "rounding once into its shard")
    g.add_argument("--ddp-param-name-patterns-for-fp32-local-accumulation", nargs="+", type=str,
                   default=[], metavar="PATTERN",
                   help="parameters whose name matches one of these shell patterns (fnmatch; "
                        "'all' matches every one) accumulate micro-batch gradients in a "
                        "separate fp32 main_grad while the buffer stays half precision; the "
                        "sum is rounded into the buffer just before the data-parallel reduction")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--delay-param-gather", action="store_true")
    g.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_false",
                   dest="scatter_gather_tensors_in_pipeline")
    g.add_argument("--use-ring-exchange-p2p", action="store_true")
    g.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank")
    g.add_argument("--lazy-mpu-init", action="store_true")
    g.add_argument("--use-cpu-initialization", action="store_true", default=None)
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="hand unused cached memory back after forward-backward and evaluation "
                   "steps (1) and after the optimizer step too (2): the CUDA caching "
                   "allocator's, or on CPU the free host memory the run keeps "
                   "(megatron/core/host_memory.py)")
    g.add_argument("--standalone-embedding-stage", action="store_true",
                   help="pipeline rank 0 holds only the input embedding, the layers are split "
                   "evenly over the other ranks (the equivalent --pipeline-model-parallel-layout)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Adam keeps its moments, master weights and gradients in the dtypes "
                        "below, computing each update in fp32 (needs "
                        "--use-distributed-optimizer)")
    g.add_argument("--main-grads-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="with --use-precision-aware-optimizer: the dtype of the gradients the "
                        "optimizer reads")
    g.add_argument("--main-params-dtype", default="fp32", choices=["fp32", "fp16"],
                   help="with --use-precision-aware-optimizer: the precision of the master "
                        "weights (fp16 scaled per tensor)")
    g.add_argument("--exp-avg-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                   help="with --use-precision-aware-optimizer: the storage dtype of Adam's "
                        "first moment (fp16 and fp8 E4M3 scaled per tensor)")
    g.add_argument("--exp-avg-sq-dtype", default="fp32", choices=["fp32", "fp16", "bf16", "fp8"],
                   help="with --use-precision-aware-optimizer: the storage dtype of Adam's "
                        "second moment (fp16 and fp8 E4M3 scaled per tensor)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="fully sharded data parallelism with PyTorch's FSDP2: every transformer "
                        "layer (and an untied embedding and output layer) sharded over the "
                        "data-parallel (x context-parallel) ranks, the optimizer on the shards")
    g.add_argument("--init-model-with-meta-device", action="store_true",
                   help="with FSDP2, build the model on the meta device and give each rank only "
                        "its shards, with the weights an ordinary build gives")
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward",
                   help="with --use-torch-fsdp2, keep each layer's gathered parameters from its "
                        "forward to its backward (more memory, fewer all-gathers)")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron-FSDP's flags on PyTorch's FSDP2: --data-parallel-sharding-"
                        "strategy picks what is sharded over the data-parallel ranks")
    g.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                   help="with --use-megatron-fsdp: no_shard = the grad-buffer wrapper (DDP), "
                        "optim = the distributed optimizer (ZeRO-1), optim_grads = FSDP2 keeping "
                        "each layer's gathered parameters from forward to backward, "
                        "optim_grads_params = FSDP2 resharding after forward (ZeRO-3)")
    g.add_argument("--outer-dp-sharding-strategy", default="no_shard",
                   choices=["no_shard", "optim"],
                   help="with --use-megatron-fsdp: sharding across the outer data-parallel "
                        "groups of hybrid sharding; only no_shard (one group) is built")
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="with --use-megatron-fsdp and a strategy on FSDP2: hybrid sharding, "
                        "the data-parallel ranks split into this many replicas of consecutive "
                        "ranks, each sharding the model (a two-dimensional FSDP2 mesh)")
    g.add_argument("--megatron-fsdp-main-params-dtype", default="fp32",
                   choices=["fp32", "bf16", "fp16", "auto"],
                   help="with --use-megatron-fsdp: the main weights' dtype; fp32 is built")
    g.add_argument("--megatron-fsdp-main-grads-dtype", default="auto",
                   choices=["fp32", "bf16", "fp16", "auto"],
                   help="with --use-megatron-fsdp: the sharded gradients' dtype; fp32 (auto: "
                        "the same) is built")
    g.add_argument("--megatron-fsdp-grad-comm-dtype", default="auto",
                   choices=["fp32", "fp16", "bf16", "auto"],
                   help="with --use-megatron-fsdp and a sharding strategy on FSDP2: the dtype "
                        "gradients are reduce-scattered in (FSDP2's reduce_dtype; auto: fp32)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split every sequence over this many ranks (attention exchanges "
                        "keys and values; everything else runs on the local tokens)")
    g.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                   choices=["p2p", "all_gather", "allgather", "a2a", "a2a+p2p"],
                   help="context parallelism's exchange: a ring of key/value blocks (p2p), "
                        "one all-gather of them (allgather, or all_gather), all-to-all from a "
                        "sequence split to a head split (a2a), or all-to-all inside groups of "
                        "neighbouring cp ranks with a ring between the groups (a2a+p2p, with "
                        "--hierarchical-context-parallel-sizes); one type for every layer, or "
                        "one per layer")
    g.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                   help="for --cp-comm-type a2a+p2p: two sizes whose product is "
                        "--context-parallel-size; the first many neighbouring cp ranks exchange "
                        "by all-to-all, the second many such groups form the p2p ring")
    g.add_argument("--hybrid-context-parallel", action="store_true",
                   help="packed SFT samples: cut into their sequences, each run over its own "
                        "power-of-two block of the data-parallel ranks (from its length and "
                        "--max-seqlen-per-dp-cp-rank), dealt to balance attention work; needs "
                        "--calculate-per-token-loss and --micro-batch-size 1")
    g.add_argument("--max-seqlen-per-dp-cp-rank", type=int, default=None,
                   help="with --hybrid-context-parallel: the most tokens of one sequence a rank "
                        "holds; a longer sequence runs over the next power of two of ranks")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--DDP-impl", default="local", choices=["local", "torch"],
                   help="accepted for old scripts; the local (Megatron) implementation is used")
    g.add_argument("--no-contiguous-buffers-in-local-ddp", action="store_false",
                   dest="use_contiguous_buffers_in_local_ddp")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where to run: CUDA + NCCL when GPUs are present (auto), else CPU + gloo")


def _add_run_control_args(parser):
    """Start-up and run-time controls of the process groups and the device."""
    g = parser.add_argument_group(title="run control")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage",
                   help="interleaved pipeline schedule: micro-batches each model chunk runs "
                   "before the next chunk starts (default: --pipeline-model-parallel-size); "
                   "between that and the micro-batches per step")
    g.add_argument("--distributed-timeout-seconds-after-init", type=int, default=None,
                   help="after the first iteration of the run, every process group's timeout "
                   "becomes this many seconds (start-up keeps --distributed-timeout-minutes)")
    g.add_argument("--dump-param-to-param-group-map", type=str, default=None,
                   help="folder to write, as a torch.distributed.checkpoint, each parameter's "
                   "global name mapped to the index of its optimizer parameter group")
    g.add_argument("--gpu-sniff-test-interval", type=int, default=None,
                   help="at start-up and every N iterations, time matrix multiplies and "
                   "collectives on every rank's device and report the ranks that lag the others")
    g.add_argument("--flight-recorder-dump-path", type=str, default=None,
                   help="NCCL flight recorder: per-rank dump file prefix (a folder gets "
                   "'_dump_' appended); sets TORCH_FR_DUMP_TEMP_FILE and the other "
                   "flight-recorder variables before the process group starts")
    g.add_argument("--flight-recorder-trace-buffer-size", type=int, default=2000,
                   help="NCCL flight recorder entries (TORCH_NCCL_TRACE_BUFFER_SIZE)")
    g.add_argument("--no-flight-recorder-dump-on-timeout",
                   "--disable-flight-recorder-dump-on-timeout", action="store_false",
                   dest="flight_recorder_dump_on_timeout",
                   help="no flight recorder dump on a collective timeout "
                   "(TORCH_NCCL_DUMP_ON_TIMEOUT=0)")
    g.add_argument("--flight-recorder-include-stack-trace", action="store_true",
                   help="flight recorder entries carry stack traces (TORCH_INCLUDE_STACK_TRACE)")
    g.add_argument("--no-flight-recorder-include-only-active",
                   "--disable-flight-recorder-include-only-active", action="store_false",
                   dest="flight_recorder_include_only_active",
                   help="dump finished collectives too (TORCH_INCLUDE_ONLY_ACTIVE=0)")
    g.add_argument("--no-flight-recorder-extra-dump-on-exec",
                   "--disable-flight-recorder-extra-dump-on-exec", action="store_false",
                   dest="flight_recorder_extra_dump_on_exec",
                   help="no extra flight recorder dump when the watchdog ends the process "
                   "(TORCH_NCCL_EXTRA_DUMP_ON_EXEC=0)")


def _add_validation_args(parser):
    g = parser.add_argument_group(title="validation")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-micro-batch-size", type=int, default=None,
                   help="micro-batch size of evaluation (default: --micro-batch-size)")
    g.add_argument("--start-eval-at-iter", type=int, default=None,
                   help="evaluate during training only from this iteration on")
    g.add_argument("--full-validation", action="store_true",
                   help="each evaluation reads the whole validation set once (GPT data), "
                        "instead of --eval-iters batches")
    g.add_argument("--multiple-validation-sets", action="store_true",
                   help="each prefix of --valid-data-path (given without weights) is its own "
                        "validation set, evaluated and logged on its own; needs "
                        "--full-validation (or --skip-train)")
    g.add_argument("--validation-set-names", nargs="+", type=str, default=None,
                   help="with --multiple-validation-sets: one name per validation set, logged "
                        "as 'validation-NAME' instead of 'validation-INDEX'")


def _add_data_args(parser):
    g = parser.add_argument_group(title="data and dataloader")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969, 30, 1")
    g.add_argument("--train-data-path", nargs="*", default=None)
    g.add_argument("--valid-data-path", nargs="*", default=None)
    g.add_argument("--test-data-path", nargs="*", default=None)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--phase-transition-iterations", type=str, default=None,
                   help="comma-separated iterations (e.g. 1000,3000) where training saves a "
                        "checkpoint and exits, to be restarted with the next phase's data "
                        "flags; each phase's train data starts at its own first sample")
    g.add_argument("--per-dataset-sequences-path", type=str, default=None,
                   help="a JSON file {prefix: [sequences, document entries]} (written by "
                        "tools/build_sequences_per_dataset.py): each data prefix is opened from "
                        "these counts instead of reading its .idx header (GPT)")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--null-tokenizer-eod-id", type=int, default=None,
                   help="NullTokenizer: the end-of-document id, one of the --vocab-size ids "
                        "(Megatron-Core's tokenizers). Without it, the end-of-document id is "
                        "--vocab-size itself and the vocabulary one larger (Megatron's legacy "
                        "NullTokenizer)")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1,
                   help="NullTokenizer: the pad id; GPT labels equal to it get loss weight 0 "
                        "(-1, the default: no pad token). Choose an id the data does not hold")
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--no-pad-vocab-size", "--disable-pad-vocab-size", action="store_false",
                   dest="pad_vocab_size",
                   help="keep the tokenizer's vocabulary size for the embedding table instead "
                        "of rounding it up to --make-vocab-size-divisible-by x TP")
    g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: do not add the tokenizer's own special tokens "
                        "(a BOS, ...) when tokenizing")
    g.add_argument("--vocab-extra-ids", type=int, default=0)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--encoder-seq-length", type=int, default=None)
    g.add_argument("--decoder-seq-length", type=int, default=None)
    g.add_argument("--sample-rate", type=float, default=1.0)
    g.add_argument("--mask-prob", type=float, default=0.15,
                   help="BERT: fraction of the tokens of a sample chosen for masked-LM")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="BERT: probability of a sample shorter than --seq-length")
    g.add_argument("--num-workers", type=int, default=2)
    g.add_argument("--tokenizer-type", type=str, default=None, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", type=str, default=None)
    _add_tiktoken_args(g)
    add_tokenizer_option_args(g)
    _add_fim_args(g)
    _add_sft_args(g)
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--dataloader-inter-document-masking", action="store_true",
                   help="GPT: each token attends only to the earlier tokens of its own document "
                        "of the sample, and positions restart at 0 with every document")
    g.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                   dest="create_attention_mask_in_dataloader")
    g.add_argument("--num-dataset-builder-threads", type=int, default=1)
    g.add_argument("--allow-ambiguous-pad-tokens", action="store_true",
                   help="GPT: mask the loss of labels equal to the tokenizer's pad id even when "
                        "that id is also its eos/eod (or another special) token; without it such "
                        "a pad id masks nothing")
    g.add_argument("--mid-level-dataset-surplus", type=float, default=0.005,
                   help="each dataset of a weighted blend is built with this fraction more "
                        "samples than its share ceil(N x weight), so the blend never runs it dry")
    g.add_argument("--data-impl", type=str, default=None,
                   choices=["mmap", "lazy", "cached", "infer"],
                   help="accepted for old scripts and ignored: only the mmap format exists")
    g.add_argument("--dataset-impl", type=str, default=None,
                   choices=["mmap", "lazy", "cached", "infer"],
                   help="accepted for old scripts and ignored: only the mmap format exists")
    g.add_argument("--mmap-warmup", action="store_true")
    g.add_argument("--data-args-path", type=str, default=None,
                   help="a file holding the --data-path value (whitespace separated: "
                   "[weight] prefix ...); instead of --data-path")
    g.add_argument("--per-split-data-args-path", type=str, default=None,
                   help='a JSON file {"train": [...], "valid": [...], "test": [...]} holding '
                   "the --train/--valid/--test-data-path values (a list, or one whitespace "
                   "separated string, each)")


def _add_tiktoken_args(g):
    """TikTokenizer's flags (also offered by tools/preprocess_data.py)."""
    g.add_argument("--tiktoken-pattern", type=str, default=None, choices=["v1", "v2"],
                   help="TikTokenizer: the pre-tokenization regex (Megatron's v1 or v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids 0..N-1 are special tokens; the vocabulary file's "
                   "tokens follow from N")
    g.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", type=str,
                   nargs="+", default=None, dest="special_tokens",
                   help="TikTokenizer: the first special tokens, in id order (must include "
                   "<unk> <s> </s>; default <unk> <s> </s> <mask> <pad> <cls> <sep>)")


def _add_sft_args(g):
    """Supervised fine-tuning on JSONL conversations (megatron/data/sft_dataset.py)."""
    g.add_argument("--sft", action="store_true",
                   help="GPT: --data-path files are JSONL conversations ({\"messages\": [...]}), "
                   "packed to --seq-length with loss on the assistant turns only; needs "
                   "--tokenizer-type SFTTokenizer")
    g.add_argument("--sft-tokenizer-prompt-format", type=str, default="nemotron-h-aligned",
                   help="SFTTokenizer: how turns are written (nemotron-h-aligned or "
                   "nemotron-nano-v2)")


def _add_fim_args(g):
    """Fill-in-the-middle GPT samples (megatron/data/fim_dataset.py)."""
    g.add_argument("--fim-data", action="store_true",
                   help="GPT: rewrite samples into fill-in-the-middle order (PSM or SPM)")
    g.add_argument("--fim-rate", type=float, default=0.5,
                   help="chance that a document segment of a sample is permuted")
    g.add_argument("--fim-spm-rate", type=float, default=0.5,
                   help="chance that a permuted segment is in SPM rather than PSM order")
    g.add_argument("--fim-split-sample", type=str, default=None,
                   help="a token that cuts segments into fragments, each permuted on its own "
                   "(with --fim-fragment-rate)")
    g.add_argument("--fim-fragment-rate", type=float, default=None,
                   help="chance that a fragment (see --fim-split-sample) is permuted")
    g.add_argument("--fim-no-prefix", type=str, default=None,
                   help="segments whose text starts with this are never permuted")
    for part, token in (("prefix", "<fim_prefix>"), ("middle", "<fim_middle>"),
                        ("suffix", "<fim_suffix>"), ("pad", "<fim_pad>"),
                        ("eod", "<|endoftext|>")):
        g.add_argument(f"--fim-{part}-token", type=str, default=token,
                       help=f"FIM: the tokenizer's {part} token (one token of its vocabulary)")


def _add_logging_args(parser):
    g = parser.add_argument_group(title="logging")
    g.add_argument("--log-params-norm", action="store_true",
                   help="L2 norm of all parameters (each counted once) in the log line "
                   "(params norm) and TensorBoard (params-norm)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-max-attention-logit", action="store_true",
                   help="the largest pre-softmax attention logit of each step in the log line "
                   "(max attention logit) and TensorBoard (max_attention_logit)")
    g.add_argument("--log-throughput", action="store_true",
                   help="model TFLOP/s per device in the log line and TensorBoard (throughput)")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2])
    g.add_argument("--timing-log-option", type=str, default="minmax",
                   choices=["max", "minmax", "all"])
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="iteration-time and <timer>-time scalars (the timers of "
                   "--timing-log-level)")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", action="store_false",
                   dest="log_learning_rate_to_tensorboard")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes (and "
                   "mem-allocated-count) from the CUDA allocator; on CPU the process's resident "
                   "set size (current, and peak for max-allocated)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", type=str, default="")
    g.add_argument("--wandb-exp-name", type=str, default="")
    g.add_argument("--wandb-save-dir", type=str, default="")
    g.add_argument("--log-straggler", action="store_true",
                   help="at every --log-interval, rank 0 prints the slowest and fastest ranks "
                   "by their own forward time per iteration (Megatron's MnRtt/MxRtt line; also "
                   "to TensorBoard under straggler/)")
    g.add_argument("--straggler-minmax-count", type=int, default=1,
                   help="with --log-straggler: how many of the slowest and fastest ranks to list")
    g.add_argument("--straggler-ctrlr-port", type=int, default=65535,
                   help="with --log-straggler: rank 0 listens on this localhost TCP port; any "
                   "HTTP request to it (curl localhost:PORT) turns the report on or off at the "
                   "next --log-interval")
    g.add_argument("--disable-straggler-on-startup", action="store_true",
                   help="with --log-straggler: start with the report off (turn it on through "
                   "--straggler-ctrlr-port)")


def _add_profiling_args(parser):
    g = parser.add_argument_group(title="profiling")
    g.add_argument("--profile", action="store_true",
                   help="profile iterations --profile-step-start to --profile-step-end on "
                   "--profile-ranks: a torch profiler trace with --use-pytorch-profiler, else "
                   "cudaProfilerStart/Stop for nsys on GPUs (no effect on CPU)")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", nargs="+", type=int, default=[0],
                   help="global ranks to profile")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="with --profile: write a torch profiler trace (Chrome trace json) into "
                   "--tensorboard-dir")
    g.add_argument("--pytorch-profiler-collect-chakra", action="store_true",
                   help="with --profile --use-pytorch-profiler: also record torch's execution "
                   "trace (Chakra's input) into --tensorboard-dir/../chakra/rank-<R>.json.gz")
    g.add_argument("--nvtx-ranges", action="store_true",
                   help="with --profile on GPUs: NVTX ranges for each profiled iteration and "
                   "each timed phase inside it (forward-backward, optimizer, ...), for nsys; "
                   "no effect on CPU")
    g.add_argument("--record-memory-history", action="store_true",
                   help="GPUs: record the CUDA caching allocator's history from the model's "
                   "construction on; the last rank writes a snapshot to --memory-snapshot-path "
                   "at every --log-interval, and any rank that runs out of memory to "
                   "oom_rank-<R>_<path>")
    g.add_argument("--memory-snapshot-path", type=str, default="snapshot.pickle",
                   help="with --record-memory-history: where the snapshot goes "
                   "(torch.cuda.memory._snapshot(), pickled; open it at pytorch.org/memory_viz)")
    g.add_argument("--log-memory-interval", type=int, default=None,
                   help="every N iterations (a multiple of --log-interval), each data-parallel "
                   "rank 0 prints its memory: allocated, max allocated, reserved and max "
                   "reserved MB (the CUDA allocator's; on CPU the process's resident set and "
                   "its peak)")
    g.add_argument("--log-device-memory-used", action="store_true",
                   help="with --log-memory-interval: also the device's whole used memory, "
                   "other processes included (on CPU the machine's: MemTotal - MemAvailable)")


def _add_moe_args(parser):
    g = parser.add_argument_group(title="mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (default: a dense MLP in every layer)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="default: --tensor-model-parallel-size")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="FFN size of each expert (default: --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=parse_moe_layer_freq, default=1,
                   help="N: every N-th layer (0, N, 2N, ...) is MoE; or a list with one 0/1 per "
                   "layer, e.g. \"([0]+[1]*23)\"")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-apply-probs-on-input", action="store_true",
                   help="scale each token by its routing probability before its expert, "
                   "not the expert's output after (needs --moe-router-topk 1)")
    g.add_argument("--moe-router-score-function", default="softmax", choices=SCORE_FUNCTIONS)
    g.add_argument("--moe-router-pre-softmax", action="store_true")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-num-groups", type=int, default=None,
                   help="split the experts into this many groups (group-limited routing)")
    g.add_argument("--moe-router-group-topk", type=int, default=None,
                   help="each token's experts come from its best this many groups")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias on the sigmoid scores "
                   "picks the experts, moved after each step towards equal load")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-dtype", default=None, choices=ROUTER_DTYPES,
                   help="compute the router's logits and probabilities in this precision")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", default="aux_loss",
                   choices=LOAD_BALANCING_TYPES,
                   help="one balancing type, or several (aux_loss, seq_aux_loss, global_aux_loss "
                   "together), each with its own --moe-aux-loss-coeff; quantile_balancing: a "
                   "per-expert bias set after each step from token-choice quantiles")
    g.add_argument("--moe-router-quantile-balancing-ema", type=float, default=0.0,
                   help="quantile_balancing: the weight of the old bias when the step's "
                   "quantile bias updates it (0: replaced)")
    g.add_argument("--moe-aux-loss-coeff", type=float, nargs="+", default=0.0,
                   help="the balancing loss's coefficient; one per "
                   "--moe-router-load-balancing-type when several are given")
    g.add_argument("--moe-router-force-load-balancing", action="store_true",
                   help="benchmark switch: route by random normal logits instead of the "
                   "router's, so every expert gets about the same load")
    g.add_argument("--moe-router-aux-loss-fusion", dest="moe_router_aux_loss_fusion",
                   action="store_true", default=False,
                   help="a fused kernel for the balancing loss in some Megatron releases; no "
                   "effect here (one implementation, the same numbers)")
    g.add_argument("--no-moe-router-aux-loss-fusion", dest="moe_router_aux_loss_fusion",
                   action="store_false", help=argparse.SUPPRESS)
    g.add_argument("--moe-enable-routing-replay", action="store_true",
                   help="give each router a record / replay of its top-k experts (set by the "
                   "caller, e.g. to train on the routing of a rollout); no effect until used")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=DISPATCHER_TYPES)
    g.add_argument("--moe-grouped-gemm", action="store_true")
    g.add_argument("--moe-use-grouped-tensor", action="store_true",
                   help="TransformerEngine's grouped-tensor path for the grouped GEMM (device-"
                   "side expert counts); the same computation here. Needs --moe-grouped-gemm")
    g.add_argument("--moe-single-grouped-weight", action="store_true",
                   help="each expert projection's weights as one [experts, out, in] parameter "
                   "(experts.linear_fc1.weight); needs --moe-use-grouped-tensor")
    g.add_argument("--moe-single-grouped-bias", action="store_true",
                   help="each expert projection's biases as one [experts, out] parameter; needs "
                   "--moe-use-grouped-tensor and biases")
    g.add_argument("--use-grouped-gemm-for-shared-expert", action="store_true",
                   help="Megatron-Core's fused shared expert (TransformerEngine GroupedLinear, "
                   "MXFP8/NVFP4 only); no effect without a shared expert")
    g.add_argument("--use-grouped-gemm-for-dense-mlp", action="store_true",
                   help="Megatron-Core's TEFusedDenseMLP (MXFP8) with "
                   "--use-transformer-engine-op-fuser; no effect without it")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=DROP_POLICIES)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output per token by sigmoid(x . gate_weight)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true")
    g.add_argument("--moe-latent-size", type=int, default=None,
                   help="project each token to this width before the routed experts and back "
                   "after (fc1_latent_proj / fc2_latent_proj); router and shared expert see the "
                   "hidden state")
    g.add_argument("--moe-mlp-glu-interleave-size", type=int, default=None,
                   help="with a gated unit (--swiglu): the experts' fc1 rows come in blocks of "
                   "N gate rows then N value rows, not in two halves")
    g.add_argument("--moe-shared-expert-glu-interleave-size", type=int, default=None,
                   help="the same for the shared expert's fc1")
    g.add_argument("--moe-per-layer-logging", action="store_true",
                   help="also log each MoE layer's balancing and z losses (TensorBoard)")
    g.add_argument("--moe-use-upcycling", action="store_true",
                   help="first run of an upcycled MoE: load the dense checkpoint in --load, "
                   "copy each dense MLP into the experts, save the MoE model to --save at "
                   "iteration 1 and train on; later runs drop this flag and --load --save")
    g.add_argument("--moe-upcycling-granularity", type=int, default=1,
                   help="with --moe-use-upcycling: split the dense FFN into this many expert "
                   "pieces (the dense FFN is --ffn-hidden-size x this)")


def _add_mtp_args(parser):
    g = parser.add_argument_group(title="multi-token prediction")
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="multi-token prediction depths after the last layer (DeepSeek-V3); "
                   "depth K predicts the token K + 2 places ahead")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1,
                   help="the MTP losses' weight: their mean over depths is multiplied by it")
    g.add_argument("--mtp-use-repeated-layer", action="store_true",
                   help="build one MTP layer (mtp.layers.0) and apply it --mtp-num-layers "
                   "times instead of one layer per depth")
    g.add_argument("--mtp-detach-heads", action="store_true",
                   help="the MTP loss trains only the MTP layers: the main model's hidden "
                   "state, the embedding and the output weight reach them detached; their "
                   "gradients are clipped by a norm of their own")
    g.add_argument("--mtp-standalone", action="store_true",
                   help="the MTP layers have a pipeline stage of their own, before the loss "
                   "stage (set from --pipeline-model-parallel-layout, e.g. 'Ettmm|L' at pp 2, "
                   "'Et|ttmm|L' at pp 3; given, it must agree with the layout)")
    g.add_argument("--mtp-hsm", action="store_true",
                   help="hidden-state mixing: in training, each MTP depth after the first takes "
                   "for every token a random pick among the main model's and the earlier "
                   "depths' hidden states (shifted to the same target), from an RNG stream of "
                   "its own per data-parallel replica, saved in checkpoints; needs "
                   "--mtp-num-layers >= 2")


def _add_distillation_args(parser):
    g = parser.add_argument_group(title="offline knowledge distillation")
    g.add_argument("--logits-save-top-k", type=int, default=None,
                   help="log-probabilities saved per token by --logits-save-dir (default 128)")
    g.add_argument("--logits-save-top-p", type=float, default=None,
                   help="after the top-K, keep only the smallest prefix whose probability "
                   "reaches this (0 < p <= 1)")
    g.add_argument("--logits-save-top-p-min-k", type=int, default=1,
                   help="entries kept per token under --logits-save-top-p whatever their mass")
    g.add_argument("--logits-save-dir", type=str, default=None,
                   help="folder where the train samples' top-K teacher log-probabilities "
                   "and token ids are written as Megatron-LM's tars, one per data-parallel "
                   "rank and iteration")
    g.add_argument("--logits-save-dtype", type=str, default="fp16",
                   choices=["fp16", "bf16", "fp32"],
                   help="dtype of the saved log-probabilities")
    g.add_argument("--logits-load-dir", type=str, default=None,
                   help="folder of saved teacher log-probabilities: train on (1 - alpha) LM "
                   "loss + alpha KL(teacher || student)")
    g.add_argument("--logits-load-decode-threads", type=int, default=4,
                   help="threads decoding teacher tar members")
    g.add_argument("--logits-load-prefetch-factor", type=int, default=3,
                   help="iterations of teacher data decoded ahead")
    g.add_argument("--logits-load-msc-prefetch-depth", type=int, default=2)
    g.add_argument("--logits-load-kd-loss-alpha", type=float, default=1.0,
                   help="alpha, the distillation term's weight")
    g.add_argument("--logits-load-ignore-errors", action="store_true",
                   help="missing or corrupt teacher data: warn and train that micro-batch "
                   "on the LM loss alone instead of stopping")


ARG_GROUP_BUILDERS = [
    _add_network_size_args, _add_regularization_args, _add_training_args,
    _add_initialization_args, _add_learning_rate_args, _add_checkpointing_args,
    _add_mixed_precision_args, _add_distributed_args, _add_validation_args, _add_data_args,
    _add_logging_args, _add_profiling_args, _add_moe_args, _add_mtp_args,
    _add_distillation_args,
    _add_run_control_args,
]


def _own_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron-style arguments", allow_abbrev=False)
    for add in ARG_GROUP_BUILDERS:
        add(parser)
    return parser


# The no-effect and unsupported flags: flag_registry's, and the rows of
# megatron_flags_table that the argument groups above do not define.
NO_EFFECT_FLAGS, UNSUPPORTED_FLAGS = megatron_flags.registry(
    megatron_flags.register(_own_parser()))
NO_EFFECT_FLAGS.update(flag_registry.NO_EFFECT_FLAGS)
UNSUPPORTED_FLAGS.update(flag_registry.UNSUPPORTED_FLAGS)


def build_parser(extra_args_provider: Optional[Callable] = None) -> argparse.ArgumentParser:
    """Megatron's flags: this module's argument groups, a script's own flags, then every other
    option of Megatron-LM's parser from :mod:`megatron.training.megatron_flags_table`."""
    parser = _own_parser()
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    megatron_flags.register(parser)
    _describe_registered_flags(parser)
    return parser


def _describe_registered_flags(parser) -> None:
    """--help of each flag in NO_EFFECT_FLAGS / UNSUPPORTED_FLAGS says what it does here."""
    for action in parser._actions:
        if action.dest in NO_EFFECT_FLAGS:
            action.help = ("accepted for Megatron scripts; no effect here: "
                           + NO_EFFECT_FLAGS[action.dest])
        elif action.dest in UNSUPPORTED_FLAGS:
            action.help = ("not supported here (a run that sets it stops): "
                           + UNSUPPORTED_FLAGS[action.dest])


def parse_args(extra_args_provider: Optional[Callable] = None, ignore_unknown_args: bool = False,
               *, argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse Megatron's flags (no validation); unknown flags are argparse errors (exit 2).

    Megatron-LM's signature: ``extra_args_provider(parser)`` adds a script's own flags, and
    ``ignore_unknown_args`` lets flags this parser does not know pass. ``argv`` parses a list
    instead of ``sys.argv[1:]``.
    """
    parser = build_parser(extra_args_provider)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(argv)
    else:
        args = parser.parse_args(argv)
    words = sys.argv[1:] if argv is None else list(argv)
    if args.yaml_cfg is not None:
        args = _args_from_yaml(parser, args, words)
    else:
        # Whether the format was chosen on the command line (a default can be replaced where
        # it cannot work; a choice the user made is refused instead).
        args.ckpt_format_given = any(w in ("--ckpt-format", "--use-dist-ckpt")
                                     or w.startswith("--ckpt-format=") for w in words)
        # Whether the inf/nan check (on by default) was asked for by name.
        args.check_for_nan_given = "--check-for-nan-in-loss-and-grad" in words
    args.rank = int(os.environ.get("RANK", "0"))
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return args


def _args_from_yaml(parser, args, words) -> argparse.Namespace:
    """--yaml-cfg: the namespace the file's equivalent command line parses to.

    Raises:
        YamlConfigError: naming the file and the key, or the flags given beside it.
    """
    from megatron.training import yaml_arguments

    args, given = yaml_arguments.args_from_yaml(parser, args, words, UNSUPPORTED_FLAGS)
    args.ckpt_format_given = given.get("ckpt_format") is not None or bool(
        given.get("use_dist_ckpt"))
    args.check_for_nan_given = given.get("check_for_nan_in_loss_and_grad") is True
    return args


@functools.lru_cache(maxsize=1)
def flag_names_and_defaults():
    """dest -> first option string, dest -> default (as argparse: the first action's)."""
    parser = build_parser()
    names, defaults = {}, {}
    for action in parser._actions:
        if action.option_strings:
            names.setdefault(action.dest, action.option_strings[0])
            defaults.setdefault(action.dest, action.default)
    return parser, names, defaults


def _check_registered_flags(args) -> None:
    """Stop on an unsupported flag that is set; one note for each no-effect flag that is set."""
    parser, names, defaults = flag_names_and_defaults()
    for dest, instead in UNSUPPORTED_FLAGS.items():
        value = getattr(args, dest, None)
        if value != defaults[dest]:
            raise ArgumentsError(f"{names[dest]} {_shown(value)} is not supported: {instead}")
    refused = megatron_flags.refused_choice(parser, args)
    if refused:
        raise ArgumentsError(refused)
    for dest, reason in NO_EFFECT_FLAGS.items():
        if getattr(args, dest, None) != defaults[dest]:
            if args.rank == 0:
                print(f"NOTE: {names[dest]} has no effect here: {reason}", flush=True)


def _shown(value) -> str:
    """A flag's value as typed on the command line (lists space separated)."""
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Derive sizes and reject impossible combinations, before any process group exists.

    Raises:
        ArgumentsError: naming the flags and values involved.
    """
    _check_registered_flags(args)
    return check_flags(args)


def parse_and_validate(argv: Optional[List[str]] = None,
                       extra_args_provider: Optional[Callable] = None,
                       prog: Optional[str] = None) -> argparse.Namespace:
    """What an entry point calls: bad sizes print one line naming the flags and exit with 2."""
    try:
        args = parse_args(extra_args_provider, argv=argv)
        return validate_args(args)
    except (ArgumentsError, ConfigError) as err:
        name = prog or os.path.basename(sys.argv[0]) or "megatron"
        print(f"{name}: error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2)
