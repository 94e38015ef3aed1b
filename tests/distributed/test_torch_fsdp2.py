"""TorchFullyShardedDataParallel and the sharded optimizer on two gloo CPU ranks.

Against single-process autograd in float64 on the whole model with every rank's data: the
sharded gradient after several micro-batches is the data-parallel average of the summed
micro-batch gradients, no reduce-scatter runs before the last micro-batch, the gradient norm and
zero count over the shards equal the whole model's, clipping scales every shard by the whole
norm, and state dicts gathered from the shards load back (and into a whole model) exactly.
Float64 throughout: the only differences are summation order, ~1e-15; rel=1e-10 is far above
that and far below any missing or doubled shard. The norm is computed in fp32 (as for every
layout), so it and the clipped gradients get NORM_REL = 1e-6 (fp32's 6e-8 and a margin): a shard
missing from the sum moves the norm by tens of percent.
"""

from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import TorchFullyShardedDataParallel
from megatron.optimizer.clip_grads import count_zeros_fp32, get_grad_norm_fp32, get_grads_for_norm
from megatron.optimizer.config import OptimizerConfig
from megatron.optimizer.optimizer import FullyShardedOptimizer
from megatron.training.log import calc_params_l2_norm
from tests.distributed.test_ddp import DP, NUM_MICRO_BATCHES, build_mlp, make_batch
from tests.multiprocess import run_on_ranks

REL = 1e-10
NORM_REL = 1e-6
MAX_NORM = 0.05   # below the gradient norm, so clipping acts


def _loss(model, rank, micro):
    x, y = make_batch(rank, micro)
    return ((model(x) - y) ** 2).mean() / NUM_MICRO_BATCHES


def _reference():
    """Whole-model gradients (mean over ranks of the summed micro-batch losses) and norm."""
    model = build_mlp()
    for rank in range(DP):
        for micro in range(NUM_MICRO_BATCHES):
            (_loss(model, rank, micro) / DP).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values())).item()
    return grads, norm


def _count_reduce_scatters(counter):
    original = dist.reduce_scatter_single

    def counting(*args, **kwargs):
        counter[0] += 1
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counting
    return original


def _body():
    rank = dist.get_rank()
    model = build_mlp()
    fsdp = TorchFullyShardedDataParallel(model, dp_group=dist.group.WORLD,
                                         units=[model.fc1, model.fc2, model.fc3])
    calls = [0]
    original = _count_reduce_scatters(calls)
    early_calls, early_grads = [], []
    try:
        for micro in range(NUM_MICRO_BATCHES):
            last = micro == NUM_MICRO_BATCHES - 1
            with nullcontext() if last else fsdp.no_sync():
                _loss(fsdp, rank, micro).backward()
            if not last:
                early_calls.append(calls[0])
                early_grads.append(any(p.grad is not None for p in model.parameters()))
    finally:
        dist.reduce_scatter_single = original
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    norm = get_grad_norm_fp32(get_grads_for_norm(params, tp_rank=0),
                              shard_group=fsdp.shard_group)
    zeros = count_zeros_fp32(params, tp_rank=0, shard_group=fsdp.shard_group)
    params_norm = calc_params_l2_norm([fsdp], SimpleNamespace(model_parallel_group=None,
                                                              tp_rank=0))
    optimizer = FullyShardedOptimizer(
        torch.optim.AdamW(params, lr=1e-2), OptimizerConfig(lr=1e-2, clip_grad=MAX_NORM),
        grad_shard_group=fsdp.shard_group)
    clipped_norm = optimizer.clip_grad_norm(MAX_NORM)
    clipped = {n: p.grad.full_tensor() for n, p in model.named_parameters()
               if p.grad is not None}
    optimizer.optimizer.step()
    model_state, optim_state = fsdp.state_dict(), optimizer.state_dict()
    return dict(params_norm=params_norm, early_calls=early_calls, last_calls=calls[0], early_grads=early_grads,
                grads=grads, norm=norm, zeros=zeros, clipped_norm=clipped_norm,
                clipped=clipped, model_state=model_state, optim_state=optim_state,
                local_numel=sum(p.to_local().numel() for p in params),
                whole_numel=sum(p.numel() for p in params))


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_body, DP)


