"""The tensor-parallel communication functions, the gloo-safe collectives and broadcast_data.

Every rank builds the data of EVERY rank of its group from fixed seeds, so it can compute the
naive definition of each operation (sum over ranks, concatenation in rank order, this rank's
slice) locally and compare with what the communication produced. float64 throughout; sums
are compared with a 1e-12 tolerance (the all-reduce may add in another order), everything
else must match exactly.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron.core import collectives
from megatron.core.tensor_parallel import broadcast_data, mappings
from tests.multiprocess import run_on_ranks

SUM_TOL = dict(rtol=0, atol=1e-12)


def _rand(shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _groups():
    """Every rank creates every group (new_group is collective): pairs, all four, singles."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    quad = dist.new_group([0, 1, 2, 3])
    singles = [dist.new_group([r]) for r in range(4)]
    return {"tp2": pairs[rank // 2], "tp4": quad, "tp1": singles[rank]}


@contextlib.contextmanager
def _native_ops_replaced(replacement):
    """Swap every name of the native flat collectives on torch.distributed for ``replacement``."""
    names = ["all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor"]
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    for n in saved:
        setattr(dist, n, replacement)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


# ---- collectives --------------------------------------------------------------------------

def _check_flat_collectives(group, n, r, use_native, dtype):
    pieces = [_rand((2, 3), 100 + k, dtype) for k in range(n)]
    out = torch.empty((2 * n, 3), dtype=dtype)
    collectives.all_gather_into_tensor(out, pieces[r], group, use_native=use_native)
    assert torch.equal(out, torch.cat(pieces)), (n, use_native, dtype)

    fulls = [_rand((2 * n, 3), 200 + k, dtype) for k in range(n)]
    before = fulls[r].clone()
    got = torch.empty((2, 3), dtype=dtype)
    collectives.reduce_scatter_tensor(got, fulls[r], group, use_native=use_native)
    expected = torch.stack([f.double() for f in fulls]).sum(0).chunk(n)[r]
    tol = SUM_TOL if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), expected, **tol)
    assert torch.equal(fulls[r], before), "reduce_scatter_tensor modified its input"

    got_max = torch.empty((2, 3), dtype=dtype)
    collectives.reduce_scatter_tensor(got_max, fulls[r], group, op=dist.ReduceOp.MAX,
                                      use_native=use_native)
    assert torch.equal(got_max, torch.stack(fulls).amax(0).chunk(n)[r])


