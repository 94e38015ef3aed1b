"""Megatron-LM's ``--yaml-cfg``: the whole configuration from one YAML file.

The file has Megatron's layout. Top-level keys are the dests of this parser's flags
(``train_iters``, ``lr``, ``data_path``, ...); a ``language_model:`` section holds fields of
Megatron-Core's ``TransformerConfig`` and a ``model_parallel:`` section fields of its
``ModelParallelConfig``, which are mapped onto the flags that set them (most share the name;
:data:`RENAMED` and :data:`TRANSLATED` list the others). A string may name environment
variables as ``${NAME}``.

Each value goes through the same argparse action (type, choices) that parses its flag, into a
namespace holding the parser's defaults, so a YAML run and its command line give the same
``args`` and then pass the same ``validate_args``. Unlike Megatron, a key this module does not
know, a value of the wrong type, an unset variable, or another flag on the command line stops
the run with one line naming the file and the key (or the flags). PyYAML is imported here only.
"""

import argparse
import os
import re
from typing import Dict, Iterable, List, NamedTuple, Tuple

from megatron.training import megatron_flags
from megatron.training.validation import ArgumentsError

# ModelParallelConfig fields that are the dests of flags of the same name.
MODEL_PARALLEL_FIELDS = frozenset("""
    tensor_model_parallel_size pipeline_model_parallel_comm_backend
    pipeline_model_parallel_size sequence_parallel context_parallel_size
    hierarchical_context_parallel_sizes max_seqlen_per_dp_cp_rank hybrid_context_parallel
    expert_model_parallel_size expert_tensor_parallel_size perform_initialization
    use_cpu_initialization fp16 bf16 deterministic_mode gradient_accumulation_fusion
    async_tensor_model_parallel_allreduce tp_comm_overlap tp_comm_bulk_wgrad
    tp_comm_bulk_dgrad tp_comm_overlap_ag tp_comm_overlap_rs tp_comm_overlap_rs_dgrad
    tp_comm_split_ag tp_comm_split_rs cross_entropy_loss_fusion cross_entropy_fusion_impl
    tp_comm_bootstrap_backend overlap_moe_expert_parallel_comm delay_wgrad_compute
    ep_overlap_early_attn_memory_release overlap_p2p_comm use_ring_exchange_p2p
    defer_embedding_wgrad_compute wgrad_deferral_limit overlap_p2p_comm_warmup_flush
    microbatch_group_size_per_vp_stage mtp_standalone cpu_offloading_num_layers
    barrier_with_L1_time
""".split())

