"""The numerics flags end to end: the example launch script trains (loss falls), and a TP=2
checkpoint with ``--qk-layernorm`` converts to TP=1 and back bit for bit, its q/k norms equal on
both TP ranks after training (their gradients were summed), while the Hugging Face export
refuses it with one line naming the flag.
"""

import os
import re
import subprocess

import pytest
import torch

from megatron.training import checkpointing
from megatron.convert.hf import save_hf
from megatron.convert.megatron_io import load_megatron
from megatron.convert.schema import ConversionError
from megatron.model.module import flatten_state_dict
from tests.functional.gpt_runs import VOCAB_SIZE, write_counting_corpus
from tests.functional.test_convert_megatron import (
    _assert_same_tensors,
    _convert,
    _naive_whole,
    _states,
    _train,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "examples", "pretrain_gpt_megatron_flags.sh")
FLAGS = ["--qk-layernorm", "--apply-layernorm-1p", "--squared-relu", "--init-method-xavier-uniform",
         "--position-embedding-type", "rope", "--rotary-interleaved",
         "--rotary-seq-len-interpolation-factor", "2", "--decoupled-lr", "1e-2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


@pytest.mark.slow
def test_example_script_trains(corpus, tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, TRAIN_ITERS="40", NPROC="2",
               DATA_PREFIX=corpus, VOCAB_SIZE=str(VOCAB_SIZE))
    run = subprocess.run(["bash", SCRIPT, str(tmp_path / "out")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"lm loss: ([0-9.E+-]+)", run.stdout)]
    assert len(losses) == 8, run.stdout[-3000:]
    assert losses[-1] < 0.7 * losses[0], losses
    assert os.path.isfile(tmp_path / "out" / "train.log")


@pytest.mark.slow
def test_qk_layernorm_checkpoint_converts_and_hf_refuses(corpus, tmp_path):
    src, tp1, back = (str(tmp_path / name) for name in ("src", "tp1", "back"))
    _train(corpus, src, 2, 1, extra=FLAGS)
    _convert(src, tp1, 1, 1)
    _convert(tp1, back, 2, 1)
    source, one, again = _states(src), _states(tp1), _states(back)
    key = "language_model.encoder.layers.1.self_attention.q_layernorm.weight"
    ranks = [flatten_state_dict(source[(t, 0)]["model"]) for t in range(2)]
    assert ranks[0][key].shape == (8,)
    # Trained (moved away from the 1p zeros) and still equal on both TP ranks.
    assert ranks[0][key].abs().max() > 0 and torch.equal(ranks[0][key], ranks[1][key])
    whole = flatten_state_dict(one[(0, 0)]["model"])
    _assert_same_tensors(whole, _naive_whole(source, layers_per_stage=2))
    assert {k.split("self_attention.")[-1] for k in whole if "_layernorm" in k
            and "self_attention" in k} == {"q_layernorm.weight", "q_layernorm.bias",
                                           "k_layernorm.weight", "k_layernorm.bias"}
    for rank in source:
        _assert_same_tensors(flatten_state_dict(again[rank]["model"]),
                             flatten_state_dict(source[rank]["model"]))
    assert one[(0, 0)]["args"].qk_layernorm and one[(0, 0)]["args"].apply_layernorm_1p
    one_line = "^--qk-layernorm: .*Megatron checkpoints only$"
    with pytest.raises(ConversionError, match=one_line) as err:
        save_hf(load_megatron(src), str(tmp_path / "hf"), allow_no_tokenizer=True)
    assert "\n" not in str(err.value) and not os.path.exists(tmp_path / "hf")

    # --use-checkpoint-args takes the flags that give the weights their meaning.
    from megatron.training.arguments import parse_args
    args = parse_args(argv=["--load", src, "--use-checkpoint-args"])
    checkpointing.load_args_from_checkpoint(args)
    assert args.qk_layernorm and args.apply_layernorm_1p and args.squared_relu
    assert args.rotary_interleaved and args.rotary_seq_len_interpolation_factor == 2
