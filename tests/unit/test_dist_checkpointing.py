"""megatron.checkpoint.dist: Megatron-Core's torch_dist keys, the safe reader, the writer.

References: the folders Megatron-Core wrote (tests/data/megatron_written, README there) and the
legacy file of the same weights; whole tensors built here and split by the converter's legacy
TP rules (:mod:`megatron.convert.megatron_layout`), which the legacy format is already tested
against. Every comparison is exact: reading and writing only move bytes.
"""

import os
import io
import pickle

import pytest
import torch

from megatron.convert.megatron_layout import split_tensor, tp_split_rule
from megatron.checkpoint.dist import (ChunkLayout, DistCheckpointError, DistCheckpointReader,
                                         DistCheckpointWriteError, KeyMappingError,
                                         ObjectShard, chunk_layout, SafeFileSystemReader, SafeLoadPlanner,
                                         ShardWriter, TensorShard, common_objects,
                                         extra_state_objects, flat_boxes, load_model_state,
                                         model_shards, placements, range_shards,
                                         read_local_rows, save_shards, write_metadata)
from megatron.model.module import flatten_state_dict
from megatron.checkpoint.safe_unpickle import UnsafeCheckpointError, torch_load
from tests.multiprocess import run_on_ranks

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "megatron_written")
MCORE = os.path.join(DATA, "mcore_dist_tp1", "iter_0000010")
MCORE_TRAINED = os.path.join(DATA, "mcore_dist_tp1_trained", "iter_0000003")
LEGACY = os.path.join(DATA, "legacy_tp1", "iter_0000010", "mp_rank_00", "model_optim_rng.pt")
# Byte entries of Megatron's files that hold run state a model-only save does not have.
RUN_STATE_ENTRIES = {"rng_state/shard_0.0_1.1", "rerun_state_machine_state/shard_0_1"}


def _legacy_model():
    return torch_load(LEGACY)["model"]


# -- keys -------------------------------------------------------------------------------------

def test_placements_follow_the_tensor_parallel_split():
    rank1 = ChunkLayout(num_layers=4, layer_offset=2, tp_rank=1, tp_size=2)
    qkv, = placements("language_model.encoder.layers.1.self_attention.query_key_value.weight",
                      (96, 64), rank1)
    assert (qkv.key, qkv.global_shape, qkv.global_offset) == (
        "decoder.layers.self_attention.linear_qkv.weight", (4, 192, 64), (3, 96, 0))
    proj, = placements("language_model.encoder.layers.0.self_attention.dense.weight",
                       (64, 32), rank1)
    assert (proj.global_shape, proj.global_offset, proj.written) == ((4, 64, 64), (2, 0, 32),
                                                                     True)
    norm, = placements("language_model.encoder.layers.0.input_layernorm.weight", (64,), rank1)
    assert norm.key == "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert not norm.written  # replicated: TP rank 0 writes it
    word, = placements("language_model.embedding.word_embeddings.weight", (128, 64), rank1)
    assert (word.global_shape, word.global_offset) == ((256, 64), (128, 0))
    sinks, = placements("language_model.encoder.layers.1.self_attention.core_attention."
                        "softmax_offset", (8,), rank1)      # split over TP by heads
    assert (sinks.key, sinks.global_shape, sinks.global_offset, sinks.written) == (
        "decoder.layers.self_attention.core_attention.softmax_offset", (4, 16), (3, 8), True)
    head, = placements("word_embeddings_for_head.weight", (128, 64), rank1)
    assert head.key == "embedding.word_embeddings.weight" and not head.written


def test_swiglu_fc1_is_gate_then_value_globally():
    layout = ChunkLayout(num_layers=2, tp_rank=1, tp_size=2, swiglu=True)
    pieces = placements("language_model.encoder.layers.0.mlp.dense_h_to_4h.weight", (8, 4),
                        layout)
    # rank 1 of 2 holds [gate_1; value_1], 4 rows each of ffn 8: rows 4.. and 8 + 4.. globally
    assert [(p.global_offset, p.local_rows) for p in pieces] == [((0, 4, 0), (0, 4)),
                                                                  ((0, 12, 0), (4, 8))]
    assert pieces[0].global_shape == (2, 16, 4)


