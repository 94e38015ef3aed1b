"""``--ckpt-format torch`` files whose model state uses Megatron-Core's module names.

Megatron-LM's Megatron-Core GPT (its default model since 2024) saved with ``--ckpt-format
torch``, and its converter's ``--saver core`` (formerly ``mcore``), write each rank's
``model_optim_rng.pt`` with ``model`` = the model chunk's flat state dict: the rank's local
shards under Megatron-Core keys, layer numbers local to the pipeline stage
(``decoder.layers.N.self_attention.linear_qkv.weight``), an ``_extra_state`` entry beside each
linear module, and the layer norms in either spelling (TransformerEngine's fused
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``, or the local spec's
``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``). Routed experts are
``mlp.experts.local_experts.J.linear_fc{1,2}.*`` (sequential) or ``mlp.experts.linear_fc{1,2}.
weightJ`` (grouped), J the expert's number on the rank.

A rank's shard of every tensor is laid out as this project's legacy one (the QKV rows whole
query groups in Megatron's order; a SwiGLU fc1 as [gate; up] of the rank), as
:mod:`megatron.checkpoint.dist.keys` records for the ``torch_dist`` mapping, so reading such a
file renames its entries to the model's names (FORMATS.md section 6) and copies nothing. The
names come from the model's own state, each mapped to the keys it may be saved under; entries
left over stay under their own names, so the caller's check reports them as unexpected.
"""

import re
from typing import Dict, List

from megatron.checkpoint.dist import keys
from megatron.checkpoint.names import dotted_names, lookup_dotted

# Top-level modules of Megatron-Core's GPT model.
MCORE_ROOTS = ("embedding", "decoder", "output_layer", "mtp")
EXTRA_STATE = "._extra_state"
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)")
_MTP_LAYER = re.compile(r"(mtp\.layers\.\d+\.transformer_layer\.)(.+)")
# The local spec's (and an MoE layer's TransformerEngine spec's) unfused norms.
_UNFUSED = {"input_layernorm.": "input_layernorm.", "post_attention_layernorm.":
            "pre_mlp_layernorm."}


def is_mla_name(name: str) -> bool:
    """Whether a chunk's tensor name is a multi-latent attention layer's (whose norms and
    projections map to Megatron-Core's MLA keys)."""
    return ".self_attention.linear_kv_down_proj." in name or \
        ".self_attention.linear_qkv_down_proj." in name


def is_mcore_state(tree) -> bool:
    """Whether a torch-format model state is Megatron-Core's: every top-level key is one of its
    GPT modules (nested, or flat dotted keys), none of the legacy ``language_model``."""
    if not isinstance(tree, dict) or not tree:
        return False
    return all(isinstance(k, str) and k.split(".")[0] in MCORE_ROOTS for k in tree)


def _layer_candidates(prefix: str, inner: str, mla: bool) -> List[str]:
    """The keys a layer tensor (legacy name ``inner`` within the layer) may be saved under, the
    layer's keys starting with ``prefix``."""
    out = []
    try:
        out.append(prefix + keys.layer_key(inner, mla=mla)[len(keys.LAYER_PREFIX):])
    except keys.KeyMappingError:
        pass
    expert = _EXPERT.fullmatch(inner)
    if expert:
        number, module, field = expert.groups()
        out += [prefix + inner, f"{prefix}mlp.experts.{module}.{field}{number}"]
    for legacy, unfused in _UNFUSED.items():
        if inner.startswith(legacy):
            out.append(prefix + unfused + inner[len(legacy):])
    out.append(prefix + inner)
    return out


def candidates(name: str, mla: bool = False) -> List[str]:
    """The Megatron-Core keys a chunk's legacy tensor name may be saved under, most likely
    first."""
    layer = keys.LAYER_NAME.fullmatch(name)
    if layer:
        return _layer_candidates(f"{keys.LAYER_PREFIX}{layer.group(1)}.", layer.group(2), mla)
    mtp = _MTP_LAYER.fullmatch(name)
    if mtp:
        return _layer_candidates(mtp.group(1), mtp.group(2), mla)
    if name == "word_embeddings_for_head.weight":
        # The last stage's copy of a tied table is Megatron-Core's output layer weight there.
        return ["output_layer.weight", "embedding.word_embeddings.weight"]
    if name in keys.OTHER_KEYS:
        return [keys.OTHER_KEYS[name]]
    return [name]