@pytest.mark.slow
def test_accumulation_reduces_once_and_averages(results):
    ref, _ = _reference()
    for got in results:
        assert got["early_calls"] == [0] * (NUM_MICRO_BATCHES - 1)
        assert got["early_grads"] == [False] * (NUM_MICRO_BATCHES - 1)
        assert got["last_calls"] > 0
        assert got["local_numel"] < got["whole_numel"]   # really sharded
        assert set(got["grads"]) == set(ref)
        for name, grad in ref.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=REL, atol=0)


@pytest.mark.slow
def test_norms_zeros_and_clipping_are_the_whole_models(results):
    ref, ref_norm = _reference()
    ref_zeros = sum(int((g == 0).sum()) for g in ref.values())
    for got in results:
        assert got["norm"] == pytest.approx(ref_norm, rel=NORM_REL)
        assert got["clipped_norm"] == pytest.approx(ref_norm, rel=NORM_REL)
        assert got["zeros"] == ref_zeros
        whole = torch.sqrt(sum((p.detach() ** 2).sum() for p in build_mlp().parameters()))
        assert got["params_norm"] == pytest.approx(whole.item(), rel=NORM_REL)
        coeff = MAX_NORM / (ref_norm + 1e-6)
        for name, grad in ref.items():
            torch.testing.assert_close(got["clipped"][name], grad * coeff, rtol=NORM_REL,
                                       atol=0)


@pytest.mark.slow
def test_gathered_state_is_whole_and_equal_on_every_rank(results):
    whole = build_mlp()
    for got in results:
        for name, value in got["model_state"].items():
            assert type(value) is torch.Tensor
            assert value.shape == whole.state_dict()[name].shape
            torch.testing.assert_close(value, results[0]["model_state"][name], rtol=0, atol=0)
        moments = [v for entry in got["optim_state"]["state"].values() for v in entry.values()]
        assert all(type(v) is torch.Tensor for v in moments)
    # The gathered weights load into a model without FSDP2.
    whole.load_state_dict(results[0]["model_state"])


def _reload_body(model_state, optim_state):
    model = build_mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fsdp = TorchFullyShardedDataParallel(model, dp_group=dist.group.WORLD,
                                         units=[model.fc1, model.fc2])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = FullyShardedOptimizer(torch.optim.AdamW(params, lr=1e-2),
                                      OptimizerConfig(lr=1e-2), grad_shard_group=fsdp.shard_group)
    fsdp.load_state_dict(model_state)
    optimizer.load_state_dict(optim_state)
    return fsdp.state_dict(), optimizer.state_dict()


@pytest.mark.slow
def test_state_loads_back_into_shards_exactly(results):
    saved_model, saved_optim = results[0]["model_state"], results[0]["optim_state"]
    for model_state, optim_state in run_on_ranks(_reload_body, DP, saved_model, saved_optim):
        for name, value in saved_model.items():
            torch.testing.assert_close(model_state[name], value, rtol=0, atol=0)
        for index, entry in saved_optim["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(optim_state["state"][index][key], value,
                                           rtol=0, atol=0)


def _registered_after_forward(reshard_after_forward):
    """Which of fc1's weights the module holds between forward and backward: the shard
    (a DTensor) once resharded, else the gathered whole weight."""
    from torch.distributed.tensor import DTensor

    model = build_mlp()
    fsdp = TorchFullyShardedDataParallel(model, dp_group=dist.group.WORLD,
                                         units=[model.fc1, model.fc2, model.fc3],
                                         reshard_after_forward=reshard_after_forward)
    loss = _loss(fsdp, dist.get_rank(), 0)
    held = model.fc1.weight
    kind = "shard" if isinstance(held, DTensor) else tuple(held.shape)
    loss.backward()
    return kind


@pytest.mark.slow
def test_no_reshard_after_forward_keeps_gathered_weights_until_backward():
    whole = tuple(build_mlp().fc1.weight.shape)
    assert run_on_ranks(_registered_after_forward, DP, True) == ["shard"] * DP
    assert run_on_ranks(_registered_after_forward, DP, False) == [whole] * DP