# TransformerConfig fields (beyond the ModelParallelConfig ones it inherits) that are the dests
# of flags of the same name.
TRANSFORMER_FIELDS = frozenset("""
    num_layers mtp_num_layers mtp_loss_scaling_factor pipeline_model_parallel_layout
    account_for_embedding_in_pipeline_split account_for_loss_in_pipeline_split hidden_size
    num_attention_heads attention_backend softmax_type ffn_hidden_size
    kv_channels hidden_dropout attention_dropout fp32_residual_connection
    apply_residual_connection_post_layernorm layernorm_epsilon add_bias_linear
    add_qkv_bias glu_linear_offset activation_func_clamp_value rotary_interleaved
    window_size window_attn_skip_freq normalization qk_layernorm qk_l2_norm qk_clip
    qk_clip_alpha qk_clip_threshold log_max_attention_logit attention_output_gate
    test_mode calculate_per_token_loss multi_latent_attention no_rope_freq
    experimental_attention_variant dsa_indexer_n_heads dsa_indexer_head_dim
    dsa_indexer_topk dsa_indexer_loss_coeff dsa_indexer_use_sparse_loss
    linear_attention_freq linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim
    linear_num_key_heads linear_num_value_heads init_method_std embedding_init_method_std
    init_model_with_meta_device apply_query_key_layer_scaling attention_softmax_in_fp32
    disable_bf16_reduced_precision_matmul masked_softmax_fusion bias_dropout_fusion
    apply_rope_fusion use_fused_weighted_squared_relu recompute_granularity
    recompute_method recompute_num_layers distribute_saved_activations recompute_modules
    fp8 fp8_recipe fp8_quantizer_factory fp8_margin fp8_interval fp8_amax_history_len
    fp8_amax_compute_algo fp8_wgrad first_last_layers_bf16 num_layers_at_start_in_bf16
    num_layers_at_end_in_bf16 use_kitchen_attention kitchen_attention_backend fp4
    fp4_recipe fp4_quantizer_factory moe_shared_expert_intermediate_size
    moe_shared_expert_gate moe_shared_expert_overlap moe_layer_freq moe_ffn_hidden_size
    moe_router_load_balancing_type moe_router_topk moe_enable_routing_replay
    moe_router_padding_for_quantization moe_router_padding_for_fp8 moe_router_num_groups
    moe_router_group_topk moe_router_pre_softmax moe_router_topk_scaling_factor
    moe_router_score_function moe_router_dtype moe_router_enable_expert_bias
    moe_router_bias_update_rate moe_router_force_load_balancing moe_grouped_gemm
    moe_aux_loss_coeff moe_z_loss_coeff moe_input_jitter_eps moe_token_dispatcher_type
    moe_enable_deepep moe_flex_dispatcher_backend moe_per_layer_logging
    moe_expert_capacity_factor moe_pad_expert_input_to_capacity moe_token_drop_policy
    moe_layer_recompute moe_permute_fusion moe_router_fusion moe_apply_probs_on_input
    moe_latent_size moe_deepep_num_sms moe_hybridep_num_sms cp_comm_type enable_cuda_graph
    cuda_graph_warmup_steps external_cuda_graph cuda_graph_impl
    clone_scatter_output_in_embedding config_logger_dir flash_decode batch_invariant_mode
    use_te_activation_func inference_rng_tracker symmetric_ar_type
    inference_fuse_tp_communication mrope_section is_hybrid_model mamba_state_dim
    mamba_head_dim mamba_num_groups mamba_num_heads use_mamba_mem_eff_path
    mlp_chunks_for_prefill transformer_impl fine_grained_activation_offloading
    offload_modules min_offloaded_tensor_size
""".split()) | MODEL_PARALLEL_FIELDS

# Config fields whose flag has another dest: field -> dest (Megatron's arguments.py does the
# same translation when it builds the configs from flags).
RENAMED = {
    "virtual_pipeline_model_parallel_size": "num_virtual_stages_per_pipeline_rank",
    "num_moe_experts": "num_experts",
    "num_layers_in_first_pipeline_stage": "decoder_first_pipeline_num_layers",
    "num_layers_in_last_pipeline_stage": "decoder_last_pipeline_num_layers",
    "layernorm_zero_centered_gamma": "apply_layernorm_1p",
    "bias_activation_fusion": "bias_gelu_fusion",
    "fp8_param": "fp8_param_gather",
}
MODEL_PARALLEL_RENAMED = ("virtual_pipeline_model_parallel_size",)

# activation_func: the three names Megatron's YAML reader takes -> (swiglu, squared_relu).
ACTIVATIONS = {"swiglu": (True, False), "squaredrelu": (False, True), "gelu": (False, False)}

# Config fields that take a value other than a flag's: field -> what it takes. Their
# translations are in :func:`_translated`.
TRANSLATED = {
    "activation_func": "swiglu, squaredrelu or gelu (--swiglu, --squared-relu, or neither)",
    "init_method": "xavier_uniform (--init-method-xavier-uniform) or null",
    "persist_layer_norm": "true or false (false is --no-persist-layer-norm)",
    "gated_linear_unit": "false, or true beside activation_func: swiglu",
    "num_query_groups": "an integer (--group-query-attention --num-query-groups N)",
}

