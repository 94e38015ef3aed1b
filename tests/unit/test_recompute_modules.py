"""--recompute-modules (core_attn, mlp, moe, moe_act, layernorm, shared_experts, mla_up_proj) and
--moe-layer-recompute: a GPT with dense and MoE layers (shared experts, aux and z losses,
dropout) gives the same loss (bit for bit: the same operations on the same inputs and RNG
states) and the same gradients as without recomputation, and each recomputed module really
runs twice per step while the discarded outputs are freed after the forward.

Gradients: float64; a recomputed block's backward runs inside its checkpoint, so where several
gradients meet in one tensor (the residual stream, the router's aux-loss path, the tied
embedding) they are added in another order: a few ulps (~1e-17 on gradients of ~0.1). 1e-14
is far below what a different dropout mask or routing in the recompute gives (~1e-3).
"""

import pytest
import torch

from megatron.core import tensor_parallel
from megatron.model.gpt_model import GPTModel
from megatron.model.moe import MoEConfig
from megatron.training.arguments import ArgumentsError
from tests.unit.test_gpt_model import make_batch, make_config, single_process_state
from tests.unit.test_megatron_flags_work import _args, _configs

ALL = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts")


def _model(modules, dropout=0.1, swiglu=False, bias=False):
    """Shared experts have no bias: with ``bias`` the MoE layer has none."""
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(5, 0)
    config = make_config(num_layers=2, hidden_dropout=dropout, attention_dropout=dropout,
                         swiglu=swiglu, recompute_granularity="selective" if modules else None,
                         recompute_modules=modules or ("core_attn",), add_bias_linear=bias)
    moe = MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_layer_freq=(0, 1),
                    moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001,
                    moe_shared_expert_intermediate_size=None if bias else 16)
    return GPTModel(config, single_process_state(), moe_config=moe).train()


def _step(model):
    tensor_parallel.model_parallel_cuda_manual_seed(7, 0)
    torch.manual_seed(3)
    if model.moe_tracker is not None:
        model.moe_tracker.backward_scale = 1.0
    ids, pos, labels = make_batch()
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("modules,swiglu,bias", [(ALL, False, False),
                                                 (("moe_act", "layernorm"), True, False),
                                                 (("mlp", "moe", "moe_act"), False, True)])
def test_recomputed_modules_give_the_same_gradients(modules, swiglu, bias):
    plain_loss, plain = _step(_model(None, swiglu=swiglu, bias=bias))
    loss, grads = _step(_model(modules, swiglu=swiglu, bias=bias))
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=0, atol=1e-14, msg=name)


@pytest.mark.parametrize("modules", [ALL, ("mlp", "moe_act", "layernorm", "shared_experts")])
def test_each_module_runs_again_in_backward(modules):
    """Once more in backward, also where recomputed parts sit inside a recomputed MoE layer
    (which then recomputes them itself)."""
    model = _model(modules)
    calls = {}
    layers = model.language_model.encoder.layers
    watched = {"input_layernorm": layers[0].input_layernorm, "dense_mlp": layers[0].mlp,
               "moe": layers[1].mlp, "router": layers[1].mlp.router,
               "shared": layers[1].mlp.shared_experts}
    for key, module in watched.items():
        calls[key] = 0
        module.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    act_calls = []

    def counted(f):
        return lambda x: act_calls.append(1) or f(x)

    wrapper = layers[1].mlp.activation_checkpoint
    if wrapper is not None:                        # the function inside the checkpoint
        wrapper.function = counted(wrapper.function)
    else:
        for module in layers[1].mlp.experts.modules():
            if hasattr(module, "activation_func"):
                module.activation_func = counted(module.activation_func)
    ids, pos, labels = make_batch()
    loss = model(ids, pos, None, labels=labels).mean()
    assert calls == {key: 1 for key in watched}
    forward_acts = len(act_calls)
    # The norm's output was freed after its consumers ran.
    assert layers[0].norm_checkpoints[0].records == []
    loss.backward()
    again = {key: 2 for key in watched}
    if "moe" not in modules:
        again.update(moe=1, router=1)
    assert calls == again, calls
    assert len(act_calls) == 2 * forward_acts > 0


