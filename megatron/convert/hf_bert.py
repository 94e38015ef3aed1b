"""BERT to and from the canonical stream: ``BertForPreTraining`` / ``BertForMaskedLM`` (model_type
``bert``) for post-LayerNorm models, ``MegatronBertForPreTraining`` / ``MegatronBertForMaskedLM``
(model_type ``megatron-bert``) for pre-LayerNorm ones.

Which architecture:

- ``--apply-residual-connection-post-layernorm`` (the original BERT ordering) is ``Bert*``;
  without it (Megatron's default) the model is ``MegatronBert*``.
- With the binary head (``args.bert_binary_head``) the pooler and ``seq_relationship`` are
  written as ``*ForPreTraining``; without it (``--bert-no-binary-head``) as ``*ForMaskedLM``,
  which has neither (``*ForPreTraining`` would need a sentence-order head the model lacks).

The models these architectures express: learned absolute positions, LayerNorm, GeLU MLP, biases
in every linear layer, one key/value head per query head, head size hidden / heads, LM head tied
to the word embeddings.

Layout differences:

- Megatron's fused ``query_key_value`` rows are ordered per head as ``[np, 3, hn]``; HF keeps
  separate ``query`` / ``key`` / ``value`` ``[np hn, h]``.
- Post-LN: our layer ``i`` normalises its input (``input_layernorm``), HF's normalises its output.
  So HF ``embeddings.LayerNorm`` is our layer 0 ``input_layernorm``, HF layer ``i``
  ``attention.output.LayerNorm`` our ``post_attention_layernorm`` and HF layer ``i``
  ``output.LayerNorm`` our layer ``i + 1`` ``input_layernorm`` (the last layer's is our
  ``final_layernorm``). Pre-LN: ``attention.ln`` / ``ln`` / ``encoder.ln`` are ours one to one.
- HF always has a token-type table; a model without one (``num_tokentypes`` 0) is written with
  ``type_vocab_size`` 1 and a zero row (adding it changes nothing), and such a table is read back
  as no token types.
- Vocabulary: HF tables (word embeddings, ``cls.predictions.bias``) have the tokenizer's
  ``vocab_size`` rows; padding rows are dropped.

GeLU: HF applies one ``hidden_act`` both in the MLP and in the LM head's transform; ours are the
same function too, the tanh approximation (``megatron/fused_kernels/bias_gelu.py``). As for GPT-2
(:mod:`megatron.convert.hf_gpt2`), it is written ``gelu_pytorch_tanh``, or ``gelu_new`` with
``--openai-gelu`` (the two differ only in how sqrt(2/pi) is rounded), so the flag survives a
round trip. HF's ``gelu`` (the exact erf GeLU of most published BERTs) is something our model
cannot compute: such a folder is read with a NOTE on stderr, its GeLUs then computed with the
tanh approximation, which differs from erf by at most 4.7e-4 per activation.
"""

import sys
from typing import Dict, List, Tuple

import torch

from megatron.convert.hf_common import ConfigView, dtype_name
from megatron.convert.schema import (ConversionError, ModelMeta, bert_head_shapes,
                                     fit_vocab_rows)

# model_type -> whether the architecture is post-LayerNorm.
POST_LN_BY_MODEL_TYPE = {"bert": True, "megatron-bert": False}
_ACTIVATION_BY_OPENAI_GELU = {True: "gelu_new", False: "gelu_pytorch_tanh"}
# HF activations -> --openai-gelu: the tanh approximations exactly, the erf GeLUs approximately.
_OPENAI_GELU_BY_ACTIVATION = {"gelu_new": True, "gelu_pytorch_tanh": False, "gelu_fast": False,
                              "gelu": False, "gelu_python": False}
_ERF_ACTIVATIONS = ("gelu", "gelu_python")