def test_unknown_names_and_layers_outside_the_model_are_refused():
    with pytest.raises(KeyMappingError, match="lm_head"):
        placements("lm_head.dense.weight", (4, 4), ChunkLayout(num_layers=1))
    with pytest.raises(KeyMappingError, match="global layer 4 is outside"):
        placements("language_model.encoder.layers.2.input_layernorm.weight", (4,),
                   ChunkLayout(num_layers=4, layer_offset=2))


# -- reading what Megatron-Core wrote ---------------------------------------------------------

def test_reader_lists_and_slices_the_megatron_file():
    reader = DistCheckpointReader(MCORE)
    summary = reader.summary()
    assert summary["decoder.layers.self_attention.linear_qkv.weight"] == ((4, 192, 64),
                                                                          torch.float32)
    assert "output_layer.weight" not in summary  # tied
    whole = reader.read("decoder.layers.mlp.linear_fc1.weight")
    part = reader.read("decoder.layers.mlp.linear_fc1.weight", (1, 100, 8), (2, 56, 40))
    assert torch.equal(part, whole[1:3, 100:156, 8:48])
    common = reader.common_state()
    assert common["iteration"] == 10 and common["checkpoint_version"] == 3.0
    assert common["args"].num_layers == 4
    with pytest.raises(DistCheckpointError, match="outside"):
        reader.read("decoder.final_layernorm.weight", (60,), (8,))


def test_megatron_file_loads_into_the_legacy_model_state_bit_for_bit():
    legacy = _legacy_model()
    state = load_model_state(DistCheckpointReader(MCORE), legacy, ChunkLayout(num_layers=4))
    want, got = flatten_state_dict(legacy), flatten_state_dict(state)
    assert sorted(want) == sorted(got)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_trained_file_holds_adam_moments_and_param_groups():
    reader = DistCheckpointReader(MCORE_TRAINED)
    moments = [k for k in reader.tensor_keys() if k.startswith("optimizer.state.")]
    assert len(moments) == 2 * 16  # exp_avg and exp_avg_sq of every model tensor
    assert reader.shape("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight") == (
        4, 256, 64)
    optimizer = reader.common_state()["optimizer"]
    assert [g["wd_mult"] for g in optimizer["param_groups"]] == [1.0, 0.0]
    assert float(optimizer["state"]["common_step"]) == 3.0


# -- writing ----------------------------------------------------------------------------------

def _write_legacy_as_dist(path):
    layout = ChunkLayout(num_layers=4)
    items = (model_shards(_legacy_model(), layout) + extra_state_objects(layout, 4)
             + common_objects({"iteration": 10}))
    save_shards(path, items)
    return DistCheckpointReader(path)


def test_written_checkpoint_matches_megatrons_keys_shapes_dtypes_and_chunks(tmp_path):
    ours, theirs = _write_legacy_as_dist(str(tmp_path / "iter")), DistCheckpointReader(MCORE)
    assert ours.summary() == theirs.summary()
    assert set(ours.byte_keys()) == set(theirs.byte_keys()) - RUN_STATE_ENTRIES
    for key in theirs.tensor_keys():
        assert ours.chunks(key) == theirs.chunks(key), key
        assert torch.equal(ours.read(key), theirs.read(key)), key
    assert ours.read_single_object("decoder.layers.mlp.linear_fc2._extra_state/shard_3_4") is None
    assert ours.backend == theirs.backend


# With no process group DCP warns that it loads in a single process, as intended here.
NO_PROCESS_GROUP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@NO_PROCESS_GROUP
def test_torch_dcp_load_reads_the_written_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "iter")
    reader = _write_legacy_as_dist(path)
    state = {k: torch.zeros(reader.shape(k), dtype=reader.dtype(k)) for k in reader.tensor_keys()}
    state["common_state/shard_0_1"] = None
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
             no_dist=True)
    assert state["common_state/shard_0_1"] == [{"iteration": 10}]
    assert all(torch.equal(state[k], reader.read(k)) for k in reader.tensor_keys())