def test_flags_select_the_modules_as_megatron():
    config = _configs("--recompute-granularity", "selective", "--recompute-modules", "mlp",
                      "moe_act").model
    assert config.recompute_modules == ("mlp", "moe_act")
    assert not config.recomputes("core_attn") and config.recomputes("mlp")
    assert _configs("--recompute-granularity", "selective").model.recompute_modules == (
        "core_attn",)
    args = _args("--moe-layer-recompute")
    assert args.recompute_granularity == "selective"
    assert args.recompute_modules == ["core_attn", "moe"]
    with pytest.raises(ArgumentsError, match="--moe-layer-recompute cannot be combined"):
        _args("--moe-layer-recompute", "--recompute-granularity", "full",
              "--recompute-method", "uniform", "--recompute-num-layers", "1")
    with pytest.raises(ArgumentsError, match="mla_up_proj .* needs --multi-latent-attention"):
        _args("--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj")
    mla = ("--multi-latent-attention", "--position-embedding-type", "rope",
           "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj")
    assert _configs(*mla).model.recomputes("mla_up_proj")
    with pytest.raises(ArgumentsError, match="mla_up_proj with --experimental-attention-variant"):
        _args(*mla, "--experimental-attention-variant", "dsa", "--q-lora-rank", "8",
              "--dsa-indexer-n-heads", "2", "--dsa-indexer-head-dim", "64",
              "--dsa-indexer-topk", "4")


@pytest.mark.parametrize("q_lora_rank", [12, None])
def test_mla_up_proj_recomputes_the_up_projections_with_the_same_gradients(q_lora_rank):
    """--recompute-modules mla_up_proj (with core_attn): the same loss and gradients as without
    recomputation, and the up projections (the query's too without --q-lora-rank) run once
    more in backward while the down projections do not."""
    def model(modules):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(5, 0)
        config = make_config(
            num_layers=2, hidden_dropout=0.1, attention_dropout=0.1,
            multi_latent_attention=True, position_embedding_type="rope",
            normalization="RMSNorm", qk_layernorm=True, kv_lora_rank=16, qk_head_dim=8,
            qk_pos_emb_head_dim=4, v_head_dim=6, q_lora_rank=q_lora_rank,
            recompute_granularity="selective" if modules else None,
            recompute_modules=modules or ("core_attn",))
        return GPTModel(config, single_process_state()).train()

    plain_loss, plain = _step(model(None))
    recomputing = model(("core_attn", "mla_up_proj"))
    attention = recomputing.language_model.encoder.layers[0].self_attention
    up = attention.linear_q_up_proj if q_lora_rank else attention.linear_q_proj
    calls = {"kv_up": 0, "q": 0, "kv_down": 0}
    for key, module in (("kv_up", attention.linear_kv_up_proj), ("q", up),
                        ("kv_down", attention.linear_kv_down_proj)):
        module.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls[key] + 1))
    loss, grads = _step(recomputing)
    assert calls == {"kv_up": 2, "q": 2, "kv_down": 1}
    assert torch.equal(loss, plain_loss)
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=0, atol=1e-14, msg=name)


def test_discarded_output_is_freed_and_restored_for_backward():
    from megatron.model.recompute import OutputDiscardingCheckpoint

    torch.manual_seed(0)
    norm, linear = torch.nn.LayerNorm(8).double(), torch.nn.Linear(8, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    want_out = linear(norm(x))
    want_out.square().sum().backward()
    want = [t.grad.clone() for t in (x, norm.weight, linear.weight)]
    for t in (x, norm.weight, linear.weight):
        t.grad = None
    checkpoint = OutputDiscardingCheckpoint(norm)
    y = checkpoint(x)
    out = linear(y)
    kept = y.clone()
    checkpoint.discard(out)
    assert y.untyped_storage().size() == 0          # freed; linear saved it for its backward
    out.square().sum().backward()
    assert torch.equal(y, kept)                      # recomputed in place before linear's backward
    for got, expected in zip((x.grad, norm.weight.grad, linear.weight.grad), want):
        assert torch.equal(got, expected)
