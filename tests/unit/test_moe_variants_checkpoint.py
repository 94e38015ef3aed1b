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
