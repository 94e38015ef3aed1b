"""Every flag of the parser (megatron/training/arguments.py, and pretrain_bert.py's extra
arguments) is one of three things, and this test fails on any flag that is none of them:

(a) implemented: its value is used outside the parser, in megatron/, tools/, tasks/ or an entry
    point: loaded as ``args.<dest>`` or ``getattr(args, "<dest>")`` in code (read from the syntax
    tree: a name in a comment or docstring, an assignment to it, or a value only shown in an
    f-string message does not count); a flag read only by ``build_configs`` counts only when a
    config field computed from it is read by the model code; a flag read only by the validation
    checks counts only when :data:`DERIVED_IN_VALIDATION` says what they make of its value;
(b) declared no-effect: listed in ``arguments.NO_EFFECT_FLAGS`` (``flag_registry``'s and the
    no-effect rows of ``megatron_flags_table``), its --help says it has no effect here, and a run
    that sets it goes on (with one note);
(c) unsupported: listed in ``arguments.UNSUPPORTED_FLAGS`` (``flag_registry``'s and the refused
    rows of ``megatron_flags_table``; or a choice flag whose only
    choice is its default): set to anything else, ``validate_args`` stops, before any process group
    exists, with one line naming the flag and saying what to use instead.
"""

import argparse
import ast
import functools
import pathlib
import re
import subprocess
import sys
from typing import Optional

import pytest
import torch.distributed as dist

import pretrain_bert
from megatron.training import arguments
from megatron.training.arguments import (NO_EFFECT_FLAGS, UNSUPPORTED_FLAGS, ArgumentsError,
                                         build_parser, parse_args, validate_args)

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Flags handled by argparse itself rather than read by name.
PARSER_ONLY = {"help"}

# The parser and the modules that check its flags and build the configs from them: reads there
# are not uses, and a flag read only there counts through the config fields it fills.
ARGUMENTS_FILES = ("megatron/training/arguments.py", "megatron/training/validation.py",
                   "megatron/training/configs.py")

# Flags whose value the validation checks turn into other flags or a refusal, and nothing
# else reads: dest -> what validation does with it (keep it true when validation changes).
DERIVED_IN_VALIDATION = {
    "encoder_num_layers": "sets --num-layers when that is not given",
    "encoder_seq_length": "sets --seq-length (and must agree with it)",
    "step_batch_size_schedule": "parsed into step_batch_size_samples, which the micro-batch "
                                "calculator reads",
    "batch_size": "sets --micro-batch-size (old name)",
    "grad_reduce_in_bf16": "with --bf16 turns --accumulate-allreduce-grads-in-fp32 off, so the "
                           "grad buffers are bf16; refused without --bf16",
    "warmup": "sets --lr-warmup-iters (old name)",
    "model_parallel_size": "sets --tensor-model-parallel-size (old name)",
    "recompute_activations": "sets --recompute-granularity selective",
    "standalone_embedding_stage": "sets --pipeline-model-parallel-layout to the equivalent "
                                  "stages (rank 0 only the embedding)",
    "moe_layer_recompute": "sets --recompute-granularity selective and adds moe to "
                           "--recompute-modules (its older spelling)",
    "checkpoint_activations": "sets --recompute-granularity full --recompute-method uniform",
    "add_position_embedding": "refused unless --position-embedding-type rope, as in Megatron",
    "transformer_impl": "local and transformer_engine run this project's layers (one note); "
                        "inference_optimized is refused",
    "use_dist_ckpt": "sets --ckpt-format torch_dist (old spelling)",
    "attention_backend": "sets --use-flash-attn and --masked-softmax-fusion, which choose the "
                         "attention body (megatron/model/attention_backend.py)",
    "data_args_path": "its file's contents become --data-path",
    "use_grouped_gemm_for_shared_expert": "refused with a shared expert (Megatron-Core's fused "
                                          "shared expert computes in MXFP8 / NVFP4); without "
                                          "one Megatron-Core ignores it too",
    "use_grouped_gemm_for_dense_mlp": "refused with --use-transformer-engine-op-fuser under "
                                      "--transformer-impl transformer_engine (TEFusedDenseMLP "
                                      "computes in MXFP8); otherwise Megatron-Core ignores it",
    "dsa_kernel_backend": "none (plain PyTorch) runs; tilelang and cudnn are refused",
    "dsa_indexer_topk_freq": "1 (every DSA layer picks its own keys) runs; others are refused",
    "dsa_indexer_skip_topk_offset": "checked >= 0; with --dsa-indexer-topk-freq 1 (all that "
                                    "runs) it changes nothing, as in Megatron-Core",
    "per_split_data_args_path": "its JSON becomes --train/--valid/--test-data-path",
    "recompute_modules": "core_attn is what selective recompute does; other modules refused",
    "no_weight_decay_cond_type": "apply_wd_to_qk_layernorm sets --apply-wd-to-qk-layernorm",
    "num_virtual_stages_per_pipeline_rank": "sets --num-layers-per-virtual-pipeline-stage",
    "use_megatron_fsdp": "with --data-parallel-sharding-strategy sets --use-torch-fsdp2, "
                         "--torch-fsdp2-no-reshard-after-forward and --use-distributed-optimizer",
    "data_parallel_sharding_strategy": "picks the layout --use-megatron-fsdp sets",
    "outer_dp_sharding_strategy": "no_shard goes on; optim is refused",
    "megatron_fsdp_main_params_dtype": "fp32 goes on; the others are refused",
    "megatron_fsdp_main_grads_dtype": "fp32 and auto go on; the others are refused",
    "megatron_fsdp_grad_comm_dtype": "becomes FSDP2's reduce_dtype (the DDP config's "
                                     "torch_fsdp2_reduce_dtype); fp16 is refused",
}