# Fields Megatron does not read from the YAML: it derives them from other settings or sets them
# at run time, as this project does. Accepted at the value shown (Megatron's own defaults), a
# note otherwise. field -> value that needs no note.
DERIVED = {
    "params_dtype": None, "pipeline_dtype": None, "timers": None, "grad_scale_func": None,
    "finalize_model_grads_func": None, "no_sync_func": None, "grad_sync_func": None,
    "param_sync_func": None, "autocast_dtype": None, "enable_autocast": False,
    "variable_seq_lengths": False, "batch_p2p_comm": True, "batch_p2p_sync": True,
    "deallocate_pipeline_outputs": False, "output_layer_init_method": None,
}
MODEL_PARALLEL_DERIVED = tuple(k for k in DERIVED if k != "output_layer_init_method")

SECTIONS = ("language_model", "model_parallel")
_VARIABLE = re.compile(r"\$\{([^}]*)\}")


class YamlConfigError(ArgumentsError):
    """A --yaml-cfg file that cannot be used; the message names the file and the key."""


class _Env(NamedTuple):
    """A string that names environment variables; ``plain`` when it was not quoted."""
    text: str
    plain: bool


class _Setting(NamedTuple):
    key: str    # as written in the file, e.g. "language_model.num_moe_experts"
    dest: str
    value: object


def accepted_fields(section: str) -> List[str]:
    """Every config field the ``section`` maps (for tests and --help)."""
    if section == "model_parallel":
        return sorted(MODEL_PARALLEL_FIELDS | set(MODEL_PARALLEL_RENAMED)
                      | set(MODEL_PARALLEL_DERIVED))
    return sorted(TRANSFORMER_FIELDS | set(RENAMED) | set(TRANSLATED) | set(DERIVED))


def args_from_yaml(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   words: Iterable[str], refused: Dict[str, str]
                   ) -> Tuple[argparse.Namespace, Dict[str, object]]:
    """The namespace the command line equivalent to the --yaml-cfg file would parse to.

    Args:
        parser: the run's parser (its defaults fill the keys the file leaves out).
        args: what ``parser`` made of ``words`` (its ``yaml_cfg`` names the file).
        words: the command line; nothing but ``--yaml-cfg PATH`` may be on it.
        refused: dest -> what to do instead, for flags a run may not set.

    Returns:
        ``(args, given)``: ``args.yaml_cfg`` is ``path``; ``given`` maps each dest the file
        sets to its value.

    Raises:
        YamlConfigError: one line naming the file and the key, or the extra flags.
    """
    path = args.yaml_cfg
    _refuse_other_flags(path, list(words))
    dests = {a.dest for a in parser._actions if a.option_strings}
    settings = _settings(path, _read(path), dests)
    out = parser.parse_args([])
    defaults = argparse.Namespace(**vars(out))
    given: Dict[str, Tuple[str, object]] = {}
    for setting in settings:
        _apply(parser, out, path, setting)
        value = getattr(out, setting.dest)
        if setting.dest in given and given[setting.dest][1] != value:
            raise YamlConfigError(f"{path}: {given[setting.dest][0]} and {setting.key} "
                                  f"disagree (both set {_flag(parser, setting.dest)})")
        given[setting.dest] = (setting.key, value)
    for dest, (key, value) in given.items():
        if dest in refused and value != getattr(defaults, dest):
            raise YamlConfigError(f"{path}: {key}: {_flag(parser, dest)} {_shown(value)} is not "
                                  f"supported: {refused[dest]}")
    refused_value = megatron_flags.refused_choice(parser, out)
    if refused_value:
        raise YamlConfigError(f"{path}: {refused_value}")
    out.yaml_cfg = path
    return out, {dest: value for dest, (_, value) in given.items()}


