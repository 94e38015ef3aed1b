"""--yaml-cfg: a YAML file in Megatron's layout parses to the args of its command line, its
section fields are Megatron-Core's config fields, and a bad file stops in one line."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from megatron.training import yaml_arguments
from megatron.training.arguments import parse_args, validate_args
from megatron.training.training import parse_entry_flags
from megatron.training.yaml_arguments import YamlConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Sections with renamed and translated fields, a ${VAR}, a --no- switch and a list flag.
CONFIG = """
language_model:
  num_layers: 4
  hidden_size: 64
  num_attention_heads: 8
  num_query_groups: 2
  ffn_hidden_size: null
  activation_func: swiglu
  gated_linear_unit: true
  normalization: LayerNorm
  layernorm_epsilon: 1.e-5
  layernorm_zero_centered_gamma: true
  add_bias_linear: false
  masked_softmax_fusion: false
  init_method_std: 0.01
  num_moe_experts: 4
  moe_router_topk: 2
  moe_aux_loss_coeff: 1.e-2
  params_dtype: null
model_parallel:
  tensor_model_parallel_size: 1
  pipeline_model_parallel_size: 1
  sequence_parallel: false
  bf16: true
micro_batch_size: 2
global_batch_size: 8
seq_length: 32
max_position_embeddings: 32
position_embedding_type: rope
untie_embeddings_and_output_weights: true
lr: 3.0e-4
min_lr: 3.0e-5
train_iters: ${YAML_TEST_ITERS}
data_path: 0.5 /data/a 0.5 /data/b
tokenizer_type: NullTokenizer
vocab_size: 129
recompute_modules: [core_attn]
"""

FLAGS = """
--num-layers 4 --hidden-size 64 --num-attention-heads 8 --group-query-attention
--num-query-groups 2 --swiglu --normalization LayerNorm --layernorm-epsilon 1e-5
--apply-layernorm-1p --disable-bias-linear --no-masked-softmax-fusion --init-method-std 0.01
--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --bf16
--micro-batch-size 2 --global-batch-size 8 --seq-length 32 --max-position-embeddings 32
--position-embedding-type rope --untie-embeddings-and-output-weights --lr 3e-4 --min-lr 3e-5
--train-iters 7 --data-path 0.5 /data/a 0.5 /data/b --tokenizer-type NullTokenizer
--vocab-size 129 --recompute-modules core_attn
""".split()


@pytest.fixture
def write(tmp_path, monkeypatch):
    monkeypatch.setenv("YAML_TEST_ITERS", "7")

    def write(text, name="cfg.yaml"):
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


def _yaml_args(path, *extra):
    return validate_args(parse_args(argv=["--yaml-cfg", path, *extra]))


def _one_line_error(path, *extra) -> str:
    with pytest.raises(YamlConfigError) as err:
        _yaml_args(path, *extra)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_megatron_layout_gives_the_command_lines_args(write):
    path = write(CONFIG)
    from_yaml = vars(_yaml_args(path))
    from_flags = vars(validate_args(parse_args(argv=FLAGS)))
    assert from_yaml.pop("yaml_cfg") == path
    assert from_flags.pop("yaml_cfg") is None
    assert from_yaml.keys() == from_flags.keys()
    assert {k: v for k, v in from_yaml.items() if from_flags[k] != v} == {}
    assert from_yaml["num_experts"] == 4 and from_yaml["train_iters"] == 7


def test_keys_left_out_take_the_parser_defaults(write):
    small = "\n".join(CONFIG.split("\n")[:5] + ["micro_batch_size: 2", "seq_length: 32",
                                                 "max_position_embeddings: 32"])
    args = _yaml_args(write(small))
    defaults = parse_args(argv=[])
    assert args.lr == defaults.lr and args.seed == defaults.seed == 1234
    assert args.num_layers == 4 and args.micro_batch_size == 2


@pytest.mark.parametrize("text, names", [
    ("language_model:\n  num_layers: 2\n  num_layerz: 2\n", ["language_model.num_layerz"]),
    ("trian_iters: 5\n", ["trian_iters"]),
    ("language_model:\n  bias_swiglu_fusion: true\n", ["bias_swiglu_fusion", "top-level"]),
    ("train_iters: ${YAML_TEST_UNSET}\n", ["train_iters", "YAML_TEST_UNSET", "not set"]),
    ("train_iters: 2.5\n", ["train_iters", "--train-iters", "2.5"]),
    ("train_iters: true\n", ["train_iters", "true"]),
    ("bf16: 3\n", ["bf16", "true or false"]),
    ("language_model:\n  activation_func: relu\n", ["language_model.activation_func", "relu"]),
    ("spec: [my.module, spec]\n", ["spec", "--spec", "module specs"]),
    ("language_model:\n  fp8: hybrid\n", ["language_model.fp8", "--fp8-format", "hybrid"]),
    ("position_embedding_type: mrope\n", ["--position-embedding-type mrope"]),
    ("language_model:\n  activation_func: gelu\nswiglu: true\n",
     ["language_model.activation_func", "swiglu", "disagree"]),
    ("[1, 2]\n", ["expected a mapping"]),
])
def test_a_bad_file_stops_in_one_line_naming_the_file_and_key(write, text, names):
    path = write(text)
    message = _one_line_error(path)
    assert path in message
    for name in names:
        assert name in message


def test_other_command_line_flags_are_refused(write):
    path = write(CONFIG)
    message = _one_line_error(path, "--lr", "1e-3", "--bf16")
    assert path in message and "--lr --bf16" in message


def test_the_entry_point_prints_one_line(write, capsys):
    path = write("language_model:\n  num_moe_expert: 4\n")
    with pytest.raises(SystemExit) as exit_:
        parse_entry_flags(["--yaml-cfg", path], None, None)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and path in err and "language_model.num_moe_expert" in err


def test_a_no_effect_key_notes_as_its_flag_does(write, capsys):
    text = CONFIG.replace("  bf16: true", "  bf16: true\n  use_cpu_initialization: true")
    _yaml_args(write(text))
    assert "NOTE: --use-cpu-initialization has no effect here" in capsys.readouterr().out


def test_pyyaml_is_imported_only_for_yaml_cfg():
    code = ("import sys\nfrom megatron.training.arguments import parse_args, validate_args\n"
            "validate_args(parse_args(argv=['--num-layers', '2', '--hidden-size', '8', "
            "'--num-attention-heads', '2', '--micro-batch-size', '1', '--seq-length', '8', "
            "'--max-position-embeddings', '8']))\nassert 'yaml' not in sys.modules\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_mapped_fields_name_flags_of_this_parser():
    from megatron.training.arguments import build_parser

    dests = {a.dest for a in build_parser()._actions}
    plain = yaml_arguments.TRANSFORMER_FIELDS | yaml_arguments.MODEL_PARALLEL_FIELDS
    assert plain <= dests
    assert set(yaml_arguments.RENAMED.values()) <= dests
    assert not set(yaml_arguments.RENAMED) & dests  # a renamed field is no dest of its own


def _megatron_core_python() -> pathlib.Path:
    """The interop tests' Megatron-Core environment (tests/interop/test_megatron_core.py)."""
    from tests.interop.test_megatron_core import _venv_dir

    return _venv_dir() / "bin" / "python"


FIELDS = """
import dataclasses, json
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import TransformerConfig
print(json.dumps({"model_parallel": [f.name for f in dataclasses.fields(ModelParallelConfig)],
                  "language_model": [f.name for f in dataclasses.fields(TransformerConfig)]}))
"""


def test_section_fields_are_megatron_core_config_fields(tmp_path):
    """Each field a section accepts is a field of Megatron-Core's TransformerConfig (for
    language_model) or ModelParallelConfig (for model_parallel)."""
    python = _megatron_core_python()
    if not python.exists():
        pytest.skip(f"no Megatron-Core environment at {python.parent.parent} (the interop tests "
                    "build it)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(python), "-W", "ignore", "-c", FIELDS], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    fields = json.loads(result.stdout.strip().splitlines()[-1])
    for section in yaml_arguments.SECTIONS:
        unknown = set(yaml_arguments.accepted_fields(section)) - set(fields[section])
        assert not unknown, (section, sorted(unknown))