def _check_collectives(groups, rank):
    for name, n, r in [("tp2", 2, rank % 2), ("tp4", 4, rank), ("tp1", 1, 0)]:
        for use_native in (True, False):
            for dtype in (torch.float64, torch.bfloat16):
                _check_flat_collectives(groups[name], n, r, use_native, dtype)

    # Fallback forced: the native ops must not be touched at all.
    def refuse(*args, **kwargs):
        raise AssertionError("native flat collective called under forced_fallback")

    with collectives.forced_fallback(), _native_ops_replaced(refuse):
        _check_flat_collectives(groups["tp4"], 4, rank, None, torch.float64)

    # A backend that rejects the native ops (gloo before torch grew them): detected once,
    # remembered, and every later call goes straight to the fallback.
    calls = []

    def unsupported(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("ProcessGroupGloo does not support this collective")

    collectives._NATIVE_WORKS.clear()
    with _native_ops_replaced(unsupported):
        _check_flat_collectives(groups["tp2"], 2, rank % 2, None, torch.float64)
        _check_flat_collectives(groups["tp2"], 2, rank % 2, None, torch.float64)
    assert len(calls) == 2, f"expected one probe per op, saw {len(calls)} native calls"
    assert collectives._NATIVE_WORKS[("gloo", "all_gather")] is False
    collectives._NATIVE_WORKS.clear()

    # An error that is not "unsupported" is raised, not hidden behind the fallback.
    def broken(*args, **kwargs):
        raise RuntimeError("connection reset by peer")

    with _native_ops_replaced(broken):
        with pytest.raises(RuntimeError, match="connection reset"):
            collectives.all_gather_into_tensor(torch.empty(4), torch.ones(2), groups["tp2"])
    collectives._NATIVE_WORKS.clear()

    _broadcast_checks(groups["tp2"], rank)


def _broadcast_checks(group, rank):
    src = (rank // 2) * 2
    seed = 1000 + src

    def batch():
        return {"text": torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(seed)),
                "labels": torch.arange(seed, seed + 7).view(7),
                "empty": torch.zeros((0, 4), dtype=torch.int64),
                "scalar": torch.tensor(seed)}

    keys = ["text", "labels", "empty", "scalar"]
    data = batch() if rank == src else None
    got = broadcast_data(keys, data, torch.int64, group, src)
    expected = batch()
    for key in keys:
        assert got[key].shape == expected[key].shape, key
        assert torch.equal(got[key], expected[key]), key


# ---- the autograd mappings ----------------------------------------------------------------

def _grad_of(fn, x, grad_out, *args):
    x = x.clone().requires_grad_()
    before = x.detach().clone()
    y = fn(x, *args)
    y.backward(grad_out)
    assert torch.equal(x.detach(), before), f"{fn.__name__} modified its input"
    return y.detach(), x.grad


def _check_mappings(group, n, r):
    s, b, h = 2 * n, 3, 2 * n
    full = (s, b, h)
    same = _rand(full, 1)                                     # identical on every rank
    same_grad = _rand(full, 2)
    per = [_rand(full, 10 + k) for k in range(n)]             # rank k's full-size tensor
    per_grad = [_rand(full, 20 + k) for k in range(n)]
    per_last = [_rand((s, b, h // n), 30 + k) for k in range(n)]   # pieces of the last dim
    per_seq = [_rand((s // n, b, h), 40 + k) for k in range(n)]    # pieces of dim 0
    per_seq_grad = [_rand((s // n, b, h), 50 + k) for k in range(n)]
    total = lambda ts: torch.stack(ts).sum(0)  # noqa: E731

    y, g = _grad_of(mappings.copy_to_tensor_model_parallel_region, same, per_grad[r], group)
    assert torch.equal(y, same)
    torch.testing.assert_close(g, total(per_grad), **SUM_TOL)

    y, g = _grad_of(mappings.reduce_from_tensor_model_parallel_region, per[r], same_grad, group)
    torch.testing.assert_close(y, total(per), **SUM_TOL)
    assert torch.equal(g, same_grad)

    y, g = _grad_of(mappings.scatter_to_tensor_model_parallel_region, same, per_last[r], group)
    assert torch.equal(y, same.chunk(n, dim=-1)[r])
    assert torch.equal(g, torch.cat(per_last, dim=-1))

    y, g = _grad_of(mappings.gather_from_tensor_model_parallel_region, per_last[r], same_grad,
                    group)
    assert torch.equal(y, torch.cat(per_last, dim=-1))
    assert torch.equal(g, same_grad.chunk(n, dim=-1)[r])

    y, g = _grad_of(mappings.scatter_to_sequence_parallel_region, same, per_seq[r], group)
    assert torch.equal(y, same.chunk(n, dim=0)[r])
    assert torch.equal(g, torch.cat(per_seq, dim=0))

    y, g = _grad_of(mappings.gather_from_sequence_parallel_region, per_seq[r], per_grad[r], group)
    assert torch.equal(y, torch.cat(per_seq, dim=0))
    torch.testing.assert_close(g, total(per_grad).chunk(n, dim=0)[r], **SUM_TOL)

    y, g = _grad_of(mappings.gather_from_sequence_parallel_region, per_seq[r], same_grad, group,
                    False)
    assert torch.equal(y, torch.cat(per_seq, dim=0))
    assert torch.equal(g, same_grad.chunk(n, dim=0)[r])

    y, g = _grad_of(mappings.reduce_scatter_to_sequence_parallel_region, per[r],
                    per_seq_grad[r], group)
    torch.testing.assert_close(y, total(per).chunk(n, dim=0)[r], **SUM_TOL)
    assert torch.equal(g, torch.cat(per_seq_grad, dim=0))


def _body():
    rank = dist.get_rank()
    groups = _groups()
    _check_collectives(groups, rank)
    for name, n, r in [("tp2", 2, rank % 2), ("tp4", 4, rank), ("tp1", 1, 0)]:
        _check_mappings(groups[name], n, r)
        with collectives.forced_fallback():
            _check_mappings(groups[name], n, r)
    # A group of one is the identity: the very same tensor comes back, no graph node added.
    x = torch.ones(2, 2, requires_grad=True)
    for fn in (mappings.copy_to_tensor_model_parallel_region,
               mappings.reduce_from_tensor_model_parallel_region,
               mappings.scatter_to_tensor_model_parallel_region,
               mappings.gather_from_tensor_model_parallel_region,
               mappings.scatter_to_sequence_parallel_region,
               mappings.gather_from_sequence_parallel_region,
               mappings.reduce_scatter_to_sequence_parallel_region):
        assert fn(x, groups["tp1"]) is x and fn(x, None) is x, fn.__name__
    # A sequence the group cannot split evenly is refused before any communication.
    odd = torch.randn(5, 2, 3)
    for fn in (mappings.scatter_to_sequence_parallel_region,
               mappings.reduce_scatter_to_sequence_parallel_region):
        with pytest.raises(ValueError, match=r"dim 0 \(shape \(5, 2, 3\)\) over "
                                             r"--tensor-model-parallel-size 2: 5 is not "
                                             r"divisible by 2"):
            fn(odd, groups["tp2"])
    return True


def test_collectives_mappings_and_broadcast_on_tp2_tp4():
    """One spawn of 4 ranks (spawning dominates the cost): flat collectives native, forced
    fallback and auto-detected fallback; every mapping forward and backward on TP=4, on both
    TP=2 groups, and on a group of one; broadcast_data within each TP=2 group."""
    assert run_on_ranks(_body, 4) == [True] * 4


# ---- single process ---------------------------------------------------------------------------

def test_broadcast_data_single_process_and_dtype_check():
    data = {"a": torch.arange(6).view(2, 3), "b": torch.tensor([7])}
    got = broadcast_data(["a", "b"], data, torch.int64, None, 0)
    assert torch.equal(got["a"], data["a"]) and torch.equal(got["b"], data["b"])
    with pytest.raises(TypeError, match=r"'a' has dtype torch.int64, expected torch.float32"):
        broadcast_data(["a"], data, torch.float32, None, 0)
    with pytest.raises(KeyError, match="'c' is missing"):
        broadcast_data(["c"], data, torch.int64, None, 0)