MINIMAL = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
           "--max-position-embeddings 8 --micro-batch-size 1").split()


def _actions():
    """dest -> its first action (the one whose default argparse gives the dest)."""
    parser = build_parser(pretrain_bert.extra_args_provider)
    out = {}
    for a in parser._actions:
        if a.dest not in PARSER_ONLY:
            out.setdefault(a.dest, a)
    return out


def _sources():
    """Source text where a flag's value may be read."""
    files = [f for d in ("megatron", "tools", "tasks") for f in (ROOT / d).rglob("*.py")]
    files += sorted(ROOT.glob("pretrain_*.py"))
    return {f.relative_to(ROOT).as_posix(): f.read_text() for f in files}


_ATTRIBUTE = re.compile(r"\.(\w+)")


def _args_name(node) -> Optional[str]:
    """``<name>`` when ``node`` loads ``args.<name>`` or calls ``getattr(args, "<name>", ...)``."""
    if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name) and node.value.id == "args"):
        return node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[1].value
    return None


def _loads(node):
    """The ``args`` names loaded under ``node``, leaving out values only formatted into an
    f-string (a message that shows a flag does not use it)."""
    if isinstance(node, ast.JoinedStr):
        return set()
    name = _args_name(node)
    found = {name} if name else set()
    for child in ast.iter_child_nodes(node):
        found |= _loads(child)
    return found


def _names_read(texts):
    """file -> the names whose value is used as ``args.<name>`` / ``getattr(args, "<name>")``."""
    return {f: _loads(ast.parse(t)) for f, t in texts.items()}


def _read_in(dest, reads):
    return sorted(f for f, names in reads.items() if dest in names)


def _config_fields_of(dest, text):
    """Config fields that configs.py computes from ``args.<dest>``: keyword arguments whose
    value uses it, directly or through local variables computed from it."""
    fields = []
    for func in ast.walk(ast.parse(text)):
        if not isinstance(func, ast.FunctionDef):
            continue
        tainted = set()
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and _uses(node.value, dest, tainted):
                tainted |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        fields += [kw.arg for node in ast.walk(func) if isinstance(node, ast.Call)
                   for kw in node.keywords if kw.arg and _uses(kw.value, dest, tainted)]
    return fields


