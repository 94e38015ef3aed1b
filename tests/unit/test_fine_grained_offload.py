"""--fine-grained-activation-offloading: the saved tensors of the --offload-modules go through
host stashes, gradients equal the plain model's bit for bit, and the groups that offload after
the first forward are the ones Megatron's rule picks (worked out by hand below).

Every tensor here is already on the host, where a run keeps it; the tests make the groups copy
anyway (``copy_host_tensors``) so the whole round trip runs.
"""

import dataclasses

import pytest
import torch

from megatron.model import GPTModel
from megatron.model.fine_grained_offload import OFFLOAD_MODULES, FineGrainedOffload
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.unit.test_gpt_model import (loss_and_grads, make_batch, make_config,
                                       single_process_state)


def _gpt(num_layers=3, moe=None, **cfg):
    config = make_config(num_layers=num_layers, params_dtype=torch.float32, **cfg)
    return GPTModel(config, single_process_state(), init_seed=7, moe_config=moe)


def _offload(model, modules, min_elements=1, pp_rank=0, delta=0, fraction=1.0):
    return FineGrainedOffload(model, model.language_model.encoder.layers, modules, min_elements,
                              pp_rank, delta, fraction, copy_host_tensors=True)


def _same(a, b):
    assert torch.equal(a[0], b[0])
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def test_every_dense_module_offloads_with_the_same_gradients():
    modules = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
    model, plain = _gpt(), _gpt()
    offload = _offload(model, modules)
    _same(loss_and_grads(model, make_batch()), loss_and_grads(plain, make_batch()))
    assert len(offload.order) == 15
    assert all(g.packed > 0 and g.bytes_first_pass > 0 for g in offload.order)
    # Second pass: the last layer's groups stay (margin); the rest still offload, same numbers.
    packed = {id(g): g.packed for g in offload.groups}
    model.zero_grad()
    plain.zero_grad()
    _same(loss_and_grads(model, make_batch(1)), loss_and_grads(plain, make_batch(1)))
    moved = [g.packed > packed[id(g)] for g in offload.order]
    assert moved == [True] * 10 + [False] * 5
    assert offload.offloading() == [f"{m}#{i}" for i in (0, 1) for m in modules]


def test_experts_fc1_and_activation_offload_with_the_same_gradients():
    from megatron.model.moe import MoEConfig

    moe = MoEConfig(num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=24)
    kw = dict(num_layers=2, bias_gelu_fusion=False)
    model, plain = _gpt(moe=moe, **kw), _gpt(moe=moe, **kw)
    offload = _offload(model, ["expert_fc1", "moe_act"])
    _same(loss_and_grads(model, make_batch()), loss_and_grads(plain, make_batch()))
    names = sorted({g.name for g in offload.order})
    assert names == ["expert_fc1", "moe_act"] and all(g.packed > 0 for g in offload.order)


def test_grouped_experts_fc1_offloads_with_the_same_gradients():
    """With --moe-grouped-gemm the experts' first projection is one batched matmul: its saved
    tensors (the grouped rows, the stacked fc1 weights) go to the stash, one group per layer,
    and the gradients are the plain model's bit for bit."""
    from megatron.model.moe import MoEConfig

    moe = MoEConfig(num_moe_experts=2, moe_router_topk=1, moe_ffn_hidden_size=24,
                    moe_grouped_gemm=True)
    kw = dict(num_layers=2, bias_gelu_fusion=False)
    model, plain = _gpt(moe=moe, **kw), _gpt(moe=moe, **kw)
    offload = _offload(model, ["expert_fc1"])
    _same(loss_and_grads(model, make_batch()), loss_and_grads(plain, make_batch()))
    assert [g.name for g in offload.order] == ["expert_fc1"] * 2
    assert all(g.packed >= 2 for g in offload.order)     # grouped rows and stacked weights
    args = _validate("--fine-grained-activation-offloading", "--offload-modules", "expert_fc1",
                     "--num-experts", "2", "--moe-grouped-gemm", "--no-bias-gelu-fusion")
    assert args.offload_modules == ["expert_fc1"] and args.moe_grouped_gemm


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_mla_qkv_projections_offload_with_the_same_gradients(q_lora_rank):
    """With MLA, qkv_linear is Megatron-Core's get_query_key_value_tensors span: the down and
    up projections, norms and rotary parts, one group per layer; gradients bit for bit."""
    mla = dict(multi_latent_attention=True, position_embedding_type="rope",
               normalization="RMSNorm", qk_layernorm=True, kv_lora_rank=16, qk_head_dim=8,
               qk_pos_emb_head_dim=4, v_head_dim=6, q_lora_rank=q_lora_rank)
    model, plain = _gpt(num_layers=2, **mla), _gpt(num_layers=2, **mla)
    offload = _offload(model, ["qkv_linear"])
    _same(loss_and_grads(model, make_batch()), loss_and_grads(plain, make_batch()))
    assert [g.name for g in offload.order] == ["qkv_linear"] * 2
    assert all(g.packed > 0 for g in offload.order)
    args = _validate("--fine-grained-activation-offloading", "--offload-modules", "qkv_linear",
                     "--multi-latent-attention", "--position-embedding-type", "rope")
    assert args.offload_modules == ["qkv_linear"] and args.multi_latent_attention


