"""The fp64 sum of squares of a rank's gradients (``numerics.local_grad_sumsq``), the value
--rerun-mode compares between runs and whose finiteness stands for the inf/nan check of every
gradient. On CPU it widens the gradients a block at a time; the reference here is Python's exact
``math.fsum`` over every value widened one by one."""

import math

import pytest
import torch

from megatron.training import numerics

CHUNK = numerics.SUMSQ_CPU_CHUNK


def _model(sizes, where="main_grad", seed=0):
    """One module whose parameters carry gradients of the given sizes in ``main_grad`` (the
    gradient buffer's view) or ``.grad``."""
    gen = torch.Generator().manual_seed(seed)
    module = torch.nn.Module()
    for i, shape in enumerate(sizes):
        param = torch.nn.Parameter(torch.zeros(shape))
        grad = torch.randn(shape, generator=gen) * (10.0 ** (i % 5 - 2))
        if where == "main_grad":
            param.main_grad = grad
        else:
            param.grad = grad
        module.register_parameter(f"p{i}", param)
    return module


def _exact(module):
    values = []
    for param in module.parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        values += [float(v) ** 2 for v in grad.reshape(-1).tolist()]
    return math.fsum(values)


@pytest.mark.parametrize("where", ["main_grad", "grad"])
def test_sum_of_squares_matches_the_exact_sum_across_block_edges(where):
    # One block exactly, one value, several blocks with a remainder, a 2-D gradient.
    sizes = [(CHUNK,), (1,), (3 * CHUNK + 17,), (129, 513)]
    model = [_model(sizes[:2], where, seed=1), _model(sizes[2:], where, seed=2)]
    got = numerics.local_grad_sumsq(model)
    want = _exact(model[0]) + _exact(model[1])
    assert got == pytest.approx(want, rel=1e-13, abs=0.0)


def test_squares_are_taken_in_float64():
    # 2^100 squared overflows float32 (max 3.4e38) but not float64; both values are exact.
    module = _model([(CHUNK + 3,)])
    module.p0.main_grad.zero_()
    module.p0.main_grad[CHUNK + 1] = 2.0 ** 100
    module.p0.main_grad[5] = 3.0
    assert numerics.local_grad_sumsq([module]) == 2.0 ** 200 + 9.0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("at", [0, CHUNK - 1, CHUNK, 2 * CHUNK + 4])
def test_one_inf_or_nan_anywhere_makes_the_sum_not_finite(bad, at):
    module = _model([(2 * CHUNK + 5,)])
    module.p0.main_grad[at] = bad
    assert not math.isfinite(numerics.local_grad_sumsq([module]))


def test_no_gradients_sum_to_zero():
    module = torch.nn.Linear(4, 4)
    assert numerics.local_grad_sumsq([module]) == 0.0
