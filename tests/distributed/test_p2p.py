"""Pipeline point-to-point communication over real gloo ranks.

Each rank fills what it sends with values that name the sender and the kind of message
(``100 * rank + 1`` for activations, ``100 * rank + 2`` for gradients, plus an arange so a
transposed or reshaped buffer shows), so every receiver can compute exactly what it must get.
One three-rank world checks a first, a middle and a last stage, the wrap-around of the ring the
interleaved schedule uses, and, in a two-rank sub-pipeline, a rank that sends an activation and
a gradient to the same peer in one exchange (they must not be swapped). Both the batched and the
one-by-one posting paths run.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from tests.multiprocess import run_on_ranks

SHAPE = (3, 2, 4)


def _payload(rank: int, kind: int, dtype=torch.float32) -> torch.Tensor:
    base = torch.arange(24, dtype=torch.float64).view(SHAPE) / 100
    return (base + 100 * rank + kind).to(dtype)


ACT, GRAD = 1, 2


def _one_f_one_b_pattern(comm: P2PCommunicator, rank: int, p: int):
    """Forward sweep, backward sweep, then the paired 1F1B exchanges of neighbours."""
    got = {}
    # Forward sweep: each stage receives from the previous one, then sends on.
    got["recv_forward"] = comm.recv_forward(SHAPE)
    comm.send_forward(_payload(rank, ACT), SHAPE)
    # Backward sweep, last stage first.
    got["recv_backward"] = comm.recv_backward(SHAPE)
    comm.send_backward(_payload(rank, GRAD), SHAPE)
    # Pairs (0, 1) then (1, 2): the lower rank sends an activation and receives a gradient, the
    # upper one the reverse, in one exchange each.
    for low in range(p - 1):
        if rank == low:
            got[f"pair{low}"] = comm.send_forward_recv_backward(_payload(rank, ACT), SHAPE)
        elif rank == low + 1:
            got[f"pair{low}"] = comm.send_backward_recv_forward(_payload(rank, GRAD), SHAPE)
    return got


def _body():
    rank, world = dist.get_rank(), dist.get_world_size()
    ring = dist.new_group(list(range(world)))
    pair = dist.new_group([0, 1])
    return {batch: _exchanges(rank, world, ring, pair, batch) for batch in (True, False)}


def _exchanges(rank, world, ring, pair, batch):
    out = {}
    comm = P2PCommunicator(pp_group=ring, pp_ranks=list(range(world)), pp_rank=rank,
                           dtype=torch.float32, device="cpu", batch_p2p_comm=batch)
    out["1f1b"] = _one_f_one_b_pattern(comm, rank, world)
    # Every rank at once, around the ring (wrap-around included).
    act, grad = comm.send_forward_backward_recv_forward_backward(
        _payload(rank, ACT), _payload(rank, GRAD), True, True, SHAPE)
    out["ring"] = (act, grad, act.requires_grad, grad.requires_grad)
    # Interleaved helpers one direction at a time: forward around the ring, then backward.
    out["ring_forward"] = comm.send_forward_recv_forward(_payload(rank, ACT), True, SHAPE)
    out["ring_backward"] = comm.send_backward_recv_backward(_payload(rank, GRAD), True, SHAPE)
    if rank in (0, 1):
        # Two stages: next == prev, both kinds to the same peer in one exchange, twice.
        two = P2PCommunicator(pp_group=pair, pp_ranks=[0, 1], pp_rank=rank,
                              dtype=torch.float64, device="cpu", batch_p2p_comm=batch)
        out["pair"] = [two.send_forward_backward_recv_forward_backward(
            _payload(rank, ACT + 10 * i, torch.float64), _payload(rank, GRAD + 10 * i,
                                                                  torch.float64),
            True, True, SHAPE) for i in range(2)]
    return out


def test_p2p_moves_each_message_to_the_right_stage():
    world = 3
    results = run_on_ranks(_body, world)
    for rank, by_mode in enumerate(results):
        for out in by_mode.values():
            _check_rank(rank, world, out)


def _check_rank(rank, world, out):
    prev, nxt = (rank - 1) % world, (rank + 1) % world
    got = out["1f1b"]
    if rank == 0:
        assert got["recv_forward"] is None
    else:
        assert torch.equal(got["recv_forward"], _payload(prev, ACT))
        assert got["recv_forward"].requires_grad
    if rank == world - 1:
        assert got["recv_backward"] is None
    else:
        assert torch.equal(got["recv_backward"], _payload(nxt, GRAD))
        assert not got["recv_backward"].requires_grad
    for low in range(world - 1):
        if rank == low:
            assert torch.equal(got[f"pair{low}"], _payload(low + 1, GRAD))
        elif rank == low + 1:
            assert torch.equal(got[f"pair{low}"], _payload(low, ACT))
        else:
            assert f"pair{low}" not in got
    act, grad, act_rg, grad_rg = out["ring"]
    assert torch.equal(act, _payload(prev, ACT)) and act_rg and act.dtype == torch.float32
    assert torch.equal(grad, _payload(nxt, GRAD)) and not grad_rg
    assert torch.equal(out["ring_forward"], _payload(prev, ACT))
    assert torch.equal(out["ring_backward"], _payload(nxt, GRAD))
    if rank in (0, 1):
        peer = 1 - rank
        for i, (a, g) in enumerate(out["pair"]):
            assert torch.equal(a, _payload(peer, ACT + 10 * i, torch.float64))
            assert torch.equal(g, _payload(peer, GRAD + 10 * i, torch.float64))


def test_no_op_cases_and_shape_errors_need_no_peer():
    """First / last stage calls that communicate nothing, and messages of the wrong shape."""
    first = P2PCommunicator(pp_group=None, pp_ranks=[5, 9], pp_rank=0, dtype=torch.float32,
                            device="cpu")
    last = P2PCommunicator(pp_group=None, pp_ranks=[5, 9], pp_rank=1, dtype=torch.float32,
                           device="cpu")
    assert (first.prev_rank, first.next_rank, last.prev_rank, last.next_rank) == (9, 9, 5, 5)
    assert first.recv_forward(SHAPE) is None
    assert first.send_backward_recv_forward(torch.zeros(SHAPE), SHAPE) is None
    first.send_backward(torch.zeros(SHAPE))
    assert last.recv_backward(SHAPE) is None
    assert last.send_forward_recv_backward(torch.zeros(SHAPE), SHAPE) is None
    last.send_forward(torch.zeros(SHAPE))
    assert first.communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False,
                             recv_next=False, tensor_shape=SHAPE) == (None, None)
    with pytest.raises(ValueError, match=r"shape \(3, 2, 5\) and dtype torch.float32, but "
                                         r"stages exchange \(3, 2, 4\) torch.float32"):
        first.send_forward_recv_forward(torch.zeros(3, 2, 5), False, SHAPE)
    with pytest.raises(ValueError, match="dtype torch.float64"):
        last.send_backward_recv_backward(torch.zeros(SHAPE, dtype=torch.float64), False, SHAPE)
    with pytest.raises(ValueError, match="pp_rank 2 is outside"):
        P2PCommunicator(pp_group=None, pp_ranks=[0, 1], pp_rank=2, dtype=torch.float32,
                        device="cpu")