def test_metadata_refuses_overlaps_and_gaps(tmp_path):
    with ShardWriter(str(tmp_path), 0) as w:
        w.add_tensor("t", torch.ones(2, 4), (4, 4), (0, 0))
        w.add_tensor("t", torch.ones(2, 4), (4, 4), (1, 0))
    with pytest.raises(DistCheckpointWriteError, match="overlap or leave gaps"):
        write_metadata(str(tmp_path), w.records)
    with pytest.raises(DistCheckpointWriteError, match="does not fit"):
        ShardWriter(str(tmp_path), 1).add_tensor("u", torch.ones(3, 4), (4, 4), (2, 0))
    assert not os.path.exists(tmp_path / ".metadata")


def _modern_whole(num_layers=4, h=16, heads=4, groups=2, ffn=24, vocab=64):
    """Whole tensors of a SwiGLU, GQA, RMSNorm, no-bias, untied, rope model (legacy names)."""
    hn = h // heads
    gen = torch.Generator().manual_seed(7)
    shapes = {"input_layernorm.weight": (h,),
              "self_attention.query_key_value.weight": ((heads + 2 * groups) * hn, h),
              "self_attention.dense.weight": (h, h), "post_attention_layernorm.weight": (h,),
              "mlp.dense_h_to_4h.weight": (2 * ffn, h), "mlp.dense_4h_to_h.weight": (h, ffn)}
    whole = {f"layers.{i}.{n}": torch.randn(s, generator=gen)
             for i in range(num_layers) for n, s in shapes.items()}
    whole["word"] = torch.randn(vocab, h, generator=gen)
    whole["output"] = torch.randn(vocab, h, generator=gen)
    whole["final"] = torch.randn(h, generator=gen)
    return whole


def _local_state(whole, tp_rank, tp, pp_rank, pp, num_layers=4):
    """One rank's legacy model state (local layer numbers, legacy TP split)."""
    per_stage = num_layers // pp
    encoder = {}
    for local in range(per_stage):
        for key, tensor in whole.items():
            prefix = f"layers.{pp_rank * per_stage + local}."
            if key.startswith(prefix):
                name = key[len(prefix):]
                rule = tp_split_rule(name, swiglu=True)
                shard = tensor if rule is None else split_tensor(tensor, *rule, tp)[tp_rank]
                encoder[f"layers.{local}.{name}"] = shard.clone()
    state = {"language_model": {"encoder": encoder}}
    vocab_shard = split_tensor(whole["word"], 0, 1, tp)[tp_rank].clone()
    if pp_rank == 0:
        state["language_model"]["embedding"] = {"word_embeddings": {"weight": vocab_shard}}
    if pp_rank == pp - 1:
        encoder["final_layernorm.weight"] = whole["final"].clone()
        state["language_model"]["output_layer"] = {
            "weight": split_tensor(whole["output"], 0, 1, tp)[tp_rank].clone()}
    return state


def _layout(tp_rank, tp, pp_rank, pp, dp_rank=0, num_layers=4):
    return ChunkLayout(num_layers=num_layers, layer_offset=pp_rank * num_layers // pp,
                       tp_rank=tp_rank, tp_size=tp, dp_rank=dp_rank, swiglu=True)


def _check_reshard(reader, whole, tp, pp):
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            want = _local_state(whole, tp_rank, tp, pp_rank, pp)
            got = load_model_state(reader, want, _layout(tp_rank, tp, pp_rank, pp))
            want, got = flatten_state_dict(want), flatten_state_dict(got)
            assert [k for k in want if not torch.equal(want[k], got[k])] == [], (tp, pp)


