"""torch_dist keys of a model whose dense and MoE layers alternate (``--moe-layer-freq``).

Megatron-Core's ``TransformerBlock.sharded_state_dict`` calls a block "non-homogeneous" when
``moe_layer_freq`` is an integer above 1 or any list, and then stores every per-layer tensor
under ``decoder.layers.<g>.<rest>`` (g: global 0-based layer) without the stacked layer axis;
expert tensors keep their expert axis; extra-state objects lose their layer offset
(``shard_0_1`` for a dense module, ``shard_<e>_<E>`` for an expert). The expected keys, shapes
and offsets below are written out by hand from that rule, not computed by the code under test.
"""

import pytest
import torch

from megatron.checkpoint.dist import (ChunkLayout, DistCheckpointError, DistCheckpointReader,
                                         ShardWriter, extra_state_objects, load_model_state,
                                         model_shards, placements, range_shards,
                                         read_local_rows, write_metadata)
from megatron.checkpoint.dist.keys import extra_state_keys, per_layer_keys

L = "language_model.encoder.layers.{}."
H, FFN, EXPERTS = 4, 8, 4


def _layout(**kw):
    base = dict(num_layers=4, per_layer=True, num_experts=EXPERTS)
    base.update(kw)
    return ChunkLayout(**base)


@pytest.mark.parametrize("freq, expected", [(1, False), (None, False), (2, True), (4, True),
                                            ((1, 1, 1, 1), True), ((0, 1, 1, 1), True)])
def test_per_layer_keys_follow_megatron_cores_rule(freq, expected):
    assert per_layer_keys(freq) is expected