def _fill(template: dict, found: Dict[str, object], prefix: str = "") -> dict:
    out = {}
    for key, value in template.items():
        if isinstance(value, dict):
            out[key] = _fill(value, found, f"{prefix}{key}.")
        elif f"{prefix}{key}" in found:
            out[key] = found[f"{prefix}{key}"]
    return out


def to_model_names(template: dict, tree: dict, mla: bool = False) -> dict:
    """``tree`` (a Megatron-Core model state, nested or flat) renamed to the names and nesting
    of ``template`` (the chunk's ``state_dict_for_save_checkpoint()``). The ``_extra_state``
    entries are dropped; a model name with no saved key is left out and an entry no name took
    is kept under its own key (the caller's check names both)."""
    saved = {}
    for name in dotted_names(tree):
        if not name.endswith(EXTRA_STATE):
            saved[name] = lookup_dotted(tree, name)
    found, taken = {}, set()
    for name in dotted_names(template):
        for key in candidates(name, mla):
            key = keys.stored_key(key, saved)
            if key in saved and key not in taken:
                found[name] = saved[key]
                taken.add(key)
                break
    out = _fill(template, found)
    out.update({key: value for key, value in saved.items() if key not in taken})
    return out


# Template-free: a Megatron-Core key's legacy name, for readers that have no model (the
# converter). Megatron-Core's layer names -> legacy names within a layer; MLA's take precedence
# in an MLA model.
_LAYER_NAMES = {mcore: legacy for legacy, mcore in keys.LAYER_KEYS.items()}
_LAYER_NAMES.update({"input_layernorm.weight": "input_layernorm.weight",
                     "input_layernorm.bias": "input_layernorm.bias",
                     "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                     "pre_mlp_layernorm.bias": "post_attention_layernorm.bias"})
_MLA_LAYER_NAMES = {mcore: legacy for legacy, mcore in keys.MLA_LAYER_KEYS.items()}
_MLA_LAYER_NAMES.update({local: legacy for legacy, local in (
    ("self_attention.q_layernorm.weight", "self_attention.q_layernorm.weight"),
    ("self_attention.q_layernorm.bias", "self_attention.q_layernorm.bias"),
    ("self_attention.kv_layernorm.weight", "self_attention.kv_layernorm.weight"),
    ("self_attention.kv_layernorm.bias", "self_attention.kv_layernorm.bias"))})
_GROUPED = re.compile(r"mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)")
_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_OTHER_NAMES = {mcore: legacy for legacy, mcore in keys.OTHER_KEYS.items()
                if legacy != "word_embeddings_for_head.weight"}


def legacy_name(key: str, untied: bool, mla: bool = False) -> str:
    """The legacy dotted name (FORMATS.md section 6) of a Megatron-Core model key; ``untied``:
    the output layer is a weight of its own (else, on a last stage without the embedding, the
    tied table's copy). A key with no legacy counterpart comes back as it is."""
    if key == "output_layer.weight" and not untied:
        return "word_embeddings_for_head.weight"
    if key in _OTHER_NAMES:
        return _OTHER_NAMES[key]
    layer = _LAYER_KEY.fullmatch(key)
    if not layer:
        return key
    number, inner = layer.groups()
    grouped = _GROUPED.fullmatch(inner)
    if grouped:
        module, field, expert = grouped.groups()
        inner = f"mlp.experts.local_experts.{expert}.{module}.{field}"
    else:
        inner = (mla and _MLA_LAYER_NAMES.get(inner)) or _LAYER_NAMES.get(inner, inner)
    return f"language_model.encoder.layers.{number}.{inner}"


def to_legacy_tree(tree: dict, untied: bool, where: str) -> dict:
    """A Megatron-Core model state (one chunk of a torch-format file) in the legacy nesting the
    converter reads: ``language_model -> embedding -> word_embeddings -> weight``,
    ``language_model -> encoder -> "layers.N.<name>"`` and ``final_layernorm.*``,
    ``language_model -> output_layer``, ``word_embeddings_for_head``. ``_extra_state`` entries
    are dropped. Raises ``ValueError`` naming ``where`` for a multi-token prediction block,
    which this reading does not place."""
    flat = {name: lookup_dotted(tree, name) for name in dotted_names(tree)
            if not name.endswith(EXTRA_STATE)}
    if any(name.startswith("mtp.") for name in flat):
        raise ValueError(f"{where}: multi-token prediction layers in a Megatron-Core "
                         "--ckpt-format torch file are not read here; convert a "
                         "--ckpt-format torch_dist save of the run")
    mla = any(".self_attention.linear_kv_down_proj." in name for name in flat)
    out: dict = {}
    for key, value in flat.items():
        name = legacy_name(key, untied, mla)
        if name.startswith("language_model.encoder."):
            out.setdefault("language_model", {}).setdefault("encoder", {})[
                name[len("language_model.encoder."):]] = value
        elif name.startswith("language_model."):
            node = out.setdefault("language_model", {})
            *path, last = name[len("language_model."):].split(".")
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
        elif name == "word_embeddings_for_head.weight":
            out.setdefault("word_embeddings_for_head", {})["weight"] = value
        else:
            out[name] = value
    return out


# Writing: a chunk's legacy tree as Megatron-Core's layers of ``spec`` save it.
SPECS = ("transformer_engine", "local")
_LINEAR_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj",
                   "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                   "linear_kv_up_proj", "linear_qkv_down_proj", "fc1_latent_proj",
                   "fc2_latent_proj")
_LOCAL_NORMS = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
                ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))