_QKV = "self_attention.query_key_value"
_WORD = "bert.embeddings.word_embeddings.weight"
_TOKEN_TYPES = "bert.embeddings.token_type_embeddings.weight"
# Canonical layer tensor (without .weight / .bias) -> HF module under bert.encoder.layer.{i}.
_LAYER_MODULES = {
    True: {"self_attention.dense": "attention.output.dense",
           "post_attention_layernorm": "attention.output.LayerNorm",
           "mlp.dense_h_to_4h": "intermediate.dense", "mlp.dense_4h_to_h": "output.dense"},
    False: {"input_layernorm": "attention.ln", "self_attention.dense": "attention.output.dense",
            "post_attention_layernorm": "ln", "mlp.dense_h_to_4h": "intermediate.dense",
            "mlp.dense_4h_to_h": "output.dense"},
}
# BERT head piece kind -> {canonical tensor name: HF name}; the lm_head bias is handled apart.
_HEAD_NAMES = {
    "pooler": {"dense.weight": "bert.pooler.dense.weight", "dense.bias": "bert.pooler.dense.bias"},
    "lm_head": {"dense.weight": "cls.predictions.transform.dense.weight",
                "dense.bias": "cls.predictions.transform.dense.bias",
                "layernorm.weight": "cls.predictions.transform.LayerNorm.weight",
                "layernorm.bias": "cls.predictions.transform.LayerNorm.bias",
                "bias": "cls.predictions.bias"},
    "binary_head": {"weight": "cls.seq_relationship.weight", "bias": "cls.seq_relationship.bias"},
}


def architecture(meta: ModelMeta) -> str:
    """The transformers class that computes ``meta``'s BERT."""
    family = "Bert" if meta.apply_residual_connection_post_layernorm else "MegatronBert"
    return family + ("ForPreTraining" if meta.bert_binary_head else "ForMaskedLM")


def unsupported_features(meta: ModelMeta) -> List[str]:
    """What of ``meta``'s BERT the HF BERT classes cannot express, each naming its flag."""
    problems = []
    if meta.position_embedding_type != "learned_absolute":
        problems.append(f"--position-embedding-type {meta.position_embedding_type} (HF BERT "
                        "has learned absolute positions)")
    if meta.normalization != "LayerNorm":
        problems.append(f"--normalization {meta.normalization} (HF BERT uses LayerNorm)")
    if meta.swiglu:
        problems.append("--swiglu (HF BERT's MLP is GeLU)")
    if meta.untie_embeddings_and_output_weights:
        problems.append("--untie-embeddings-and-output-weights (HF BERT ties the LM head)")
    if not meta.add_bias_linear:
        problems.append("--disable-bias-linear (HF BERT has biases in every linear layer)")
    if meta.group_query_attention:
        problems.append(f"--group-query-attention --num-query-groups {meta.num_query_groups} "
                        f"with {meta.num_attention_heads} heads (HF BERT has one key/value "
                        "head per query head)")
    if meta.kv_channels * meta.num_attention_heads != meta.hidden_size:
        problems.append(f"--kv-channels {meta.kv_channels} x --num-attention-heads "
                        f"{meta.num_attention_heads} != --hidden-size {meta.hidden_size} "
                        "(HF BERT's head size is hidden / heads)")
    return problems


def hf_config(meta: ModelMeta, bos_id, eos_id) -> dict:
    """config.json for ``meta``'s BERT; ``pad_token_id`` is filled in from the tokenizer."""
    source = meta.source_args or {}
    post_ln = meta.apply_residual_connection_post_layernorm
    config = {
        "architectures": [architecture(meta)],
        "model_type": "bert" if post_ln else "megatron-bert",
        "vocab_size": meta.vocab_size,
        "hidden_size": meta.hidden_size,
        "num_hidden_layers": meta.num_layers,
        "num_attention_heads": meta.num_attention_heads,
        "intermediate_size": meta.ffn_hidden_size,
        "hidden_act": _ACTIVATION_BY_OPENAI_GELU[bool(meta.openai_gelu)],
        "hidden_dropout_prob": source.get("hidden_dropout", 0.1),
        "attention_probs_dropout_prob": source.get("attention_dropout", 0.1),
        "max_position_embeddings": meta.max_position_embeddings,
        "type_vocab_size": max(meta.num_tokentypes, 1),
        "initializer_range": source.get("init_method_std", 0.02),
        "layer_norm_eps": meta.norm_epsilon,
        "pad_token_id": None,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "is_decoder": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": False,
        "torch_dtype": dtype_name(meta.params_dtype),
    }
    if post_ln:
        config["position_embedding_type"] = "absolute"
    return config


# ---- canonical -> HF ---------------------------------------------------------------------------