def _uses(node, dest, tainted):
    return dest in _loads(node) or any(isinstance(n, ast.Name) and n.id in tainted
                                       for n in ast.walk(node))


def _attributes_read_by_model(texts):
    """Attribute names used outside the argument and config definitions."""
    return {name for f, t in texts.items()
            if f not in ARGUMENTS_FILES + ("megatron/core/config.py",)
            for name in _ATTRIBUTE.findall(t)}


def _single_choice(action):
    return action.choices is not None and list(action.choices) == [action.default]


@functools.lru_cache(maxsize=1)
def classify():
    """dest -> 'implemented' | 'no-effect' | 'unsupported' | 'pending' | None (none of them)."""
    texts = _sources()
    reads, model_attributes = _names_read(texts), _attributes_read_by_model(texts)
    out = {}
    for dest, action in _actions().items():
        if dest in NO_EFFECT_FLAGS:
            out[dest] = "no-effect"
        elif dest in UNSUPPORTED_FLAGS or _single_choice(action):
            out[dest] = "unsupported"
        else:
            where = _read_in(dest, reads)
            if where and set(where) <= set(ARGUMENTS_FILES):
                fields = _config_fields_of(dest, texts["megatron/training/configs.py"])
                if not set(fields) & model_attributes and dest not in DERIVED_IN_VALIDATION:
                    where = []
            out[dest] = "implemented" if where else None
    return out


def test_every_flag_is_implemented_no_effect_or_refused():
    kinds = classify()
    orphans = sorted("--" + d.replace("_", "-") for d, k in kinds.items() if k is None)
    assert not orphans, ("flags parsed and read nowhere (implement them, or list them in "
                         f"NO_EFFECT_FLAGS / UNSUPPORTED_FLAGS): {orphans}")


def test_reads_are_uses_not_name_matches():
    source = ('"""args.a in a docstring"""\n# args.b in a comment\nargs.c = 1\n'
              'print(f"shown only: {args.d}")\nx = args.e\ny = getattr(args, "f", None)\n'
              'other.args.g\n')
    assert _loads(ast.parse(source)) == {"e", "f"}


def test_derived_in_validation_are_read_there():
    validation = (ROOT / "megatron" / "training" / "validation.py").read_text()
    assert set(DERIVED_IN_VALIDATION) <= _loads(ast.parse(validation))


def test_registries_name_real_flags_and_do_not_overlap():
    dests = set(_actions())
    assert set(NO_EFFECT_FLAGS) <= dests, set(NO_EFFECT_FLAGS) - dests
    assert set(UNSUPPORTED_FLAGS) <= dests, set(UNSUPPORTED_FLAGS) - dests
    assert not set(NO_EFFECT_FLAGS) & set(UNSUPPORTED_FLAGS)


def _defines_own_flag(text, dest):
    """A tool with its own parser may have a flag of the same name (tools/preprocess_data.py
    has its own --dataset-impl); its reads are of that flag."""
    return re.search(r"add_argument\(\s*['\"]--%s['\"]" % re.escape(dest.replace("_", "-")),
                     text) is not None


def test_registered_flags_are_not_read_outside_arguments():
    """A flag declared no-effect or unsupported must not be acted on somewhere after all."""
    texts = _sources()
    reads = _names_read(texts)
    for dest in list(NO_EFFECT_FLAGS) + list(UNSUPPORTED_FLAGS):
        where = [f for f in _read_in(dest, reads) if f not in ARGUMENTS_FILES
                 and not _defines_own_flag(texts[f], dest)]
        assert not where, f"{dest} is registered as not implemented but read in {where}"


@pytest.mark.parametrize("dest", sorted(NO_EFFECT_FLAGS))
def test_no_effect_flag_says_so_and_runs(dest, capsys):
    action = _actions()[dest]
    assert "no effect here" in action.help
    flag = action.option_strings[0]
    args = validate_args(parse_args(argv=MINIMAL + _set_flag(action)))
    assert not dist.is_initialized()
    notes = [line for line in capsys.readouterr().out.splitlines() if flag in line]
    assert len(notes) == 1 and "no effect here" in notes[0], notes
    assert args.num_layers == 2


