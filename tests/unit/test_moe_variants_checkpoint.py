"""torch_dist of the MoE variants: ``--moe-latent-size``'s projections under Megatron-Core's
keys (``decoder.layers.mlp.fc{1,2}_latent_proj.weight``, replicated), the latent-width experts,
and GLU-interleaved fc1 tensors stored whole as they sit in memory (each TP rank a contiguous
run of whole blocks, so a file loads at any split). Every comparison is exact (bytes only
move)."""

import dataclasses
import types

import pytest
import torch

from megatron.checkpoint.dist import (ChunkLayout, DistCheckpointReader, chunk_layout,
                                      extra_state_objects, load_model_state, model_shards,
                                      placements, save_shards)
from megatron.checkpoint.dist.keys import glu_interleaved_names
from megatron.core.config import TransformerConfig
from megatron.model.gpt_model import GPTModel
from megatron.model.module import flatten_state_dict
from megatron.model.moe import MoEConfig

NO_PROCESS_GROUP = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
LAYERS, H, FFN, LATENT, EXPERTS = 2, 16, 8, 12, 4
PSTATE = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                               virtual_pp_size=None, virtual_pp_rank=None)


def _model(seed):
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=4,
                            padded_vocab_size=32, max_position_embeddings=8, seq_length=8,
                            ffn_hidden_size=FFN, swiglu=True, add_bias_linear=False,
                            hidden_dropout=0.0, attention_dropout=0.0)
    moe = MoEConfig(num_moe_experts=EXPERTS, moe_router_topk=2, moe_latent_size=LATENT,
                    moe_mlp_glu_interleave_size=2, moe_shared_expert_intermediate_size=FFN,
                    moe_shared_expert_glu_interleave_size=4)
    model = GPTModel(cfg, PSTATE, moe_config=moe, init_seed=seed)
    layout = dataclasses.replace(chunk_layout(cfg, PSTATE, num_experts=EXPERTS),
                                 glu_interleaved=glu_interleaved_names(moe))
    return model, layout


@NO_PROCESS_GROUP
def test_latent_and_interleaved_moe_round_trip(tmp_path):
    model, layout = _model(1)
    save_shards(str(tmp_path / "a"), model_shards(model.state_dict_for_save_checkpoint(),
                                                  layout))
    reader = DistCheckpointReader(str(tmp_path / "a"))
    saved = flatten_state_dict(model.state_dict_for_save_checkpoint())
    layer = "language_model.encoder.layers.1.mlp."
    down = reader.read("decoder.layers.mlp.fc1_latent_proj.weight")
    up = reader.read("decoder.layers.mlp.fc2_latent_proj.weight")
    assert down.shape == (LAYERS, LATENT, H) and up.shape == (LAYERS, H, LATENT)
    assert torch.equal(down[1], saved[layer + "fc1_latent_proj.weight"])
    fc1 = reader.read("decoder.layers.mlp.experts.experts.linear_fc1.weight")
    assert fc1.shape == (LAYERS, EXPERTS, 2 * FFN, LATENT)
    # stored as it sits in memory: the interleaved rows, not regrouped into halves
    assert torch.equal(fc1[1, 3], saved[layer + "experts.local_experts.3.linear_fc1.weight"])
    shared = reader.read("decoder.layers.mlp.shared_experts.linear_fc1.weight")
    assert torch.equal(shared[0], saved["language_model.encoder.layers.0.mlp."
                                        "shared_experts.linear_fc1.weight"])
    other, layout = _model(2)
    other.load_state_dict(load_model_state(reader, other.state_dict_for_save_checkpoint(),
                                           layout))
    for name, tensor in flatten_state_dict(other.state_dict_for_save_checkpoint()).items():
        assert torch.equal(tensor, saved[name]), name
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8).expand(2, 8)
    assert torch.equal(model(ids, pos, None), other(ids, pos, None))


@pytest.mark.parametrize("interleaved", [True, False])
def test_interleaved_fc1_is_one_contiguous_piece_per_rank(interleaved):
    name = "language_model.encoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    for rank in range(2):
        layout = ChunkLayout(num_layers=1, swiglu=True, num_experts=EXPERTS, tp_rank=rank,
                             tp_size=2, glu_interleaved=("linear_fc1.weight",) if interleaved
                             else ())
        pieces = placements(name, (FFN, H), layout)           # FFN rows: half of 2 FFN
        offsets = [(p.global_offset[2], p.local_rows) for p in pieces]
        if interleaved:
            assert offsets == [(rank * FFN, None)]
        else:   # SwiGLU: gate rows then value rows, each rank's half of each
            half = FFN // 2
            assert offsets == [(rank * half, (0, half)), (FFN + rank * half, (half, FFN))]


def test_latent_projections_have_extra_state_entries():
    """Megatron-Core's projections are TransformerEngine linears: one extra-state entry each
    per layer, beside the shared expert's and the experts'."""
    model, layout = _model(1)
    names = list(flatten_state_dict(model.state_dict_for_save_checkpoint()))
    fqns = {item.fqn for item in extra_state_objects(layout, LAYERS, names)}
    for proj in ("fc1_latent_proj", "fc2_latent_proj"):
        for layer in range(LAYERS):
            assert f"decoder.layers.mlp.{proj}._extra_state/shard_{layer}_{LAYERS}" in fqns
    plain = [n for n in names if "latent_proj" not in n]
    assert not any("latent_proj" in item.fqn
                   for item in extra_state_objects(layout, LAYERS, plain))