def _refuse_other_flags(path: str, words: List[str]) -> None:
    rest, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word == "--yaml-cfg":
            skip = True
        elif not word.startswith("--yaml-cfg="):
            rest.append(word)
    if rest:
        flags = [w for w in rest if w.startswith("-")] or rest
        raise YamlConfigError(
            f"--yaml-cfg {path} takes the whole configuration from the file; refusing the other "
            f"command-line flags {' '.join(flags)} (set them as keys in the file)")


def _read(path: str) -> dict:
    import yaml  # only --yaml-cfg needs PyYAML

    class Loader(yaml.SafeLoader):
        """safe_load, keeping strings that name ${VARIABLES} for :func:`_expand`."""

    def string(loader, node):
        text = loader.construct_scalar(node)
        return _Env(text, node.style is None) if _VARIABLE.search(text) else text

    Loader.add_constructor("tag:yaml.org,2002:str", string)
    try:
        with open(path) as f:
            config = yaml.load(f, Loader=Loader)
    except OSError as err:
        raise YamlConfigError(f"--yaml-cfg {path}: cannot read it: {err.strerror}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise YamlConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise YamlConfigError(f"{path}: expected a mapping of keys to values at the top, got "
                              f"{type(config).__name__}")
    return config


def _expand(value, path: str, key: str):
    """``value`` with each ``${NAME}`` replaced by the environment variable's value; an unquoted
    string that becomes a number or true/false is read as one, as YAML would have read it."""
    if isinstance(value, list):
        return [_expand(v, path, key) for v in value]
    if not isinstance(value, _Env):
        return value

    def variable(match):
        name = match.group(1)
        if name not in os.environ:
            raise YamlConfigError(f"{path}: {key}: environment variable ${{{name}}} is not set")
        return os.environ[name]

    text = _VARIABLE.sub(variable, value.text)
    if value.plain:
        import yaml
        try:
            scalar = yaml.safe_load(text)
        except yaml.YAMLError:
            return text
        if isinstance(scalar, (bool, int, float)):
            return scalar
    return text


def _settings(path: str, config: dict, dests) -> List[_Setting]:
    """(key, dest, value) for every key of the file, sections translated to flag dests."""
    out = []
    for key, value in config.items():
        if key in SECTIONS and isinstance(value, dict):
            for field, inner in value.items():
                name = f"{key}.{field}"
                out += _field_settings(path, key, field, name, _expand(inner, path, name),
                                       dests)
        elif key in SECTIONS and value is not None:
            raise YamlConfigError(f"{path}: {key}: expected a mapping of config fields, got "
                                  f"{_shown(value)}")
        elif key == "yaml_cfg":
            raise YamlConfigError(f"{path}: yaml_cfg: a YAML file cannot name another one")
        elif key not in SECTIONS:
            out.append(_Setting(str(key), str(key), _expand(value, path, str(key))))
    return out


def _field_settings(path, section, field, name, value, dests) -> List[_Setting]:
    """The flag dests one config field sets (none for null or a derived field)."""
    if field not in accepted_fields(section):
        config = "ModelParallelConfig" if section == "model_parallel" else "TransformerConfig"
        hint = f" (the flag dest {field} is a top-level key)" if field in dests else ""
        raise YamlConfigError(f"{path}: unknown key {name}: not a {config} field that a flag "
                              f"sets here{hint}")
    if value is None:
        return []
    if field in DERIVED:
        if value != DERIVED[field] and os.environ.get("RANK", "0") == "0":
            print(f"NOTE: {path}: {name} has no effect here: it is derived from the other "
                  f"settings, as Megatron does", flush=True)
        return []
    if field in TRANSLATED:
        return [_Setting(name, dest, v) for dest, v in _translated(path, name, field, value)]
    return [_Setting(name, RENAMED.get(field, field), value)]


