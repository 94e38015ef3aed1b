"""RNG stream tracker, Megatron's seeding layout, and RNG-exact activation checkpointing.

References: a torch.Generator seeded by hand gives the numbers a stream must produce; a run
without checkpointing gives the outputs, gradients and final RNG states a checkpointed run must
reproduce bit for bit.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import tensor_parallel as tp
from megatron.core.tensor_parallel import random as tp_random
from tests.multiprocess import run_on_ranks


def _expected_draw(seed, n, skip=0):
    gen = torch.Generator().manual_seed(seed)
    if skip:
        torch.rand(skip, generator=gen)
    return torch.rand(n, generator=gen)


@pytest.fixture
def tracker():
    t = tp.get_cuda_rng_tracker()
    t.reset()
    yield t
    t.reset()


def test_tracker_streams(tracker):
    torch.manual_seed(5)
    tracker.add("a", 100)
    tracker.add("b", 200)
    assert torch.equal(torch.rand(3), _expected_draw(5, 3)), "add() disturbed the default stream"
    with tracker.fork("a"):
        assert torch.equal(torch.rand(4), _expected_draw(100, 4))
    with tracker.fork("b"):
        assert torch.equal(torch.rand(2), _expected_draw(200, 2))
    with tracker.fork("a"):  # continues where the stream stopped
        assert torch.equal(torch.rand(4), _expected_draw(100, 4, skip=4))
    assert torch.equal(torch.rand(3), _expected_draw(5, 3, skip=3)), "fork leaked into default"

    saved = tracker.get_states()
    with tracker.fork("a"):
        first = torch.rand(5)
    tracker.set_states(saved)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(5), first)
    saved["a"].zero_()  # get_states returned copies
    with tracker.fork("a"):
        assert torch.equal(torch.rand(1), _expected_draw(100, 1, skip=13))

    with pytest.raises(ValueError, match="seed 100 is already used"):
        tracker.add("c", 100)
    with pytest.raises(ValueError, match="stream 'a' already exists"):
        tracker.add("a", 300)
    with pytest.raises(KeyError, match="no stream named 'zzz'"):
        with tracker.fork("zzz"):
            pass
    tracker.reset()
    assert not tracker.is_initialized() and tracker.get_states() == {}
    tracker.add("a", 100)  # the seed is free again after reset
    assert tp.RNGStatesTracker is tp.CudaRNGStatesTracker


def test_fork_restores_default_stream_on_error(tracker):
    torch.manual_seed(9)
    tracker.add("a", 1)
    with pytest.raises(RuntimeError, match="inside"):
        with tracker.fork("a"):
            torch.rand(2)
            raise RuntimeError("inside")
    assert torch.equal(torch.rand(2), _expected_draw(9, 2))


def test_model_parallel_seed_layout(tracker):
    tp.model_parallel_cuda_manual_seed(1234, tp_rank=3)
    assert torch.equal(torch.rand(4), _expected_draw(1234, 4))
    with tracker.fork():
        assert torch.equal(torch.rand(4), _expected_draw(1234 + 2718 + 3, 4))


class _Block(torch.nn.Module):
    """Column -> gelu -> dropout on the tp stream -> row -> dropout on the default stream."""

    def __init__(self, group, h=8):
        super().__init__()
        init = tp.init_method_normal(0.5)
        self.fc1 = tp.ColumnParallelLinear(h, 4 * h, init_method=init, tp_group=group,
                                           params_dtype=torch.float64)
        self.fc2 = tp.RowParallelLinear(4 * h, h, init_method=init, tp_group=group,
                                        input_is_parallel=True, params_dtype=torch.float64)

    def forward(self, x, scale):
        h, _ = self.fc1(x)
        with tp.get_cuda_rng_tracker().fork():
            h = F.dropout(F.gelu(h), p=0.4)
        out, _ = self.fc2(h)
        return F.dropout(out, p=0.3) * scale, h.sum()


def _run(block, x, checkpointed, distribute=False, group=None):
    """Forward + backward from seeded RNG; everything the checkpointed run must reproduce."""
    tp.model_parallel_cuda_manual_seed(77, 0 if group is None else dist.get_rank(group))
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    if checkpointed:
        out, aux = tp.checkpoint(block, distribute, x, 2.0, tp_group=group)
        saved = out.grad_fn.saved_tensors
    else:
        out, aux = block(x, 2.0)
        saved = None
    # Draw from both streams between forward and backward: the recompute must not rewind them.
    noise = torch.rand(())
    with tp.get_cuda_rng_tracker().fork():
        noise = noise + torch.rand(())
    (out.square().sum() + aux * noise).backward()
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return (out.detach(), grads, torch.get_rng_state(),
            tp.get_cuda_rng_tracker().get_states(), saved)


def _check_checkpoint_equal(group, distribute):
    torch.manual_seed(3)
    block = _Block(group)
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    out, grads, cpu_state, tracker_states, _ = _run(block, x, False, group=group)
    out_c, grads_c, cpu_c, tracker_c, saved = _run(block, x, True, distribute, group)
    assert torch.equal(out, out_c)
    assert len(grads) == len(grads_c) == 5
    for g, g_c in zip(grads, grads_c):
        assert torch.equal(g, g_c)
    assert torch.equal(cpu_state, cpu_c), "the recompute leaked into the default stream"
    assert all(torch.equal(tracker_states[k], tracker_c[k]) for k in tracker_states)
    # The dropout masks were really drawn (not p=0): outputs differ with other seeds.
    tp.model_parallel_cuda_manual_seed(78, 0)
    assert not torch.equal(block(x, 2.0)[0], out)
    return saved


def test_checkpoint_bit_identical_single_process(tracker):
    saved = _check_checkpoint_equal(None, False)
    assert [t.shape for t in saved] == [(4, 2, 8)]


def test_checkpoint_rejects_grad_and_missing_group(tracker):
    tp.model_parallel_cuda_manual_seed(1, 0)
    x = torch.randn(3, requires_grad=True)
    out = tp.checkpoint(lambda a: a.sin(), False, x)
    with pytest.raises(RuntimeError, match=r"only, not torch.autograd.grad"):
        torch.autograd.grad(out.sum(), x)
    with pytest.raises(ValueError, match="needs tp_group="):
        tp.checkpoint(lambda a: a, True, x)


def _body():
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    tp_rank = dist.get_rank(group)
    tp.model_parallel_cuda_manual_seed(42, tp_rank)
    outside = torch.rand(6)
    with tp.get_cuda_rng_tracker().fork():
        inside = torch.rand(6)
    # Checkpointing a tensor-parallel block, plain and keeping only 1/tp of its input.
    _check_checkpoint_equal(group, False)
    saved = _check_checkpoint_equal(group, True)
    assert [t.shape for t in saved] == [(4 * 2 * 8 // 2,)], [t.shape for t in saved]
    return outside, inside


def test_tracker_streams_across_tp_ranks_and_checkpoint_tp2():
    """4 ranks as two TP=2 groups: the default stream is shared by all, the tp stream is shared
    by ranks of equal tp rank only; checkpointed TP blocks reproduce the plain run exactly."""
    results = run_on_ranks(_body, 4)
    outside = [o for o, _ in results]
    inside = [i for _, i in results]
    assert all(torch.equal(o, _expected_draw(42, 6)) for o in outside)
    assert torch.equal(inside[0], _expected_draw(42 + 2718, 6))
    assert torch.equal(inside[1], _expected_draw(42 + 2718 + 1, 6))
    assert torch.equal(inside[0], inside[2]) and torch.equal(inside[1], inside[3])
    assert not torch.equal(inside[0], inside[1])