def test_groups_chosen_as_megatron_chooses_them():
    """Order attn_norm#0, attn_proj#0, attn_norm#1, attn_proj#1, attn_norm#2, attn_proj#2.
    The last of each name stays. --activation-offload-fraction 0.5 keeps int(4 x 0.5) = 2 of
    the 4 left, from the back; pipeline rank 1 with a delta of attn_norm#0's bytes keeps that
    first group."""
    def chosen(**kw):
        model = _gpt()
        offload = _offload(model, ["attn_norm", "attn_proj"], **kw)
        loss_and_grads(model, make_batch())
        return offload

    assert chosen().offloading() == ["attn_norm#0", "attn_proj#0", "attn_norm#1",
                                     "attn_proj#1"]
    assert chosen(fraction=0.5).offloading() == ["attn_norm#0", "attn_proj#0"]
    first = chosen().order[0].bytes_first_pass
    assert first > 0
    assert chosen(pp_rank=1, delta=first).offloading() == ["attn_proj#0", "attn_norm#1",
                                                           "attn_proj#1"]
    assert chosen(pp_rank=0, delta=first).offloading() == chosen().offloading()


def test_small_tensors_and_parameters_stay():
    model = _gpt()
    offload = _offload(model, ["attn_proj"], min_elements=10 ** 9)
    loss_and_grads(model, make_batch())
    assert all(g.packed == 0 for g in offload.groups)
    model = _gpt()
    offload = _offload(model, ["attn_proj"])
    loss_and_grads(model, make_batch())
    # The projection saves its input and its weight: only the input moves.
    assert [g.packed for g in offload.order] == [1, 1, 1]


def _validate(*flags):
    args = parse_args(argv=["--num-layers", "2", "--hidden-size", "32",
                            "--num-attention-heads", "4", "--seq-length", "16",
                            "--max-position-embeddings", "16", "--micro-batch-size", "1",
                            "--device", "cpu", *flags])
    args.world_size = 1
    return validate_args(args) or args


def test_flags_are_checked_in_one_line(capsys):
    with pytest.raises(ArgumentsError, match="--offload-modules: give one or more of"):
        _validate("--fine-grained-activation-offloading", "--offload-modules", "mlp")
    with pytest.raises(ArgumentsError, match="--offload-modules needs"):
        _validate("--offload-modules", "core_attn")
    with pytest.raises(ArgumentsError, match="use one"):
        _validate("--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                  "--cpu-offloading-num-layers", "1")
    with pytest.raises(ArgumentsError, match="--activation-offload-fraction must be in"):
        _validate("--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                  "--activation-offload-fraction", "1.5")
    capsys.readouterr()
    args = _validate("--fine-grained-activation-offloading", "--offload-modules",
                     *OFFLOAD_MODULES)
    assert "nothing to offload" in capsys.readouterr().out
    from megatron.training.configs import build_configs

    args.padded_vocab_size = 64
    model = build_configs(args).model
    assert model.fine_grained_activation_offloading
    assert model.offload_modules == OFFLOAD_MODULES


def test_a_cpu_run_keeps_host_tensors_where_they_are():
    config = make_config(num_layers=2, params_dtype=torch.float32,
                         fine_grained_activation_offloading=True,
                         offload_modules=("attn_norm", "attn_proj"), min_offloaded_tensor_size=1)
    model = GPTModel(config, single_process_state(), init_seed=7)
    plain = _gpt(num_layers=2)
    _same(loss_and_grads(model, make_batch()), loss_and_grads(plain, make_batch()))
    assert model.activation_offload is not None
    assert all(g.packed == 0 for g in model.activation_offload.groups)
