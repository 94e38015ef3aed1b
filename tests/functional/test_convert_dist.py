"""``tools/checkpoint/convert.py`` with Megatron-Core's torch_dist format on either side.

References, independent of the converter: the legacy file Megatron-LM wrote with the same
weights as its torch_dist file (tests/data/megatron_written, README there), read with
:func:`megatron.checkpoint.safe_unpickle.torch_load` and split here by the legacy TP rules;
Megatron-Core's own torch_dist file for keys, shapes, dtypes and byte-entry names. A torch_dist checkpoint
stores whole (global) tensors, so whatever layout it is written at, every tensor must equal
the fixture's bit for bit.
"""

import os

import pytest
import torch

from megatron.training import checkpointing
from megatron.convert.dist_io import load_dist, save_dist
from megatron.convert.megatron_io import save_megatron
from megatron.convert.megatron_layout import split_tensor, tp_split_rule
from megatron.convert.schema import ModelMeta, Piece
from megatron.checkpoint.dist import (ChunkLayout, DistCheckpointReader, ObjectShard,
                                         TensorShard, load_model_state, save_shards)
from megatron.model.module import flatten_state_dict
from megatron.checkpoint.safe_unpickle import torch_load
from tools.checkpoint.convert import main

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "megatron_written")
MCORE = os.path.join(DATA, "mcore_dist_tp1")
LEGACY = os.path.join(DATA, "legacy_tp1")
RUN_STATE_ENTRIES = {"rng_state/shard_0.0_1.1", "rerun_state_machine_state/shard_0_1"}
_LAYER = "language_model.encoder.layers."


def _convert(src, dst, *flags):
    assert main(["--model-type", "GPT", "--load-dir", src, "--save-dir", dst] + list(flags)) == 0
    return dst


def _iter_dir(root):
    iteration, release = checkpointing.read_tracker(root)
    return os.path.join(root, checkpointing.checkpoint_dir_name(iteration, release))


def _rank_model(root, tp_rank=0, pp_rank=0, pp=1):
    iteration, release = checkpointing.read_tracker(root)
    path = checkpointing.checkpoint_file(root, iteration, tp_rank, pp_rank, pp, release)
    return flatten_state_dict(torch_load(path)["model"])


def _legacy_split(tp_rank, tp, pp_rank=0, pp=1, num_layers=4):
    """legacy_tp1's tensors as target rank (tp_rank, pp_rank) holds them, split here."""
    whole = _rank_model(LEGACY)
    per_stage = num_layers // pp
    out = {}
    for name, tensor in whole.items():
        if name.startswith(_LAYER):
            layer, inner = name[len(_LAYER):].split(".", 1)
            if int(layer) // per_stage != pp_rank:
                continue
            name = f"{_LAYER}{int(layer) % per_stage}.{inner}"
            rule = tp_split_rule(inner, swiglu=False)
        elif "embedding" in name:
            if pp_rank != 0:
                continue
            rule = (0, 1) if "word_embeddings" in name else None
        else:  # final norm
            if pp_rank != pp - 1:
                continue
            rule = None
        out[name] = tensor if rule is None else split_tensor(tensor, *rule, tp)[tp_rank]
    if pp > 1 and pp_rank == pp - 1:
        out["word_embeddings_for_head.weight"] = split_tensor(
            whole["language_model.embedding.word_embeddings.weight"], 0, 1, tp)[tp_rank]
    return out


def _assert_equal(got, want):
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_megatron_torch_dist_converts_to_legacy_bit_for_bit(tmp_path, capsys):
    out = _convert(MCORE, str(tmp_path / "tp1"), "--target-ckpt-format", "torch")
    assert "megatron TP=1 PP=1 (torch_dist)" in capsys.readouterr().out
    _assert_equal(_rank_model(out), _rank_model(LEGACY))
    out = _convert(MCORE, str(tmp_path / "tp2"), "--target-tensor-parallel-size", "2")
    for tp_rank in range(2):
        _assert_equal(_rank_model(out, tp_rank), _legacy_split(tp_rank, 2))


def _assert_like_megatrons(iter_dir):
    ours, theirs = DistCheckpointReader(iter_dir), DistCheckpointReader(_iter_dir(MCORE))
    assert ours.summary() == theirs.summary()
    assert set(ours.byte_keys()) == set(theirs.byte_keys()) - RUN_STATE_ENTRIES
    for key in theirs.tensor_keys():
        assert torch.equal(ours.read(key), theirs.read(key)), key
    return ours


def test_written_torch_dist_has_megatrons_keys_shapes_and_dtypes(tmp_path):
    legacy = _convert(MCORE, str(tmp_path / "legacy"), "--target-ckpt-format", "torch")
    ours = _assert_like_megatrons(_iter_dir(_convert(legacy, str(tmp_path / "dist"),
                                                     "--target-ckpt-format", "torch_dist")))
    common, theirs = ours.common_state(), DistCheckpointReader(_iter_dir(MCORE)).common_state()
    assert set(common) - {"conversion"} <= set(theirs)
    assert (common["iteration"], common["checkpoint_version"]) == (10, 3.0)
    assert common["args"].ckpt_format == "torch_dist"
    assert common["opt_param_scheduler"] == theirs["opt_param_scheduler"]