def embeddings_to_hf(tensors: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """Word embeddings trimmed to ``vocab_size`` rows; a zero token-type row when there is
    none."""
    word = tensors["word_embeddings"]
    token_types = tensors.get("tokentype_embeddings")
    if token_types is None:
        token_types = word.new_zeros((1, meta.hidden_size))
    return {_WORD: fit_vocab_rows(word, meta.vocab_size, meta.vocab_size),
            "bert.embeddings.position_embeddings.weight": tensors["position_embeddings"],
            _TOKEN_TYPES: token_types}


def _input_norm_name(index: int) -> str:
    """Post-LN: the HF layer norm that is our layer ``index``'s ``input_layernorm``."""
    return ("bert.embeddings.LayerNorm" if index == 0
            else f"bert.encoder.layer.{index - 1}.output.LayerNorm")


def layer_to_hf(index: int, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """One canonical layer as ``bert.encoder.layer.{index}.*`` (post-LN: its input norm goes to
    the embeddings or to the previous layer's output)."""
    post_ln = meta.apply_residual_connection_post_layernorm
    p = f"bert.encoder.layer.{index}."
    out = {}
    for ours, theirs in _LAYER_MODULES[post_ln].items():
        for kind in ("weight", "bias"):
            out[f"{p}{theirs}.{kind}"] = t[f"{ours}.{kind}"]
    if post_ln:
        for kind in ("weight", "bias"):
            out[f"{_input_norm_name(index)}.{kind}"] = t[f"input_layernorm.{kind}"]
    heads, hn = meta.num_attention_heads, meta.kv_channels
    for kind in ("weight", "bias"):
        fused = t[f"{_QKV}.{kind}"]
        rest = tuple(fused.shape[1:])
        per_head = fused.view(heads, 3, hn, *rest)                         # [np, 3, hn, (h)]
        for k, name in enumerate(("query", "key", "value")):
            out[f"{p}attention.self.{name}.{kind}"] = per_head[:, k].reshape(heads * hn, *rest)
    return out


def final_norm_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    prefix = (f"bert.encoder.layer.{meta.num_layers - 1}.output.LayerNorm"
              if meta.apply_residual_connection_post_layernorm else "bert.encoder.ln")
    return {f"{prefix}.weight": t["weight"], f"{prefix}.bias": t["bias"]}


def output_layer_to_hf(t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    raise ConversionError("BERT has no separate output layer (its LM head is tied to the word "
                          "embeddings)")


def head_to_hf(kind: str, t: Dict[str, torch.Tensor], meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """A pooler / lm_head / binary_head piece under HF's names (the LM bias trimmed)."""
    names = _HEAD_NAMES[kind]
    out = {names[name]: tensor for name, tensor in t.items()}
    if kind == "lm_head":
        out[names["bias"]] = fit_vocab_rows(t["bias"], meta.vocab_size, meta.vocab_size)
    return out


# ---- HF -> canonical ---------------------------------------------------------------------------


def _check_config(config: ConfigView) -> bool:
    """Refuse settings our BERT cannot compute; returns whether the model is post-LN."""
    model_type = config.get("model_type")
    for key, allowed in (("is_decoder", False), ("add_cross_attention", False)):
        if config.get(key, allowed) != allowed:
            raise config.unsupported(key, config.get(key), repr(allowed))
    position = config.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise config.unsupported("position_embedding_type", position, "'absolute'")
    return POST_LN_BY_MODEL_TYPE[model_type]


def meta_from_config(config: ConfigView, weights) -> ModelMeta:
    """The BERT a config.json (and its weights' names) describes.

    The binary head exists when ``cls.seq_relationship`` does; a one-row all-zero token-type
    table (as written for a model without token types) means ``num_tokentypes`` 0.
    """
    post_ln = _check_config(config)
    activation = config.get("hidden_act", "gelu")
    if activation not in _OPENAI_GELU_BY_ACTIVATION:
        raise config.unsupported("hidden_act", activation,
                                 "a GeLU (" + ", ".join(_OPENAI_GELU_BY_ACTIVATION) + ")")
    if activation in _ERF_ACTIVATIONS:
        print(f"NOTE: {config.path}: 'hidden_act' is {activation!r}, the exact (erf) GeLU; the "
              "converted model computes the tanh approximation instead (at most 4.7e-4 apart "
              "per activation)", file=sys.stderr, flush=True)
    hidden = config.need("hidden_size")
    heads = config.need("num_attention_heads")
    if hidden % heads != 0:
        raise ConversionError(f"{config.path}: hidden_size {hidden} is not divisible by "
                              f"num_attention_heads {heads}")
    positions = config.need("max_position_embeddings")
    vocab = config.need("vocab_size")
    type_rows = config.need("type_vocab_size", default=2)
    token_types = weights.get(_TOKEN_TYPES, (type_rows, hidden))
    num_tokentypes = 0 if type_rows == 1 and not token_types.any() else type_rows
    return ModelMeta(
        num_layers=config.need("num_hidden_layers"), hidden_size=hidden,
        ffn_hidden_size=config.need("intermediate_size"), num_attention_heads=heads,
        num_query_groups=heads, kv_channels=hidden // heads, max_position_embeddings=positions,
        vocab_size=vocab, padded_vocab_size=vocab, position_embedding_type="learned_absolute",
        normalization="LayerNorm", norm_epsilon=config.need("layer_norm_eps", float,
                                                            default=1e-12),
        swiglu=False, openai_gelu=_OPENAI_GELU_BY_ACTIVATION[activation], add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
        apply_residual_connection_post_layernorm=post_ln, params_dtype=config.params_dtype(),
        seq_length=positions, model_type="BERT", num_tokentypes=num_tokentypes,
        bert_binary_head=weights.has(_HEAD_NAMES["binary_head"]["weight"]))


def embeddings_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    h = meta.hidden_size
    out = {"word_embeddings": weights.get(_WORD, (meta.vocab_size, h)),
           "position_embeddings": weights.get("bert.embeddings.position_embeddings.weight",
                                              (meta.max_position_embeddings, h))}
    if meta.num_tokentypes:
        out["tokentype_embeddings"] = weights.get(_TOKEN_TYPES, (meta.num_tokentypes, h))
    return out


def layer_from_hf(weights, index: int, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    """``bert.encoder.layer.{index}.*`` (post-LN: and the norm before it) as one canonical
    layer."""
    h, ffn, heads, hn = (meta.hidden_size, meta.ffn_hidden_size, meta.num_attention_heads,
                         meta.kv_channels)
    post_ln = meta.apply_residual_connection_post_layernorm
    p = f"bert.encoder.layer.{index}."
    shapes = {"self_attention.dense": ((h, h), (h,)), "mlp.dense_h_to_4h": ((ffn, h), (ffn,)),
              "mlp.dense_4h_to_h": ((h, ffn), (h,))}
    out = {}
    for ours, theirs in _LAYER_MODULES[post_ln].items():
        weight_shape, bias_shape = shapes.get(ours, ((h,), (h,)))
        out[f"{ours}.weight"] = weights.get(f"{p}{theirs}.weight", weight_shape)
        out[f"{ours}.bias"] = weights.get(f"{p}{theirs}.bias", bias_shape)
    if post_ln:
        for kind in ("weight", "bias"):
            out[f"input_layernorm.{kind}"] = weights.get(f"{_input_norm_name(index)}.{kind}",
                                                         (h,))
    for kind, rest in (("weight", (h,)), ("bias", ())):
        parts = [weights.get(f"{p}attention.self.{name}.{kind}", (h,) + rest).view(
            heads, 1, hn, *rest) for name in ("query", "key", "value")]
        out[f"{_QKV}.{kind}"] = torch.cat(parts, dim=1).reshape(3 * h, *rest)  # [np, 3, hn]
    return out


def final_norm_from_hf(weights, meta: ModelMeta) -> Dict[str, torch.Tensor]:
    prefix = (f"bert.encoder.layer.{meta.num_layers - 1}.output.LayerNorm"
              if meta.apply_residual_connection_post_layernorm else "bert.encoder.ln")
    return {kind: weights.get(f"{prefix}.{kind}", (meta.hidden_size,))
            for kind in ("weight", "bias")}


def heads_from_hf(weights, meta: ModelMeta) -> List[Tuple[str, Dict[str, torch.Tensor]]]:
    """The pooler, LM head and binary head pieces ``(kind, tensors)``.

    Raises:
        ConversionError: the folder's ``cls.predictions.decoder.weight`` is not the word
            embeddings (our LM head is tied to them).
    """
    decoder = "cls.predictions.decoder.weight"
    shape = (meta.vocab_size, meta.hidden_size)
    if weights.has(decoder) and not torch.equal(weights.get(decoder, shape),
                                                weights.get(_WORD, shape)):
        raise ConversionError(f"{weights.folder}: {decoder} differs from {_WORD}; only BERTs "
                              "whose LM head is tied to the word embeddings can be converted")
    pieces = []
    for kind, shapes in bert_head_shapes(meta, meta.vocab_size):
        names = dict(_HEAD_NAMES[kind])
        if kind == "lm_head" and not weights.has(names["bias"]):
            names["bias"] = "cls.predictions.decoder.bias"
        pieces.append((kind, {name: weights.get(names[name], shape)
                              for name, shape in shapes.items()}))
    return pieces
