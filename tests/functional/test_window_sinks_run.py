"""Sliding windows and learnable softmax offsets end to end: a TP=2 run with Megatron's
``--window-size 3,0 --window-attn-skip-freq 2 --softmax-type learnable`` trains, then saves
its offsets split by heads under ``self_attention.core_attention.softmax_offset``; the
checkpoint converts to TP=1 and back, and through torch_dist (Megatron-Core's key
``decoder.layers.self_attention.core_attention.softmax_offset``), bit for bit with the flags
kept in the saved args, while the Hugging Face export refuses the sinks in one line.
"""

import os

import pytest
import torch

from megatron.convert.hf import save_hf
from megatron.convert.megatron_io import load_megatron
from megatron.convert.schema import ConversionError
from megatron.model.module import flatten_state_dict
from tests.functional.gpt_runs import write_counting_corpus
from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.test_convert_dist import _iter_dir
from tests.functional.test_convert_megatron import (_assert_same_tensors, _convert, _states,
                                                    _train)
from tools.checkpoint.convert import main

FLAGS = ["--window-size", "3,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable",
         "--position-embedding-type", "rope"]
KEY = "language_model.encoder.layers.{}.self_attention.core_attention.softmax_offset"


@pytest.mark.slow
def test_windowed_sink_checkpoint_trains_converts_and_hf_refuses(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "count_document"))
    src, tp1, back = (str(tmp_path / name) for name in ("src", "tp1", "back"))
    _train(corpus, src, 2, 1, extra=FLAGS)
    _convert(src, tp1, 1, 1)
    _convert(tp1, back, 2, 1)
    source, one, again = _states(src), _states(tp1), _states(back)
    ranks = [flatten_state_dict(source[(t, 0)]["model"]) for t in range(2)]
    whole = flatten_state_dict(one[(0, 0)]["model"])
    for layer in range(2):
        key = KEY.format(layer)
        assert ranks[0][key].shape == (2,)              # 4 heads over 2 ranks
        assert torch.equal(whole[key], torch.cat([ranks[0][key], ranks[1][key]]))
    for rank in source:
        _assert_same_tensors(flatten_state_dict(again[rank]["model"]),
                             flatten_state_dict(source[rank]["model"]))
    args = one[(0, 0)]["args"]
    assert (args.window_size, args.window_attn_skip_freq, args.softmax_type) == (
        (3, 0), 2, "learnable")
    # through Megatron-Core's torch_dist format (the offsets under its key) and back
    dist, again_tp2 = str(tmp_path / "dist"), str(tmp_path / "again_tp2")
    for load, save, flags in ((tp1, dist, ["--target-ckpt-format", "torch_dist"]),
                              (dist, again_tp2, ["--target-tensor-parallel-size", "2"])):
        assert main(["--model-type", "GPT", "--load-dir", load, "--save-dir", save] + flags) == 0
    reader = DistCheckpointReader(_iter_dir(dist))
    offsets = reader.read("decoder.layers.self_attention.core_attention.softmax_offset")
    assert torch.equal(offsets, torch.stack([whole[KEY.format(i)] for i in range(2)]))
    for rank, state in _states(again_tp2).items():
        _assert_same_tensors(flatten_state_dict(state["model"]),
                             flatten_state_dict(source[rank]["model"]))
    with pytest.raises(ConversionError, match="^--softmax-type learnable: no Hugging Face") as err:
        save_hf(load_megatron(src), str(tmp_path / "hf"), allow_no_tokenizer=True)
    assert "\n" not in str(err.value) and not os.path.exists(tmp_path / "hf")

    # --use-checkpoint-args takes the flags that give the weights their meaning.
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args
    args = parse_args(argv=["--load", src, "--use-checkpoint-args"])
    checkpointing.load_args_from_checkpoint(args)
    assert (args.window_size, args.window_attn_skip_freq, args.softmax_type) == (
        (3, 0), 2, "learnable")