def test_megatrons_legacy_file_converts_to_torch_dist(tmp_path):
    _assert_like_megatrons(_iter_dir(_convert(LEGACY, str(tmp_path / "dist"),
                                              "--target-ckpt-format", "torch_dist")))


def test_round_trip_at_tp2_pp2_keeps_every_tensor(tmp_path):
    layout = ["--target-tensor-parallel-size", "2", "--target-pipeline-parallel-size", "2"]
    dist22 = _convert(MCORE, str(tmp_path / "dist22"), "--target-ckpt-format", "torch_dist",
                      *layout)
    assert sorted(f for f in os.listdir(_iter_dir(dist22)) if f.endswith(".distcp")) == [
        f"__{r}_0.distcp" for r in range(4)]
    _assert_like_megatrons(_iter_dir(dist22))
    torch22 = _convert(dist22, str(tmp_path / "torch22"), "--target-ckpt-format", "torch")
    for pp_rank in range(2):
        for tp_rank in range(2):
            _assert_equal(_rank_model(torch22, tp_rank, pp_rank, 2),
                          _legacy_split(tp_rank, 2, pp_rank, 2))
    back = _convert(torch22, str(tmp_path / "back"), "--target-ckpt-format", "torch_dist",
                    "--target-tensor-parallel-size", "1", "--target-pipeline-parallel-size", "1")
    _assert_like_megatrons(_iter_dir(back))


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_hostile_common_state_is_refused_by_the_converter(tmp_path, capsys):
    marker = str(tmp_path / "ran")
    root = tmp_path / "ckpt"
    save_shards(str(root / "iter_0000001"),
                [ObjectShard("common_state/shard_0_1", _RunsCode(marker)),
                 TensorShard("embedding.word_embeddings.weight", torch.ones(4, 2), (4, 2),
                             (0, 0))])
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-type", "GPT", "--load-dir", str(root), "--save-dir",
              str(tmp_path / "out")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "common_state/shard_0_1" in err and "refusing to load" in err and ".open" in err
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out")


def _modern_stream(vocab=60, num_layers=4, h=16, heads=4, groups=2, ffn=24):
    """A SwiGLU, GQA, RMSNorm, no-bias, untied, rope model as a canonical stream."""
    meta = ModelMeta(num_layers=num_layers, hidden_size=h, ffn_hidden_size=ffn,
                     num_attention_heads=heads, num_query_groups=groups, kv_channels=h // heads,
                     max_position_embeddings=32, vocab_size=vocab, padded_vocab_size=64,
                     position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                     add_bias_linear=False, untie_embeddings_and_output_weights=True,
                     make_vocab_size_divisible_by=16, iteration=5)
    gen = torch.Generator().manual_seed(3)
    qkv = (heads + 2 * groups) * (h // heads)
    shapes = {"input_layernorm.weight": (h,), "self_attention.query_key_value.weight": (qkv, h),
              "self_attention.dense.weight": (h, h), "post_attention_layernorm.weight": (h,),
              "mlp.dense_h_to_4h.weight": (2 * ffn, h), "mlp.dense_4h_to_h.weight": (h, ffn)}
    pieces = [Piece("meta", meta=meta),
              Piece("embeddings", {"word_embeddings": torch.randn(64, h, generator=gen)})]
    pieces += [Piece("layer", {n: torch.randn(s, generator=gen) for n, s in shapes.items()},
                     index=i) for i in range(num_layers)]
    pieces += [Piece("final_norm", {"weight": torch.randn(h, generator=gen)}),
               Piece("output_layer", {"weight": torch.randn(64, h, generator=gen)})]
    return pieces


def test_modern_model_converts_both_ways_at_tp2_pp2(tmp_path):
    pieces = _modern_stream()
    dist = save_dist(iter(pieces), str(tmp_path / "dist"), 2, 2)
    legacy = save_megatron(iter(_modern_stream()), str(tmp_path / "legacy"), 2, 2)
    assert os.path.basename(dist) == os.path.basename(legacy) == "iter_0000005"
    reader = DistCheckpointReader(dist)
    for pp_rank in range(2):
        for tp_rank in range(2):
            want = _rank_model(str(tmp_path / "legacy"), tp_rank, pp_rank, 2)
            layout = ChunkLayout(num_layers=4, layer_offset=2 * pp_rank, tp_rank=tp_rank,
                                 tp_size=2, swiglu=True)
            _assert_equal(flatten_state_dict(load_model_state(reader, want, layout)), want)
    loaded = list(load_dist(str(tmp_path / "dist"), true_vocab_size=60))
    assert loaded[0].meta.swiglu and loaded[0].meta.num_query_groups == 2
    assert loaded[0].meta.normalization == "RMSNorm" and not loaded[0].meta.add_bias_linear
    assert [(p.kind, p.index) for p in loaded[1:]] == [(p.kind, p.index) for p in pieces[1:]]
    for got, want in zip(loaded[1:], pieces[1:]):
        _assert_equal(got.tensors, want.tensors)