def test_modern_model_saved_at_tp2_pp2_loads_at_other_layouts(tmp_path):
    whole = _modern_whole()
    writers = []
    for pp_rank in range(2):
        for tp_rank in range(2):
            writer = ShardWriter(str(tmp_path), pp_rank * 2 + tp_rank)
            writer.add(model_shards(_local_state(whole, tp_rank, 2, pp_rank, 2),
                                    _layout(tp_rank, 2, pp_rank, 2)))
            writers.append(writer.close())
    write_metadata(str(tmp_path), [r for rs in writers for r in rs])
    reader = DistCheckpointReader(str(tmp_path))
    # Megatron-Core's global layout: fc1 is [gate; value] whole, stacked by global layer
    fc1 = reader.read("decoder.layers.mlp.linear_fc1.weight")
    assert torch.equal(fc1[3], whole["layers.3.mlp.dense_h_to_4h.weight"])
    assert "decoder.layers.self_attention.linear_qkv.bias" not in reader
    assert "embedding.position_embeddings.weight" not in reader
    for tp, pp in [(1, 1), (2, 2), (4, 1), (1, 4)]:
        _check_reshard(reader, whole, tp, pp)


def test_data_parallel_copies_and_tp_replicas_are_not_written():
    state = _local_state(_modern_whole(), 1, 2, 0, 1)
    assert model_shards(state, _layout(0, 2, 0, 1, dp_rank=1)) == []
    written = {s.key for s in model_shards(state, _layout(1, 2, 0, 1))}
    assert "decoder.final_layernorm.weight" not in written  # TP rank 0 writes the norms
    assert "decoder.layers.mlp.linear_fc2.weight" in written