# -- Megatron-Core's order of an interleaved fc1 saved at TP > 1 ---------------------------------

def _megatron_order(whole: torch.Tensor, tp: int, axis: int) -> torch.Tensor:
    """What Megatron-Core stores for an interleaved fc1 saved at TP ``tp``, built from its
    definition: rank ``r`` holds rows ``[r * 2h, (r + 1) * 2h)`` of the whole interleaved
    weight, and its sharded state dict cuts them in two halves, all ranks' first halves
    stacked before all their second halves."""
    local = whole.chunk(tp, dim=axis)
    return torch.cat([t.chunk(2, dim=axis)[0] for t in local]
                     + [t.chunk(2, dim=axis)[1] for t in local], dim=axis)


INTERLEAVED_KEYS = {"decoder.layers.mlp.experts.experts.linear_fc1.weight": 2,
                    "decoder.layers.mlp.shared_experts.linear_fc1.weight": 1}


def _saved_args(tp):
    return types.SimpleNamespace(tensor_model_parallel_size=tp, expert_tensor_parallel_size=None,
                                 moe_mlp_glu_interleave_size=2,
                                 moe_shared_expert_glu_interleave_size=4)


@NO_PROCESS_GROUP
def test_megatron_cores_tp2_interleaved_file_reads_whole_at_tp1_and_tp2(tmp_path):
    """A file in Megatron-Core's TP 2 order (built from the definition above out of a TP 1
    save) loads at TP 1 into the same model, and each TP 2 rank reads its contiguous run."""
    from megatron.checkpoint.dist import TensorShard, read_local
    from megatron.checkpoint.dist.glu_interleave import open_view

    model, layout = _model(1)
    save_shards(str(tmp_path / "tp1"), model_shards(model.state_dict_for_save_checkpoint(),
                                                    layout))
    plain = DistCheckpointReader(str(tmp_path / "tp1"))
    items = []
    for key in plain.tensor_keys():
        tensor = plain.read(key)
        if key in INTERLEAVED_KEYS:
            tensor = _megatron_order(tensor, 2, INTERLEAVED_KEYS[key])
            assert not torch.equal(tensor, plain.read(key))
        items.append(TensorShard(key, tensor, tuple(tensor.shape), (0,) * tensor.dim()))
    save_shards(str(tmp_path / "tp2"), items)
    reader = open_view(DistCheckpointReader(str(tmp_path / "tp2")), _saved_args(2))
    other, layout = _model(2)
    other.load_state_dict(load_model_state(reader, other.state_dict_for_save_checkpoint(),
                                           layout))
    saved = flatten_state_dict(model.state_dict_for_save_checkpoint())
    for name, tensor in flatten_state_dict(other.state_dict_for_save_checkpoint()).items():
        assert torch.equal(tensor, saved[name]), name
    expert = "language_model.encoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    shared = "language_model.encoder.layers.0.mlp.shared_experts.linear_fc1.weight"
    for rank in range(2):
        at_tp2 = dataclasses.replace(layout, tp_rank=rank, tp_size=2, expert_tp_rank=rank,
                                     expert_tp_size=2)
        for name in (expert, shared):
            whole = saved[name]
            rows = whole.shape[0] // 2
            got = read_local(reader, name, whole[:rows], at_tp2)
            assert torch.equal(got, whole[rank * rows:(rank + 1) * rows]), (name, rank)
    # without the saved TP size the file is read as stored: not the model
    assert not torch.equal(DistCheckpointReader(str(tmp_path / "tp2")).read(
        "decoder.layers.mlp.shared_experts.linear_fc1.weight")[0], saved[shared])
    assert open_view(plain, _saved_args(1)) is plain


@pytest.mark.parametrize("tp", [2, 4])
def test_interleaved_fc1_saved_at_tp_is_megatron_cores_order(tp):
    """What each rank writes (the save layout: SwiGLU halves of its contiguous run), put
    together, is the definition's order; the view maps it back."""
    from megatron.checkpoint.dist.glu_interleave import stored_runs

    rows, cols = 16, 3
    whole = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    name = "language_model.encoder.layers.0.mlp.shared_experts.linear_fc1.weight"
    stored = torch.full((1, rows, cols), float("nan"))
    for rank in range(tp):
        save_layout = ChunkLayout(num_layers=1, swiglu=True, tp_rank=rank, tp_size=tp)
        local = whole.chunk(tp)[rank]
        for place in placements(name, tuple(local.shape), save_layout):
            lo, hi = place.local_rows
            stored[0, place.global_offset[1]:place.global_offset[1] + hi - lo] = local[lo:hi]
    assert torch.equal(stored[0], _megatron_order(whole, tp, 0))
    back = torch.empty_like(whole)
    for start, at, length in stored_runs(rows, tp):
        back[start:start + length] = stored[0, at:at + length]
    assert torch.equal(back, whole)
