"""Every flag of the parser (megatron/training/arguments.py, and pretrain_bert.py's extra
arguments) is one of three things, and this test fails on any flag that is none of them:

(a) implemented: its value is read outside the parser, in megatron/, tools/, tasks/ or an entry
    point (``args.<dest>`` or ``getattr(args, "<dest>")``); a flag read only by
    ``build_configs`` counts only when the config field it fills is read by the model code;
(b) declared no-effect: listed in ``flag_registry.NO_EFFECT_FLAGS``, its --help says it has no
    effect here, and a run that sets it goes on (with one note);
(c) unsupported: listed in ``flag_registry.UNSUPPORTED_FLAGS`` (or a choice flag whose only
    choice is its default): set to anything else, ``validate_args`` stops, before any process group
    exists, with one line naming the flag and saying what to use instead.
"""

import argparse
import pathlib
import re
import subprocess
import sys

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
    """Source text where a flag's value may be read; the parser builders themselves removed."""
    files = [f for d in ("megatron", "tools", "tasks") for f in (ROOT / d).rglob("*.py")]
    files += sorted(ROOT.glob("pretrain_*.py"))
    texts = {}
    for f in files:
        text = f.read_text()
        if f == ROOT / "megatron" / "arguments.py":
            text = re.sub(r"\ndef _add_\w+_args\(parser\):.*?(?=\n\S)", "\n", text, flags=re.S)
        texts[f.relative_to(ROOT).as_posix()] = text
    return texts


_READ = re.compile(r"(?<![\w.])args\.(\w+)|getattr\(\s*args\s*,\s*['\"](\w+)['\"]")
_ATTRIBUTE = re.compile(r"\.(\w+)")


def _names_read(texts):
    """file -> the names read as ``args.<name>`` / ``getattr(args, "<name>")`` in it."""
    return {f: {a or b for a, b in _READ.findall(t)} for f, t in texts.items()}


def _read_in(dest, reads):
    return sorted(f for f, names in reads.items() if dest in names)


def _config_fields_of(dest, text):
    """Config fields that ``build_configs`` fills from ``args.<dest>``."""
    body = text[text.index("def build_configs"):]
    return re.findall(r"(\w+)=args\.%s\b" % re.escape(dest), body)


def _attributes_read_by_model(texts):
    """Attribute names used outside the argument and config definitions."""
    return {name for f, t in texts.items()
            if f not in ARGUMENTS_FILES + ("megatron/core/config.py",)
            for name in _ATTRIBUTE.findall(t)}


def _single_choice(action):
    return action.choices is not None and list(action.choices) == [action.default]


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
                if fields and not set(fields) & model_attributes:
                    where = []
            out[dest] = "implemented" if where else None
    return out


def test_every_flag_is_implemented_no_effect_or_refused():
    kinds = classify()
    orphans = sorted("--" + d.replace("_", "-") for d, k in kinds.items() if k is None)
    assert not orphans, ("flags parsed and read nowhere (implement them, or list them in "
                         f"NO_EFFECT_FLAGS / UNSUPPORTED_FLAGS): {orphans}")


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
         "--standalone-embedding-stage"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "--standalone-embedding-stage True is not supported" in errors[0]


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