def _set_flag(action):
    """Command-line words that set ``action`` to something other than its default."""
    flag = action.option_strings[0]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [flag]
    if isinstance(action, argparse.BooleanOptionalAction):
        return [action.option_strings[1] if action.default else flag]
    if action.choices:
        value = next(c for c in action.choices if c != action.default)
        return [flag, getattr(value, "name", str(value))]
    if action.type is bool:
        return [flag, "1"]
    if action.type is int:
        return [flag, str((action.default or 0) + 1)]
    if action.type is float:
        return [flag, str((action.default or 0.0) + 0.5)]
    if action.type not in (None, str):   # Megatron's parsing types: a layer pattern, a window
        return [flag, "2"]
    return [flag] + (["x"] if action.nargs in (None, "?") else ["x", "y"])


@pytest.mark.parametrize("dest", sorted(UNSUPPORTED_FLAGS))
def test_unsupported_flag_stops_with_one_line(dest):
    action = _actions()[dest]
    flag = action.option_strings[0]
    assert "not supported here" in action.help
    with pytest.raises(ArgumentsError) as err:
        validate_args(parse_args(argv=MINIMAL + _set_flag(action)))
    message = str(err.value)
    assert "\n" not in message and message.startswith(flag + " ")
    assert "not supported" in message and ("use" in message or "drop" in message), message
    assert not dist.is_initialized()


def test_unsupported_flags_at_their_defaults_are_no_obstacle():
    args = validate_args(parse_args(argv=MINIMAL))
    assert args.num_layers == 2


def test_single_choice_flags_refuse_anything_else():
    for dest, action in _actions().items():
        if _single_choice(action):
            with pytest.raises(SystemExit):
                build_parser().parse_args(MINIMAL + [action.option_strings[0], "other"])


def test_transformer_impl():
    """local and transformer_engine (Megatron's default) run the same layers here."""
    assert validate_args(parse_args(argv=MINIMAL + ["--transformer-impl", "local"]))
    assert validate_args(parse_args(argv=MINIMAL + ["--transformer-impl", "transformer_engine"]))
    with pytest.raises(ArgumentsError, match="--transformer-impl inference_optimized is not "
                                             "supported"):
        validate_args(parse_args(argv=MINIMAL + ["--transformer-impl", "inference_optimized"]))


def test_entry_point_stops_on_an_unsupported_flag_in_one_line(tmp_path):
    """pretrain_gpt.py: one ``error:`` line on stderr and exit status 2, before any process
    group or dataset (no data given, no --device: it never gets that far)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *MINIMAL, "--train-iters", "1",
         "--use-ring-exchange-p2p"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "--use-ring-exchange-p2p True is not supported" in errors[0]


def test_the_flags_named_by_the_issue_are_classified():
    kinds = classify()
    named = """decoder_num_layers decoder_seq_length standalone_embedding_stage
    pipeline_model_parallel_split_rank distribute_saved_activations overlap_p2p_communication
    use_ring_exchange_p2p delay_grad_reduce delay_param_gather manual_gc manual_gc_interval
    empty_unused_memory_level num_dataset_builder_threads pretrained_checkpoint
    no_persist_layer_norm onnx_safe sample_rate mmap_warmup deprecated_use_mcore_models use_legacy_models
    use_cpu_initialization lazy_mpu_init DDP_impl log_params_norm log_throughput
    log_timers_to_tensorboard log_memory_to_tensorboard transformer_impl profile
    profile_step_start profile_step_end profile_ranks use_pytorch_profiler data_args_path
    per_split_data_args_path""".split()
    assert {d: kinds.get(d) for d in named if kinds.get(d) in (None, "pending")} == {}
    assert arguments.NO_EFFECT_FLAGS is NO_EFFECT_FLAGS