def test_dense_layer_tensors_get_the_layer_in_the_key_and_no_layer_axis():
    # Global layer 1 (local 0 of a stage starting at layer 1), TP rank 1 of 2.
    layout = _layout(layer_offset=1, tp_rank=1, tp_size=2)
    qkv, = placements(L.format(0) + "self_attention.query_key_value.weight", (6, H), layout)
    assert (qkv.key, qkv.global_shape, qkv.global_offset, qkv.stacked) == (
        "decoder.layers.1.self_attention.linear_qkv.weight", (12, H), (6, 0), 0)
    proj, = placements(L.format(0) + "self_attention.dense.weight", (H, 2), layout)
    assert (proj.key, proj.global_shape, proj.global_offset) == (
        "decoder.layers.1.self_attention.linear_proj.weight", (H, 4), (0, 2))
    norm, = placements(L.format(2) + "post_attention_layernorm.weight", (H,), layout)
    assert (norm.key, norm.global_shape, norm.global_offset, norm.written) == (
        "decoder.layers.3.mlp.linear_fc1.layer_norm_weight", (H,), (0,), False)
    fc2, = placements(L.format(0) + "mlp.dense_4h_to_h.weight", (H, FFN // 2), layout)
    assert (fc2.key, fc2.global_shape, fc2.global_offset) == (
        "decoder.layers.1.mlp.linear_fc2.weight", (H, FFN), (0, FFN // 2))


def test_swiglu_dense_fc1_is_two_pieces_of_the_per_layer_tensor():
    layout = _layout(layer_offset=2, tp_rank=1, tp_size=2, swiglu=True)
    # local [gate_1; value_1], each FFN/2 rows of a global [gate; value] of 2 FFN rows.
    pieces = placements(L.format(1) + "mlp.dense_h_to_4h.weight", (FFN, H), layout)
    assert [(p.key, p.global_shape, p.global_offset, p.local_rows) for p in pieces] == [
        ("decoder.layers.3.mlp.linear_fc1.weight", (2 * FFN, H), (FFN // 2, 0), (0, FFN // 2)),
        ("decoder.layers.3.mlp.linear_fc1.weight", (2 * FFN, H), (FFN + FFN // 2, 0),
         (FFN // 2, FFN))]


def test_moe_layer_router_and_experts_keep_the_expert_axis_with_ep():
    # EP rank 1 of 2 holds global experts 2, 3; expert TP rank 1 of 2; SwiGLU.
    layout = _layout(layer_offset=2, expert_offset=2, expert_tp_rank=1, expert_tp_size=2,
                     swiglu=True)
    router, = placements(L.format(0) + "mlp.router.weight", (EXPERTS, H), layout)
    assert (router.key, router.global_shape, router.global_offset) == (
        "decoder.layers.2.mlp.router.weight", (EXPERTS, H), (0, 0))
    fc1 = placements(L.format(0) + "mlp.experts.local_experts.1.linear_fc1.weight",
                     (FFN, H), layout)
    assert [(p.key, p.global_shape, p.global_offset, p.stacked) for p in fc1] == [
        ("decoder.layers.2.mlp.experts.experts.linear_fc1.weight", (EXPERTS, 2 * FFN, H),
         (3, FFN // 2, 0), 1),
        ("decoder.layers.2.mlp.experts.experts.linear_fc1.weight", (EXPERTS, 2 * FFN, H),
         (3, FFN + FFN // 2, 0), 1)]
    assert fc1[0].sizes((FFN, H)) == (1, FFN // 2, H)
    fc2, = placements(L.format(0) + "mlp.experts.local_experts.0.linear_fc2.weight",
                      (H, FFN // 2), layout)
    assert (fc2.key, fc2.global_shape, fc2.global_offset) == (
        "decoder.layers.2.mlp.experts.experts.linear_fc2.weight", (EXPERTS, H, FFN),
        (2, 0, FFN // 2))


def test_freq_one_keeps_the_stacked_layout():
    layout = _layout(per_layer=False, layer_offset=2, expert_offset=2)
    router, = placements(L.format(1) + "mlp.router.weight", (EXPERTS, H), layout)
    assert (router.key, router.global_shape, router.global_offset, router.stacked) == (
        "decoder.layers.mlp.router.weight", (4, EXPERTS, H), (3, 0, 0), 1)
    fc1, = placements(L.format(0) + "mlp.experts.local_experts.1.linear_fc1.weight",
                      (FFN, H), layout)
    assert (fc1.key, fc1.global_shape, fc1.global_offset, fc1.stacked) == (
        "decoder.layers.mlp.experts.experts.linear_fc1.weight", (4, EXPERTS, FFN, H),
        (2, 3, 0, 0), 2)
    assert extra_state_keys(1, 4) == [
        "decoder.layers.self_attention.linear_proj._extra_state/shard_1_4",
        "decoder.layers.self_attention.linear_qkv._extra_state/shard_1_4",
        "decoder.layers.mlp.linear_fc1._extra_state/shard_1_4",
        "decoder.layers.mlp.linear_fc2._extra_state/shard_1_4"]


def test_extra_state_entries_of_dense_and_moe_layers():
    assert extra_state_keys(1, 4, per_layer=True) == [
        "decoder.layers.1.self_attention.linear_proj._extra_state/shard_0_1",
        "decoder.layers.1.self_attention.linear_qkv._extra_state/shard_0_1",
        "decoder.layers.1.mlp.linear_fc1._extra_state/shard_0_1",
        "decoder.layers.1.mlp.linear_fc2._extra_state/shard_0_1"]
    assert extra_state_keys(2, 4, range(2, 4), EXPERTS, per_layer=True) == [
        "decoder.layers.2.self_attention.linear_proj._extra_state/shard_0_1",
        "decoder.layers.2.self_attention.linear_qkv._extra_state/shard_0_1",
        "decoder.layers.2.mlp.experts.experts.linear_fc1._extra_state/shard_2_4",
        "decoder.layers.2.mlp.experts.experts.linear_fc2._extra_state/shard_2_4",
        "decoder.layers.2.mlp.experts.experts.linear_fc1._extra_state/shard_3_4",
        "decoder.layers.2.mlp.experts.experts.linear_fc2._extra_state/shard_3_4"]


# ---------------------------------------------------------------------------------------------
# A whole 2-layer model, layer 0 MoE and layer 1 dense (--moe-layer-freq 2), saved by the ranks
# of TP 2 x EP 2 (one pipeline stage), read back whole and at TP 1 x EP 1.
# ---------------------------------------------------------------------------------------------

def _whole() -> dict:
    gen = torch.Generator().manual_seed(5)
    whole = {L.format(0) + "mlp.router.weight": torch.randn(EXPERTS, H, generator=gen)}
    for layer in range(2):
        whole[L.format(layer) + "input_layernorm.weight"] = torch.randn(H, generator=gen)
        whole[L.format(layer) + "self_attention.query_key_value.weight"] = torch.randn(
            3 * H, H, generator=gen)
    for e in range(EXPERTS):
        whole[L.format(0) + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.randn(
            FFN, H, generator=gen)
    whole[L.format(1) + "mlp.dense_h_to_4h.weight"] = torch.randn(FFN, H, generator=gen)
    return whole


def _local(whole: dict, tp_rank: int, tp: int, ep_rank: int, ep: int) -> dict:
    state = {}
    for name, tensor in whole.items():
        if ".local_experts." in name:
            e = int(name.split(".local_experts.")[1].split(".")[0])
            if e // (EXPERTS // ep) != ep_rank:
                continue
            local = name.replace(f".local_experts.{e}.", f".local_experts.{e % (EXPERTS // ep)}.")
            state[local] = tensor.chunk(tp)[tp_rank].clone()  # expert TP = TP
        elif name.endswith(("query_key_value.weight", "dense_h_to_4h.weight")):
            state[name] = tensor.chunk(tp)[tp_rank].clone()
        else:
            state[name] = tensor.clone()
    return state


def _rank_layout(tp_rank, tp, ep_rank, ep, per_layer=True):
    # World = TP x EP: the expert-DP rank is 0 everywhere; the DP rank is the EP rank.
    return ChunkLayout(num_layers=2, tp_rank=tp_rank, tp_size=tp, dp_rank=ep_rank,
                       num_experts=EXPERTS, expert_offset=ep_rank * EXPERTS // ep,
                       expert_dp_rank=0, per_layer=per_layer)


def _save(path, whole) -> DistCheckpointReader:
    records = []
    for rank, (ep_rank, tp_rank) in enumerate([(e, t) for e in range(2) for t in range(2)]):
        local = _local(whole, tp_rank, 2, ep_rank, 2)
        layout = _rank_layout(tp_rank, 2, ep_rank, 2)
        writer = ShardWriter(path, rank)
        writer.add(model_shards(local, layout))
        writer.add(extra_state_objects(layout, 2, list(local)))
        records += writer.close()
    write_metadata(path, records)
    return DistCheckpointReader(path)


def test_file_holds_the_per_layer_keys_and_whole_tensors(tmp_path):
    whole = _whole()
    reader = _save(str(tmp_path), whole)
    expected = {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": [H],
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight": [H],
        "decoder.layers.0.self_attention.linear_qkv.weight": [3 * H, H],
        "decoder.layers.1.self_attention.linear_qkv.weight": [3 * H, H],
        "decoder.layers.0.mlp.router.weight": [EXPERTS, H],
        "decoder.layers.0.mlp.experts.experts.linear_fc1.weight": [EXPERTS, FFN, H],
        "decoder.layers.1.mlp.linear_fc1.weight": [FFN, H]}
    assert {k: list(reader.shape(k)) for k in reader.tensor_keys()} == expected
    torch.testing.assert_close(reader.read("decoder.layers.0.mlp.experts.experts.linear_fc1."
                                           "weight"),
                               torch.stack([whole[L.format(0) + f"mlp.experts.local_experts."
                                                  f"{e}.linear_fc1.weight"]
                                            for e in range(EXPERTS)]), rtol=0, atol=0)
    torch.testing.assert_close(reader.read("decoder.layers.1.mlp.linear_fc1.weight"),
                               whole[L.format(1) + "mlp.dense_h_to_4h.weight"], rtol=0, atol=0)
    assert set(reader.byte_keys()) == {
        "decoder.layers.0.self_attention.linear_proj._extra_state/shard_0_1",
        "decoder.layers.0.self_attention.linear_qkv._extra_state/shard_0_1",
        "decoder.layers.1.self_attention.linear_proj._extra_state/shard_0_1",
        "decoder.layers.1.self_attention.linear_qkv._extra_state/shard_0_1",
        "decoder.layers.1.mlp.linear_fc1._extra_state/shard_0_1",
        "decoder.layers.1.mlp.linear_fc2._extra_state/shard_0_1"} | {
        f"decoder.layers.0.mlp.experts.experts.linear_fc{k}._extra_state/shard_{e}_4"
        for k in (1, 2) for e in range(EXPERTS)}


def test_saved_at_tp2_ep2_loads_whole_in_one_process(tmp_path):
    whole = _whole()
    reader = _save(str(tmp_path), whole)
    loaded = load_model_state(reader, {k: torch.zeros_like(v) for k, v in whole.items()},
                              _rank_layout(0, 1, 0, 1))
    for name, tensor in whole.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


def test_a_layout_mismatch_names_the_key_and_the_flag(tmp_path):
    whole = _whole()
    reader = _save(str(tmp_path), whole)
    template = {k: torch.zeros_like(v) for k, v in whole.items()}
    with pytest.raises(DistCheckpointError, match=r"no 'decoder\.layers\.mlp\.router\.weight'"
                                                  r".*stores its layers under per-layer keys"
                                                  r".*--moe-layer-freq"):
        load_model_state(reader, template, _rank_layout(0, 1, 0, 1, per_layer=False))


def test_a_stacked_file_loaded_with_per_layer_keys_says_so(tmp_path):
    whole = {k: v for k, v in _whole().items() if "norm" in k or "query_key_value" in k}
    writer = ShardWriter(str(tmp_path), 0)
    writer.add(model_shards(whole, _rank_layout(0, 1, 0, 1, per_layer=False)))
    write_metadata(str(tmp_path), writer.close())
    template = {k: torch.zeros_like(v) for k, v in whole.items()}
    with pytest.raises(DistCheckpointError, match=r"no 'decoder\.layers\.0\..*stores its "
                                                  r"layers under stacked keys"):
        load_model_state(DistCheckpointReader(str(tmp_path)), template,
                         _rank_layout(0, 1, 0, 1))


def test_distributed_optimizer_ranges_use_the_per_layer_keys(tmp_path):
    """Two DP ranks each write half of a dense layer's and an expert's flat state; the
    per-layer tensors are rebuilt exactly and read back by rows."""
    layout = _rank_layout(0, 1, 0, 1)
    state = {L.format(1) + "mlp.dense_h_to_4h.weight": torch.arange(FFN * H).float().view(FFN, H)}
    for e in range(EXPERTS):
        state[L.format(0) + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = \
            -torch.arange(FFN * H).float().view(FFN, H) - 100 * e
    records = []
    for dp_rank in range(2):
        writer = ShardWriter(str(tmp_path), dp_rank)
        for name, tensor in state.items():
            half = tensor.numel() // 2
            flat = tensor.reshape(-1)[dp_rank * half:(dp_rank + 1) * half]
            writer.add(range_shards(name, tuple(tensor.shape), dp_rank * half, flat, layout,
                                    "optimizer.state.exp_avg."))
        records += writer.close()
    write_metadata(str(tmp_path), records)
    reader = DistCheckpointReader(str(tmp_path))
    assert sorted(reader.tensor_keys()) == [
        "optimizer.state.exp_avg.decoder.layers.0.mlp.experts.experts.linear_fc1.weight",
        "optimizer.state.exp_avg.decoder.layers.1.mlp.linear_fc1.weight"]
    assert list(reader.shape("optimizer.state.exp_avg.decoder.layers.0.mlp.experts.experts."
                             "linear_fc1.weight")) == [EXPERTS, FFN, H]
    for name, tensor in state.items():
        got = read_local_rows(reader, name, tuple(tensor.shape), (1, FFN - 1), layout,
                              "optimizer.state.exp_avg.")
        torch.testing.assert_close(got, tensor[1:FFN - 1], rtol=0, atol=0)