def test_flat_boxes_hold_exactly_the_flat_range():
    """Against a naive mark of every element of the range."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 2)]:
        numel = int(torch.Size(shape).numel())
        for _ in range(40):
            start, end = sorted(torch.randint(0, numel + 1, (2,), generator=gen).tolist())
            marks = torch.zeros(shape, dtype=torch.int64)
            flat_at = start
            for offset, size in flat_boxes(shape, start, end):
                box = tuple(slice(o, o + z) for o, z in zip(offset, size))
                marks[box] += 1
                # each box is the next contiguous run of the flattening
                index = torch.arange(numel).reshape(shape)[box].reshape(-1)
                assert torch.equal(index, torch.arange(flat_at, flat_at + index.numel()))
                flat_at += index.numel()
            want = torch.zeros(numel, dtype=torch.int64)
            want[start:end] = 1
            assert torch.equal(marks.reshape(-1), want), (shape, start, end)
            assert flat_at == end
    with pytest.raises(ValueError, match="outside"):
        flat_boxes((2, 3), 4, 7)


def test_distributed_optimizer_ranges_from_every_dp_rank_rebuild_the_tensors(tmp_path):
    """TP=2 x DP=3, each DP rank holding an uneven flat range of every parameter (as the
    distributed optimizer's buckets cut them): the pieces tile Megatron-Core's global tensors,
    equal the whole tensors, and any band of rows reads back at another layout."""
    whole = _modern_whole()
    writers, dp = [], 3
    for tp_rank in range(2):
        state = flatten_state_dict(_local_state(whole, tp_rank, 2, 0, 1))
        for dp_rank in range(dp):
            items = []
            for name, tensor in state.items():
                numel = tensor.numel()
                cuts = [0, numel // 3 + 1, (2 * numel) // 3 + 1, numel]
                start, end = cuts[dp_rank], cuts[dp_rank + 1]
                items += range_shards(name, tuple(tensor.shape), start,
                                      tensor.reshape(-1)[start:end],
                                      _layout(tp_rank, 2, 0, 1, dp_rank=dp_rank),
                                      "optimizer.state.exp_avg.")
            writer = ShardWriter(str(tmp_path), tp_rank * dp + dp_rank)
            writer.add(items)
            writers.append(writer.close())
    write_metadata(str(tmp_path), [r for rs in writers for r in rs])  # checks the tiling
    reader = DistCheckpointReader(str(tmp_path))
    fc1 = reader.read("optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight")
    assert torch.equal(fc1[2], whole["layers.2.mlp.dense_h_to_4h.weight"])
    assert torch.equal(reader.read("optimizer.state.exp_avg.embedding.word_embeddings.weight"),
                       whole["word"])
    files = {c for c in os.listdir(tmp_path) if c.endswith(".distcp")}
    assert len(files) == 6  # every (TP, DP) rank wrote
    for tp, tp_rank in [(1, 0), (4, 3)]:
        state = flatten_state_dict(_local_state(whole, tp_rank, tp, 0, 1))
        for name, tensor in state.items():
            rows = (tensor.shape[0] // 3, tensor.shape[0] - 1)
            got = read_local_rows(reader, name, tuple(tensor.shape), rows,
                                  _layout(tp_rank, tp, 0, 1), "optimizer.state.exp_avg.")
            assert torch.equal(got, tensor[rows[0]:rows[1]]), (tp, name)


def _save_on_ranks(path, whole):
    """TP=2 (a process each): every rank writes its own pieces, rank 0 the metadata."""
    rank = torch.distributed.get_rank()
    items = model_shards(_local_state(whole, rank, 2, 0, 1), _layout(rank, 2, 0, 1))
    if rank == 0:
        items += common_objects({"iteration": 5})
    save_shards(path, items)


def test_every_rank_writes_its_own_shards(tmp_path):
    whole = _modern_whole()
    run_on_ranks(_save_on_ranks, 2, str(tmp_path), whole)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    reader = DistCheckpointReader(str(tmp_path))
    assert reader.common_state() == {"iteration": 5}
    _check_reshard(reader, whole, 1, 1)
    _check_reshard(reader, whole, 2, 2)


# -- hostile files ----------------------------------------------------------------------------

class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: it creates a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _RunsShell:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@NO_PROCESS_GROUP
@pytest.mark.parametrize("payload", [_RunsCode, _RunsShell])
def test_hostile_byte_entry_is_refused_and_never_runs(tmp_path, payload):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    marker = str(tmp_path / "ran")
    path = str(tmp_path / "iter")
    save_shards(path, [ObjectShard("common_state/shard_0_1", payload(marker)),
                       TensorShard("t", torch.ones(2), (2,), (0,))])
    reader = DistCheckpointReader(path)
    with pytest.raises(UnsafeCheckpointError, match=r"(io|builtins)\.open|posix\.system"):
        reader.common_state()
    state = {"common_state/shard_0_1": None, "t": torch.zeros(2)}
    with pytest.raises(CheckpointException) as failed:  # DCP wraps what the planner raised
        dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(),
                 no_dist=True)
    assert "UnsafeCheckpointError" in str(failed.value)
    assert not os.path.exists(marker)


@NO_PROCESS_GROUP
def test_common_state_is_written_twice_and_read_from_either_place(tmp_path):
    """Today's Megatron-Core reads the byte entry, its releases up to 0.16 ``common.pt``."""
    import argparse

    common = {"iteration": 7, "args": argparse.Namespace(num_layers=2), "checkpoint_version": 3.0}
    path = tmp_path / "iter"
    save_shards(str(path), [ObjectShard("common_state/shard_0_1", common),
                            TensorShard("t", torch.ones(2), (2,), (0,))])
    assert torch.load(path / "common.pt", weights_only=False) == common
    assert DistCheckpointReader(str(path)).common_state() == common
    older = tmp_path / "older"  # as such a release writes it: no byte entry
    save_shards(str(older), [TensorShard("t", torch.ones(2), (2,), (0,))])
    assert not (older / "common.pt").exists()
    with pytest.raises(DistCheckpointError, match="no common_state/shard_0_1 and no common.pt"):
        DistCheckpointReader(str(older)).common_state()
    torch.save(common, older / "common.pt")
    assert DistCheckpointReader(str(older)).common_state() == common
    marker = str(tmp_path / "ran")
    torch.save({"args": _RunsShell(marker)}, older / "common.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"common\.pt.*posix\.system"):
        DistCheckpointReader(str(older)).common_state()
    assert not os.path.exists(marker)


def test_hostile_metadata_and_tensor_items_are_refused(tmp_path):
    marker = str(tmp_path / "ran")
    path = str(tmp_path / "iter")
    save_shards(path, [TensorShard("t", torch.ones(2), (2,), (0,))])
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_RunsCode(marker), f)
    with pytest.raises(UnsafeCheckpointError, match=r"(io|builtins)\.open"):
        DistCheckpointReader(path)
    # A tensor item holding an object instead of a tensor.
    path = str(tmp_path / "iter2")
    with ShardWriter(path, 0) as writer:
        writer.add_tensor("t", torch.ones(2), (2,), (0,))
    records = writer.records
    with open(os.path.join(path, "__0_0.distcp"), "r+b") as f:
        buf = io.BytesIO()
        torch.save(_RunsCode(marker), buf)
        f.seek(0)
        f.truncate()
        f.write(buf.getvalue())
    records[0].length = len(buf.getvalue())
    write_metadata(path, records)
    with pytest.raises(DistCheckpointError, match="chunk \\[0\\] of 't' cannot be read"):
        DistCheckpointReader(path).read("t")
    assert not os.path.exists(marker)


def test_metadata_with_megatron_cores_save_plan_reads_without_its_module(tmp_path):
    """Megatron-Core 0.13's planner pickles its plans as ``MCoreSavePlan`` (torch's SavePlan
    plus ``mcore_data``) from a module this project does not have: read as torch's plan; the
    N-D flattened shapes a writer records come back in ``mcore_data``."""
    import dataclasses
    import sys
    import types

    from torch.distributed.checkpoint.planner import SavePlan

    path = str(tmp_path / "iter")
    save_shards(path, [TensorShard("t", torch.ones(1, 4), (2, 4), (0, 0),
                                   nd_orig_global_shape=(2, 2, 2)),
                       TensorShard("t", torch.ones(1, 4), (2, 4), (1, 0),
                                   nd_orig_global_shape=(2, 2, 2)),
                       TensorShard("u", torch.ones(3), (3,), (0,))])
    meta = DistCheckpointReader(path).metadata
    assert meta.mcore_data == {"t": {"nd_reformulated_orig_global_shape": (2, 2, 2)}, "u": {}}
    name = "megatron.core.dist_checkpointing.strategies.torch"

    @dataclasses.dataclass(frozen=True)
    class MCoreSavePlan(SavePlan):
        mcore_data: dict = None

    MCoreSavePlan.__module__, MCoreSavePlan.__qualname__ = name, "MCoreSavePlan"
    module = types.ModuleType(name)
    module.MCoreSavePlan = MCoreSavePlan
    sys.modules[name] = module
    try:
        meta.planner_data = [MCoreSavePlan(items=[], mcore_data={"t": {}})]
        payload = pickle.dumps(meta)
    finally:
        del sys.modules[name]
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(payload)
    (plan,) = DistCheckpointReader(path).metadata.planner_data
    assert type(plan) is SavePlan and plan.mcore_data == {"t": {}}
    with pytest.raises(DistCheckpointWriteError, match="unflattened shape"):
        save_shards(str(tmp_path / "bad"), [
            TensorShard("t", torch.ones(1, 4), (2, 4), (0, 0), nd_orig_global_shape=(2, 4)),
            TensorShard("t", torch.ones(1, 4), (2, 4), (1, 0), nd_orig_global_shape=(4, 2))])


def test_pre_014_optimizer_common_state_nests_and_unnests():
    from megatron.checkpoint.dist.flattened import nest_common, unnest_common

    today = {"state": {"common_step": torch.tensor(5.0)}, "grad_scaler": {"scale": 2.0},
             "param_groups": [{"lr": 0.1, "wd_mult": 1.0}, {"lr": 0.1, "wd_mult": 0.0}]}
    nested = nest_common(today)
    assert nested == {"optimizer": {"param_groups": [{"lr": 0.1, "wd_mult": 1.0, "step": 5.0},
                                                     {"lr": 0.1, "wd_mult": 0.0, "step": 5.0}]},
                      "param_state_sharding_type": "fully_sharded_model_space",
                      "grad_scaler": {"scale": 2.0}}
    back = unnest_common(nested)
    assert float(back.pop("state")["common_step"]) == 5.0
    assert back == {"param_groups": today["param_groups"], "grad_scaler": {"scale": 2.0},
                    "param_state_sharding_type": "fully_sharded_model_space"}
    assert unnest_common(today) is today
    nested["optimizer"]["param_groups"][1]["step"] = 6.0
    with pytest.raises(DistCheckpointError, match="disagree on the step"):
        unnest_common(nested)


# -- the project's own GPT model ---------------------------------------------------------------

def _gpt_chunks(pp, vp, **config):
    """Every model chunk of a 4-layer GPT at PP ``pp`` x VPP ``vp`` (TP 1), with its layout."""
    import types

    from megatron.core.config import TransformerConfig
    from megatron.model.gpt_model import GPTModel

    cfg = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=4,
                            padded_vocab_size=32, max_position_embeddings=8, seq_length=8,
                            hidden_dropout=0.0, attention_dropout=0.0, **config)
    chunks = []
    for pp_rank in range(pp):
        for vp_rank in range(vp or 1):
            pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=pp,
                                           pp_rank=pp_rank, virtual_pp_size=vp,
                                           virtual_pp_rank=vp_rank if vp else None)
            first = pp_rank == 0 and vp_rank == 0
            last = pp_rank == pp - 1 and vp_rank == (vp or 1) - 1
            model = GPTModel(cfg, pstate, pre_process=first, post_process=last)
            chunks.append((model, chunk_layout(cfg, pstate, vp_rank if vp else None)))
    return chunks