def _translated(path, name, field, value) -> List[Tuple[str, object]]:
    def wrong():
        return YamlConfigError(f"{path}: {name}: expected {TRANSLATED[field]}, got "
                               f"{_shown(value)}")

    if field == "activation_func":
        if value not in ACTIVATIONS:
            raise wrong()
        return list(zip(("swiglu", "squared_relu"), ACTIVATIONS[value]))
    if field == "num_query_groups":
        # Megatron-Core groups the queries whenever the field is set.
        return [("num_query_groups", value), ("group_query_attention", True)]
    if field == "init_method":
        if value != "xavier_uniform":
            raise wrong()
        return [("init_method_xavier_uniform", True)]
    if not isinstance(value, bool):
        raise wrong()
    if field == "persist_layer_norm":
        return [("no_persist_layer_norm", not value)]
    # gated_linear_unit: Megatron gates the MLP exactly when activation_func is swiglu.
    return [("swiglu", True)] if value else []


def _apply(parser, args, path: str, setting: _Setting) -> None:
    """Set one dest through the action its flag parses with (type, choices, nargs)."""
    actions = [a for a in parser._actions if a.dest == setting.dest and a.option_strings]
    if not actions:
        raise YamlConfigError(f"{path}: unknown key {setting.key}: no flag has this dest (a "
                              f"top-level key is a flag's dest, e.g. train_iters for "
                              f"--train-iters)")
    value = setting.value
    if value is None:
        return
    switches = [a for a in actions if a.nargs == 0]
    if switches:
        _switch(args, path, setting, switches)
        return
    action = actions[0]
    if isinstance(value, bool):
        raise YamlConfigError(f"{path}: {setting.key}: expected a value (as "
                              f"{action.option_strings[0]}), got {_shown(value)}")
    words = _words(path, setting, action)
    try:
        values = parser._get_values(action, words)
    except argparse.ArgumentError as err:
        raise YamlConfigError(f"{path}: {setting.key}: {err.message} (as "
                              f"{action.option_strings[0]})") from None
    action(parser, args, values, action.option_strings[0])


def _switch(args, path: str, setting: _Setting, actions) -> None:
    """A true/false key: what the command line stores with the flag (or its other form), or
    leaves as the default without it."""
    value = setting.value
    if isinstance(value, bool):
        for action in actions:
            if isinstance(action, argparse.BooleanOptionalAction) or action.const is value:
                setattr(args, action.dest, value)
                return
        if any(isinstance(a.const, bool) for a in actions):
            return  # the flag left out
    flags = "/".join(o for a in actions for o in a.option_strings)
    raise YamlConfigError(f"{path}: {setting.key}: expected true or false (as {flags}), got "
                          f"{_shown(value)}")


def _words(path: str, setting: _Setting, action) -> List[str]:
    """``setting``'s value as the words that would follow the flag on a command line."""
    value, many = setting.value, action.nargs not in (None, "?")
    if isinstance(value, list) and many:
        words = value
    elif isinstance(value, str) and many:
        words = value.split()  # Megatron's YAML reader splits a data_path string the same way
    elif isinstance(value, (list, dict)):
        raise YamlConfigError(f"{path}: {setting.key}: expected one value (as "
                              f"{action.option_strings[0]}), got {_shown(value)}")
    else:
        words = [value]
    if any(isinstance(w, (list, dict, bool)) or w is None for w in words):
        raise YamlConfigError(f"{path}: {setting.key}: expected a list of plain values (as "
                              f"{action.option_strings[0]}), got {_shown(value)}")
    if action.nargs == "+" and not words:
        raise YamlConfigError(f"{path}: {setting.key}: expected at least one value (as "
                              f"{action.option_strings[0]})")
    if isinstance(action.nargs, int) and len(words) != action.nargs:
        raise YamlConfigError(f"{path}: {setting.key}: expected {action.nargs} values (as "
                              f"{action.option_strings[0]}), got {len(words)}")
    return [str(w) for w in words]


def _flag(parser, dest: str) -> str:
    return next(a.option_strings[0] for a in parser._actions
                if a.dest == dest and a.option_strings)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return " ".join(map(_shown, value))
    return str(value)
