"""Hidden-state mixing of multi-token prediction (``--mtp-hsm``) on several gloo ranks against
one process.

* Picks: the sequence-parallel x context-parallel owners' slices, put in owner order, are one
  draw over the replica's whole sequence from the stream seeded ``seed + 2**40 + dp_rank``;
  tensor-parallel ranks without sequence parallelism pick the same; data-parallel replicas
  draw from their own streams.
* Shift of the older states: under context parallelism alone it is the whole sequence's shift
  of the places a rank holds; under sequence parallelism a place whose next place is not held
  next to it on the same rank (slice end, first-chunk end, packed-sequence end) gets zeros.
* Whole model, float64 (1e-10: the splits only reorder sums): TP 2 + SP gives the per-token
  losses, logged MTP losses and gradients of one process whose shift also empties the place
  where the first sequence-parallel slice ends; DP 2 those of one process that runs each
  sample with the stream of its replica and averages.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collectives import get_group_rank
from megatron.core.context_parallel import chunk_positions
from megatron.core.parallel_state import ModelGroups
from megatron.core.tensor_parallel.random import (get_cuda_rng_tracker,
                                                  model_parallel_cuda_manual_seed)
from megatron.model import GPTModel, mtp_hsm
from megatron.model.multi_token_prediction import sequence_ends
from tests.distributed.test_gpt_model_tp import full_tensor
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import SEQ, make_batch, make_config, single_process_state

SEED, STATES, BATCH = 1234, 3, 2
TOL = dict(rtol=0, atol=1e-10)


def _picks_body(tp_size, cp_size, sp, seq_local):
    state = parallel_state.initialize_model_parallel(tp_size, context_parallel_size=cp_size,
                                                     sequence_parallel=sp)
    model_parallel_cuda_manual_seed(SEED, state.tp_rank)
    groups = ModelGroups.of(state)
    sp_group = groups.tp_group if sp else None
    owners, owner = mtp_hsm.sequence_owner(sp_group, groups.cp_group)
    seed = mtp_hsm.hsm_seed(get_group_rank(groups.dp_group))
    first = mtp_hsm.draw_picks(STATES, seq_local, BATCH, owners, owner, seed,
                               torch.device("cpu"))
    second = mtp_hsm.draw_picks(STATES, seq_local, BATCH, owners, owner, seed,
                                torch.device("cpu"))
    return dict(dp=state.dp_rank, tp=state.tp_rank, cp=state.cp_rank, owners=owners,
                owner=owner, picks=[first, second])


def _one_draw(owners, seq_local, dp_rank=0):
    gen = torch.Generator().manual_seed(SEED + 2 ** 40 + dp_rank)
    return [torch.randint(STATES, (owners * seq_local, BATCH), generator=gen)
            for _ in range(2)]


@pytest.mark.parametrize("world, tp, cp, sp", [(4, 2, 2, True), (2, 2, 1, False),
                                               (2, 1, 2, False)],
                         ids=["tp2-sp-cp2", "tp2", "cp2"])
def test_owner_slices_are_one_draw_and_tp_ranks_agree(world, tp, cp, sp):
    seq_local = 4
    results = run_on_ranks(_picks_body, world, tp, cp, sp, seq_local)
    owners = (tp if sp else 1) * cp
    want = _one_draw(owners, seq_local)
    assert sorted(r["owner"] for r in results) == sorted(
        [o for o in range(owners) for _ in range(world // owners)])
    for r in results:
        assert r["owners"] == owners
        assert r["owner"] == r["cp"] * (tp if sp else 1) + (r["tp"] if sp else 0)
        for got, whole in zip(r["picks"], want):
            assert torch.equal(got, whole[r["owner"] * seq_local:(r["owner"] + 1) * seq_local])


def test_data_parallel_replicas_draw_from_their_own_streams():
    results = run_on_ranks(_picks_body, 2, 1, 1, False, 4)
    assert [r["dp"] for r in results] == [0, 1]
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["picks"], _one_draw(1, 4, r["dp"])))
    assert not torch.equal(results[0]["picks"][0], results[1]["picks"][0])


def _roll_body(tp_size, cp_size, older, positions):
    state = parallel_state.initialize_model_parallel(tp_size, context_parallel_size=cp_size,
                                                     sequence_parallel=tp_size > 1)
    held = chunk_positions(older.size(1), cp_size, state.cp_rank)
    ends = sequence_ends(positions[:, held].clone(), state.cp_group)
    local = len(held) // tp_size
    held = held[state.tp_rank * local:(state.tp_rank + 1) * local]
    sp_group = state.tp_group if tp_size > 1 else None
    rolled = mtp_hsm.roll_history(older[:, held].clone(), state.cp_group, ends, sp_group)
    return held, rolled


def _local_shift(older, positions, held):
    """Each held place takes the next place of the whole sequence if that place is held right
    after it here and in the same packed sequence, zeros otherwise."""
    out = torch.zeros_like(older[:, held])
    for j in range(len(held) - 1):
        here, nxt = int(held[j]), int(held[j + 1])
        if nxt == here + 1 and positions[0, nxt] != 0:
            out[:, j] = older[:, nxt]
    return out


@pytest.mark.parametrize("tp, cp", [(2, 1), (2, 2), (1, 2), (3, 2)],
                         ids=["sp2", "sp2-cp2", "cp2", "sp3-cp2"])
def test_shift_of_older_states_under_sequence_and_context_parallelism(tp, cp):
    seq = 24
    older = torch.randn(2, seq, 1, 3, generator=torch.Generator().manual_seed(5),
                        dtype=torch.float64)
    positions = torch.cat([torch.arange(11), torch.arange(13)]).unsqueeze(0)  # two packed
    whole = torch.zeros_like(older)
    whole[:, :-1] = older[:, 1:]
    whole[:, 10] = 0                                    # the first packed sequence's end
    for held, rolled in run_on_ranks(_roll_body, tp * cp, tp, cp, older, positions):
        if tp == 1:
            assert torch.equal(rolled, whole[:, held])
        else:
            assert torch.equal(rolled, _local_shift(older, positions, held))
            assert rolled[:, -1].eq(0).all()


def _model(state, sp=False):
    torch.manual_seed(0)
    return GPTModel(make_config(position_embedding_type="rope"), state, sequence_parallel=sp,
                    mtp_num_layers=3, mtp_loss_scaling_factor=0.3, mtp_hsm=True).train()


def _step(model, ids, pos, labels, scale=1.0):
    model.mtp_tracker.backward_scale = scale        # the attached MTP loss's, as training sets
    losses = model(ids, pos, None, labels=labels)                            # [b, s]
    (losses.mean() * scale).backward()
    return losses.detach(), model.mtp_tracker.report()


def _sp_body():
    state = parallel_state.initialize_model_parallel(2, sequence_parallel=True)
    model_parallel_cuda_manual_seed(SEED, state.tp_rank)
    model = _model(state, sp=True)
    assert model.mtp.hsm_seed == SEED + 2 ** 40
    losses, logged = _step(model, *make_batch())
    grads = {n: full_tensor(p.grad, p, state.tp_group, 2, reduce_sequence_parallel=True)
             for n, p in model.named_parameters()}
    return losses, logged, grads


def _single_with_sp_shift_body():
    """One process whose shift also empties place SEQ/2 - 1, where the first TP 2 slice ends
    (so its mixing takes the newest state there, as a sequence-parallel rank does)."""
    model_parallel_cuda_manual_seed(SEED, 0)
    original = mtp_hsm.roll_history

    def split_at_half(older, *args, **kwargs):
        rolled = original(older, *args, **kwargs).clone()
        rolled[:, SEQ // 2 - 1] = 0
        return rolled
    mtp_hsm.roll_history = split_at_half
    model = _model(single_process_state())
    losses, logged = _step(model, *make_batch())
    return losses, logged, {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(got, want):
    (losses, logged, grads), (want_losses, want_logged, want_grads) = got, want
    torch.testing.assert_close(losses, want_losses, **TOL)
    assert logged.keys() == want_logged.keys() == {"mtp_1 loss", "mtp_2 loss", "mtp_3 loss"}
    for key in want_logged:
        assert logged[key] == pytest.approx(want_logged[key], rel=0, abs=1e-10), key
    assert grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], **TOL, msg=name)


def test_tp2_sequence_parallel_model_matches_one_process():
    want = run_on_ranks(_single_with_sp_shift_body, 1)[0]
    results = run_on_ranks(_sp_body, 2)
    for got in results:
        _check(got, want)
    # the emptied place matters: without it one process differs
    plain = run_on_ranks(_plain_single_body, 1)[0]
    assert plain[1]["mtp_3 loss"] != pytest.approx(want[1]["mtp_3 loss"], rel=0, abs=1e-10)


def _plain_single_body():
    model_parallel_cuda_manual_seed(SEED, 0)
    model = _model(single_process_state())
    losses, logged = _step(model, *make_batch())
    return losses, logged, {n: p.grad.clone() for n, p in model.named_parameters()}


def _dp_body():
    state = parallel_state.initialize_model_parallel(1)
    model_parallel_cuda_manual_seed(SEED, 0)
    model = _model(state)
    assert model.mtp.hsm_seed == SEED + 2 ** 40 + state.dp_rank
    sample = [t[state.dp_rank:state.dp_rank + 1] for t in make_batch()]
    losses, logged = _step(model, *sample)
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad, group=state.dp_group)
        grads[n] = p.grad / 2
    return losses, logged, grads


def _single_per_replica_body():
    """Each sample run alone with its replica's stream, the gradients averaged."""
    model = _model(single_process_state())
    batch = make_batch()
    out = []
    for dp_rank in range(2):
        get_cuda_rng_tracker().reset()
        model_parallel_cuda_manual_seed(SEED, 0)
        model.mtp.hsm_seed = SEED + 2 ** 40 + dp_rank
        out.append(_step(model, *[t[dp_rank:dp_rank + 1] for t in batch], scale=0.5))
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_dp2_model_matches_one_process_with_each_replicas_stream():
    per_sample, want_grads = run_on_ranks(_single_per_replica_body, 1)[0]
    results = run_on_ranks(_dp_body, 2)
    for rank, (losses, logged, grads) in enumerate(results):
        _check((losses, logged, grads), (*per_sample[rank], want_grads))
    assert results[0][1] != results[1][1]
