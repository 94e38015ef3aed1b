"""``--optimizer soap`` and ``adaptive_muon`` under tensor parallelism and the layer-wise
distributed optimizer, against the same optimizer in one process.

Optimizer level (bit for bit): each rank holds a column-parallel (``partition_dim`` 0, with the
query/key/value split for adaptive Muon) and a row-parallel (``partition_dim`` 1) piece of two
weights plus a replicated bias, and is handed its piece of the same full gradients. Both
optimizers gather the whole matrix and compute on exactly the numbers one process sees, so the
gathered weights must equal the one-process weights exactly, and a per-shard computation (what
Megatron-Core's blockwise mode does) would not. The layer-wise deal (``--use-distributed-
optimizer``) steps each weight on one rank and broadcasts it: again exactly the one-process
weights, and the gathered state dict is the one-process state dict.

Model level (adaptive Muon only, within tolerance): a GPT at TP = 2 against one process, as
tests/distributed/test_muon_tp.py does for Muon (same tolerance argument: fp64 model, fp32
iteration, ~1e-8 on weights; 1e-6 allowed). SOAP is not compared this way: a rectangular
weight's Gram matrices have null spaces whose eigenbasis any eigensolver picks arbitrarily,
SOAP's elementwise Adam depends on that choice, and tensor parallelism changes the gradients'
rounding (and the SwiGLU rows' order), so the two runs may legitimately differ at O(lr).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.optimizer.adaptive_muon import AdaptiveMuon
from megatron.optimizer.soap import SOAP, SoapSettings
from tests.multiprocess import run_on_ranks

STEPS = 4
SHAPES = {"column": (16, 6), "row": (6, 8), "bias": (6,)}
QKV_SPLIT = (4, 2, 2)  # per query group: 4 query rows, a key row pair, a value row pair


def _full_problem():
    gen = torch.Generator().manual_seed(3)
    weights = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    common = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    grads = [{n: 0.1 * (c + 0.5 * torch.randn(c.shape, generator=gen))
              for n, c in common.items()} for _ in range(STEPS)]
    return weights, grads


def _piece(full, dim, rank, size):
    return full if dim is None else full.chunk(size, dim=dim)[rank].clone()


def _make(kind, params, tp_group, dp_group):
    groups = [{"params": [params["column"], params["row"]], "use_muon": True},
              {"params": [params["bias"]], "use_muon": False}]
    common = dict(lr=1e-2, weight_decay=0.1, tp_group=tp_group, dp_group=dp_group)
    if kind == "soap":
        return SOAP(groups, betas=(0.9, 0.95), settings=SoapSettings(precondition_frequency=2),
                    **common)
    return AdaptiveMuon(groups, moment2_method="normuon", momentum=0.9, nesterov=True,
                        fp32_matmul_prec="high", **common)


def _train(kind, tp_group=None, dp_group=None):
    """The weights (whole) and state dict after STEPS steps; split over ``tp_group``."""
    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    dims = {"column": 0, "row": 1, "bias": None} if tp_group is not None else \
        dict.fromkeys(SHAPES)
    weights, grads = _full_problem()
    params = {n: torch.nn.Parameter(_piece(w, dims[n], rank, size)) for n, w in weights.items()}
    for name in ("column", "row"):
        params[name].tensor_model_parallel = tp_group is not None
        params[name].partition_dim = dims[name] if dims[name] is not None else -1
    params["column"].muon_qkv_split = QKV_SPLIT
    optimizer = _make(kind, params, tp_group, dp_group)
    for step_grads in grads:
        for name, p in params.items():
            p.grad = _piece(step_grads[name], dims[name], rank, size)
        optimizer.step()
    state = optimizer.state_dict()
    whole = {}
    for name, p in params.items():
        if dims[name] is None:
            whole[name] = p.detach().clone()
            continue
        pieces = [torch.empty_like(p) for _ in range(size)]
        dist.all_gather(pieces, p.detach().contiguous(), group=tp_group)
        whole[name] = torch.cat(pieces, dim=dims[name])
    return whole, state


def _tp_body(kind):
    return _train(kind, tp_group=dist.group.WORLD)[0]


def _dp_body(kind):
    return _train(kind, dp_group=dist.group.WORLD)


def _single(kind):
    return _train(kind)


def _assert_same_state(got, want):
    assert got["state"].keys() == want["state"].keys()
    for index, entry in want["state"].items():
        assert got["state"][index].keys() == entry.keys()
        for field, value in entry.items():
            other = got["state"][index][field]
            assert torch.equal(torch.as_tensor(other), torch.as_tensor(value)), (index, field)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["soap", "adaptive_muon"])
def test_tp2_equals_one_process_bit_for_bit(kind):
    want, _ = _single(kind)
    for weights in run_on_ranks(_tp_body, 2, kind):
        for name in SHAPES:
            assert torch.equal(weights[name], want[name]), name
    start, _ = _full_problem()
    assert all(not torch.equal(want[n], start[n]) for n in SHAPES)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["soap", "adaptive_muon"])
def test_layer_wise_deal_over_dp2_equals_one_process_bit_for_bit(kind):
    want, want_state = _single(kind)
    for weights, state in run_on_ranks(_dp_body, 2, kind):
        for name in SHAPES:
            assert torch.equal(weights[name], want[name]), name
        _assert_same_state(state, want_state)


# ---- a GPT at TP = 2 (adaptive Muon) --------------------------------------------------------

def _gpt_train(model, state, tp_group):
    from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
    from tests.distributed.test_gpt_model_tp import full_tensor
    from tests.unit.test_gpt_model import loss_and_grads, make_batch

    config = OptimizerConfig(optimizer="adaptive_muon", lr=1e-2, weight_decay=0.1,
                             clip_grad=0.0, muon_nesterov=True, muon_fp32_matmul_prec="high",
                             adaptive_muon_moment2_method="normuon")
    optimizer = get_megatron_optimizer(config, [model], mp_group=tp_group, tp_group=tp_group)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        loss_and_grads(model, make_batch(seed=step))
        optimizer.step()
    if tp_group is None:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: full_tensor(p.detach(), p, tp_group, state.tp_size)
            for n, p in model.named_parameters()}


GQA = dict(num_query_groups=2, swiglu=True, untie_embeddings_and_output_weights=True,
           normalization="RMSNorm")


def _gpt_tp_body():
    from megatron.core import parallel_state
    from megatron.model import GPTModel
    from tests.unit.test_gpt_model import make_config

    state = parallel_state.initialize_model_parallel(2)
    weights = _gpt_train(GPTModel(make_config(**GQA), state), state, state.tp_group)
    return weights if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_adaptive_muon_gpt_tp2_matches_single_process():
    from megatron.model import GPTModel
    from tests.unit.test_gpt_model import make_config, single_process_state

    split = run_on_ranks(_gpt_tp_body, 2)[0]
    state = single_process_state()
    whole = _gpt_train(GPTModel(make_config(**GQA), state), state, None)
    start = {n: p.detach() for n, p in GPTModel(make_config(**GQA),
                                                 single_process_state()).named_parameters()}
    assert split.keys() == whole.keys()
    for name in whole:
        assert not torch.equal(whole[name], start[name]), name
        torch.testing.assert_close(split[name], whole[name], rtol=0, atol=1e-6, msg=name)
