"""``--transformer-impl`` and torch_dist checkpoints: both specs' spellings load, a
TransformerEngine-spec run saves what Megatron-Core's TransformerEngine spec writes and resumes.

References: the logits Megatron-Core's own forward gave for its file (``reference.pt`` of
``mcore_dist_tp1``) and the losses of the run that never stopped.
"""

import io
import os
import re
import shutil

import pytest
import torch

from megatron.checkpoint.dist import DistCheckpointReader
from megatron.checkpoint.safe_unpickle import load_dcp_metadata
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load, fixture_dir,
                                                    megatron_argv, reference)
from tests.multiprocess import run_on_ranks

FIXTURE = "mcore_dist_tp1"
ITER = "iter_0000010"
# Fused spelling (Megatron-Core's torch_dist names for both specs' dense layers) -> the
# separate norm modules' own names.
UNFUSED = ((".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
           (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."))


def _unfused(key: str) -> str:
    for fused, plain in UNFUSED:
        key = key.replace(fused, plain)
    return key


class _VerbatimBytes:
    """A byte entry copied as stored (its pickled objects are never rebuilt here)."""

    def __init__(self, data: bytes):
        self.data = data


def _planner():
    from torch.distributed.checkpoint import DefaultSavePlanner

    class Planner(DefaultSavePlanner):
        def transform_object(self, write_item, obj):
            if isinstance(obj, _VerbatimBytes):
                return io.BytesIO(obj.data)
            return super().transform_object(write_item, obj)

    return Planner(flatten_state_dict=False)


def _rewrite_fixture(dest: str) -> str:
    """The fixture rewritten with ``torch.distributed.checkpoint.save``: every layer-norm
    tensor renamed key by key to its unfused module name, every linear module's extra state
    set to TransformerEngine's empty uint8 tensor, the other byte entries copied as stored."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import MetadataIndex

    reader = DistCheckpointReader(os.path.join(fixture_dir(FIXTURE), ITER))
    state = {}
    for key in reader.tensor_keys():
        state[_unfused(key)] = reader.read(key)
    for key in reader.byte_keys():
        if "._extra_state/" in key:
            assert reader.read_object(key) == [None]
            state[key] = [torch.empty(0, dtype=torch.uint8)]
        else:
            state[key] = _VerbatimBytes(reader._item_bytes(MetadataIndex(key), key))
    renamed = [k for k in state if re.search(r"(input|pre_mlp)_layernorm\.", k)]
    assert len(renamed) == 4, renamed   # 2 norms x (weight, bias); the file holds no moments
    root = os.path.join(dest, "unfused")
    iter_dir = os.path.join(root, ITER)
    dcp.save(state, storage_writer=FileSystemWriter(iter_dir), planner=_planner(),
             no_dist=True)
    shutil.copy(os.path.join(fixture_dir(FIXTURE), ITER, "metadata.json"), iter_dir)
    for name in ("latest_checkpointed_iteration.txt", "reference.pt"):
        shutil.copy(os.path.join(fixture_dir(FIXTURE), name), root)
    return root


def _impl(argv, impl):
    argv = list(argv)
    argv[argv.index("--transformer-impl") + 1] = impl
    return argv


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_unfused_norm_names_load_and_give_megatrons_logits(tmp_path, impl):
    load = _rewrite_fixture(str(tmp_path))
    saved = DistCheckpointReader(os.path.join(load, ITER))
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in saved.tensor_keys()
    argv = _impl(megatron_argv(FIXTURE), impl) + ["--load", load, "--device", "cpu"]
    logits, iteration, _ = run_on_ranks(_logits_after_load, 1, argv)[0]
    assert iteration == 10
    torch.testing.assert_close(logits.float(), reference(FIXTURE)["logits"],
                               atol=LOGITS_ATOL, rtol=0)


def test_the_reader_leaves_a_separate_norm_of_a_layer_without_fused_qkv():
    from megatron.checkpoint.dist.keys import fused_norm_aliases

    mla = ["decoder.layers.input_layernorm.weight",
           "decoder.layers.self_attention.linear_q_proj.weight"]
    assert fused_norm_aliases(mla) == {}
    dense = ["optimizer.state.exp_avg.decoder.layers.3.pre_mlp_layernorm.bias",
             "optimizer.state.exp_avg.decoder.layers.3.self_attention.linear_qkv.weight"]
    assert fused_norm_aliases(dense) == {
        "optimizer.state.exp_avg.decoder.layers.3.mlp.linear_fc1.layer_norm_bias": dense[0]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("data") / "counting"))


def _flags(corpus, impl, extra=()):
    return gpt_flags(corpus, 6, dropout=0.0, micro_batch=1, extra=[
        "--num-layers", "2", "--ckpt-format", "torch_dist", "--transformer-impl", impl,
        *extra])


def test_transformer_engine_run_saves_te_state_resumes_exactly_and_swaps_with_local(corpus,
                                                                                  tmp_path):
    save = str(tmp_path / "te")
    full = run_on_ranks(run_pretrain, 1, _flags(corpus, "transformer_engine", [
        "--save", save, "--save-interval", "3"]))[0]
    reader = DistCheckpointReader(os.path.join(save, "iter_0000003"))
    keys = set(reader.tensor_keys())
    assert {"decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.mlp.linear_fc1.layer_norm_bias"} <= keys
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in keys)
    extra = [k for k in reader.byte_keys() if "._extra_state/" in k]
    assert len(extra) == 4 * 2   # four linear modules x two layers
    for key in extra:
        (value,) = reader.read_object(key)
        assert isinstance(value, torch.Tensor) and value.dtype == torch.uint8
        assert value.numel() == 0
    straight = dict(full["losses"])
    for impl in ("transformer_engine", "local"):
        again = run_on_ranks(run_pretrain, 1, _flags(corpus, impl, [
            "--load", save, "--ckpt-step", "3"]))[0]
        assert [i for i, _ in again["losses"]] == [4, 5, 6]
        assert all(loss == straight[i] for i, loss in again["losses"]), (impl, again, straight)


def test_the_converter_reads_unfused_norm_names_bit_for_bit(tmp_path):
    """tools/checkpoint/convert.py on the renamed file gives the legacy file Megatron-LM wrote
    with the same weights (legacy_tp1), as it does on Megatron-Core's own file."""
    from tests.functional.test_convert_dist import LEGACY, _assert_equal, _convert, _rank_model

    load = _rewrite_fixture(str(tmp_path))
    out = _convert(load, str(tmp_path / "legacy"), "--target-ckpt-format", "torch")
    _assert_equal(_rank_model(out), _rank_model(LEGACY))


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--no-bias-gelu-fusion"]


@pytest.mark.parametrize("freq", [None, "2"])
def test_transformer_engine_moe_layers_keep_their_own_pre_mlp_norm(corpus, tmp_path, freq):
    """Megatron-Core's TransformerEngine spec keeps an MoE layer's pre-MLP norm as its own
    module (``pre_mlp_layernorm``); dense layers' stays fused. Stacked keys (every layer MoE)
    and per-layer keys (--moe-layer-freq 2: layers 0 and 2 of 4 MoE); both resume exactly."""
    save = str(tmp_path / "te_moe")
    extra = MOE + ["--num-layers", "4"] + (["--moe-layer-freq", freq] if freq else [])
    full = run_on_ranks(run_pretrain, 1, _flags(corpus, "transformer_engine", extra + [
        "--save", save, "--save-interval", "3"]))[0]
    keys = set(DistCheckpointReader(os.path.join(save, "iter_0000003")).tensor_keys())
    raw = set(load_dcp_metadata(os.path.join(save, "iter_0000003", ".metadata"))
              .state_dict_metadata)     # the names as stored
    if freq is None:
        assert "decoder.layers.pre_mlp_layernorm.weight" in raw
        assert "optimizer.state.exp_avg.decoder.layers.pre_mlp_layernorm.bias" in raw
        assert not any("linear_fc1.layer_norm" in k for k in raw)
    else:
        assert {"decoder.layers.0.pre_mlp_layernorm.weight",
                "decoder.layers.2.pre_mlp_layernorm.bias",
                "decoder.layers.1.mlp.linear_fc1.layer_norm_weight",
                "decoder.layers.3.mlp.linear_fc1.layer_norm_bias"} <= raw
        assert "decoder.layers.1.pre_mlp_layernorm.weight" not in raw
    assert not any("pre_mlp_layernorm" in k for k in keys)   # the reader's fused names
    straight = dict(full["losses"])
    again = run_on_ranks(run_pretrain, 1, _flags(corpus, "local", extra + [
        "--load", save, "--ckpt-step", "3"]))[0]
    assert all(loss == straight[i] for i, loss in again["losses"]), (again, straight)