def file_key(name: str, spec: str, moe_layer: bool = False, mla: bool = False) -> str:
    """The key Megatron-Core's ``spec`` layers (``transformer_engine`` or ``local``) give a
    chunk's legacy tensor name in their state dict; ``moe_layer``: the name's layer is a
    mixture-of-experts one (whose pre-MLP norm is a module of its own in either spec)."""
    if name == "word_embeddings_for_head.weight":
        return "output_layer.weight"
    layer = keys.LAYER_NAME.fullmatch(name)
    if not layer:
        return keys.OTHER_KEYS.get(name, name)
    number, inner = layer.groups()
    prefix = f"{keys.LAYER_PREFIX}{number}."
    if _EXPERT.fullmatch(inner):
        return prefix + inner
    key = prefix + keys.layer_key(inner, mla=mla)[len(keys.LAYER_PREFIX):]
    if spec == "local" or moe_layer:
        for fused, local in _LOCAL_NORMS:
            if key.startswith(prefix + fused) and (spec == "local" or "mlp." in fused):
                return prefix + local + key[len(prefix + fused):]
    if spec == "local":
        for te_name, local_name in keys.MLA_LOAD_ALIASES.items():
            if key.endswith(te_name):
                return key[:-len(te_name)] + local_name
    return key


def file_keys(legacy_tree: dict, spec: str) -> Dict[str, str]:
    """``{legacy dotted name: Megatron-Core key}`` of every tensor of a chunk's legacy tree."""
    names = dotted_names(legacy_tree)
    mla = any(is_mla_name(name) for name in names)
    moe = set()
    for name in names:
        layer = keys.LAYER_NAME.fullmatch(name)
        if layer and layer.group(2).startswith("mlp.router."):
            moe.add(layer.group(1))
    out = {}
    for name in names:
        layer = keys.LAYER_NAME.fullmatch(name)
        out[name] = file_key(name, spec, bool(layer) and layer.group(1) in moe, mla)
    return out


def to_mcore_state(legacy_tree: dict, spec: str, last_stage: bool, extra_state) -> dict:
    """A chunk's legacy tree as the flat state dict Megatron-Core's GPT of ``spec`` layers
    saves: its tensors under their keys (:func:`file_keys`) and an ``_extra_state`` entry
    (``extra_state``: None for local layers) for every linear module, the output layer's on
    the last stage (tied or not), and with TransformerEngine layers each attention's
    ``core_attention``."""
    out: dict = {}
    for name, key in file_keys(legacy_tree, spec).items():
        out[key] = lookup_dotted(legacy_tree, name)
    modules = []
    for key in list(out):
        module = key.rpartition(".")[0]
        if module.rpartition(".")[2] in _LINEAR_MODULES and module not in modules:
            modules.append(module)
            if spec == "transformer_engine" and module.endswith(".self_attention.linear_proj"):
                modules.append(module[:-len("linear_proj")] + "core_attention")
    for module in modules:
        out[f"{module}{EXTRA_STATE}"] = extra_state
    if last_stage:
        out[f"output_layer{EXTRA_STATE}"] = extra_state
    return out