@pytest.mark.parametrize("config", [{}, {"untie_embeddings_and_output_weights": True,
                                         "swiglu": True, "normalization": "RMSNorm",
                                         "add_bias_linear": False, "ffn_hidden_size": 24},
                                    {"softmax_type": "learnable", "window_size": (2, 0)},
                                    {"qk_layernorm": True, "normalization": "RMSNorm"}])
def test_gpt_model_saved_whole_loads_into_interleaved_pipeline_chunks(tmp_path, config):
    (whole, layout), = _gpt_chunks(1, None, **config)
    with torch.no_grad():
        for p in whole.parameters():
            p.add_(torch.randn_like(p))  # weights no other split would initialise
    save_shards(str(tmp_path / "a"), model_shards(whole.state_dict_for_save_checkpoint(),
                                                  layout))
    reader = DistCheckpointReader(str(tmp_path / "a"))
    saved = flatten_state_dict(whole.state_dict_for_save_checkpoint())
    if config.get("softmax_type") == "learnable":   # Megatron-Core's key, [layers, heads]
        offsets = reader.read("decoder.layers.self_attention.core_attention.softmax_offset")
        assert torch.equal(offsets[3], saved[
            "language_model.encoder.layers.3.self_attention.core_attention.softmax_offset"])
    if config.get("qk_layernorm"):   # Megatron-Core's keys, [layers, head size], replicated
        for which in "qk":
            norms = reader.read(f"decoder.layers.self_attention.{which}_layernorm.weight")
            assert norms.shape == (4, 4) and torch.equal(norms[2], saved[
                f"language_model.encoder.layers.2.self_attention.{which}_layernorm.weight"])
    chunks = _gpt_chunks(2, 2, **config)
    items = []
    for chunk, layout in chunks:
        chunk.load_state_dict(load_model_state(reader, chunk.state_dict_for_save_checkpoint(),
                                               layout))
        for name, tensor in flatten_state_dict(chunk.state_dict_for_save_checkpoint()).items():
            if name == "word_embeddings_for_head.weight":
                name = "language_model.embedding.word_embeddings.weight"
            if ".layers." in name:
                prefix, rest = name.split(".layers.")
                local, inner = rest.split(".", 1)
                name = f"{prefix}.layers.{layout.layer_offset + int(local)}.{inner}"
            assert torch.equal(tensor, saved[name]), name
        items += model_shards(chunk.state_dict_for_save_checkpoint(), layout)
    save_shards(str(tmp_path / "b"), items)  # and back: the same global tensors
    again = DistCheckpointReader(str(tmp_path / "b"))
    assert again.summary() == reader.summary()
    assert all(torch.equal(again.read(k), reader.read(k)) for k in reader.tensor_keys())
