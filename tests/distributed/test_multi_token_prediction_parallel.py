"""Multi-token prediction under sequence and context parallelism against the same GPT in one
process, float64.

TP 2 with --sequence-parallel: each depth's hidden state and shifted-token embedding are split
along the sequence, the projection gathers it; CP 2: each rank holds chunks r and 2cp-1-r, so
the shift of tokens, positions, labels and loss mask crosses chunk boundaries, and a depth's
loss is divided by the whole cp group's token count. The per-token main loss of this rank's
tokens, the logged ``mtp_K loss`` values and every gradient (gathered over tp, summed over cp)
must equal one process's. The splits only reorder sums (~1e-15 relative), so 1e-10 absolute on
O(1) losses and gradients; a shift that took the wrong token at one chunk boundary moves the
loss by far more.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.context_parallel import chunk_positions
from megatron.model import GPTModel
from megatron.model.multi_token_prediction import roll_left, sequence_ends
from tests.distributed.test_gpt_model_tp import full_tensor
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import BATCH, SEQ, make_batch, make_config, single_process_state

TOL = dict(rtol=0, atol=1e-10)
DEPTHS = 2


def _config(rope, untie):
    return make_config(position_embedding_type="rope" if rope else "learned_absolute",
                       untie_embeddings_and_output_weights=untie, ffn_hidden_size=64)


def _batch():
    ids, pos, labels = make_batch()
    mask = (torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3)) > 0.25)
    return ids, pos, labels, mask.double()


def _run(model, ids, pos, labels, mask, count, cp_size=1, cp_group=None):
    """Per-token main losses, the logged MTP losses and the gradients of the main masked mean
    (this rank's masked sum over ``count`` tokens, times cp as the training loss does) with
    the MTP loss attached."""
    model.train()
    losses = model(ids, pos, None, labels=labels, loss_mask=mask)            # [b, s]
    logged = model.mtp_tracker.report(group=cp_group)
    ((losses * mask).sum() * cp_size / count).backward()
    return losses.detach(), logged, {n: p.grad.detach().clone()
                                     for n, p in model.named_parameters()}


def _reference(rope, untie):
    ids, pos, labels, mask = _batch()
    model = GPTModel(_config(rope, untie), single_process_state(), mtp_num_layers=DEPTHS,
                     mtp_loss_scaling_factor=0.3)
    return _run(model, ids, pos, labels, mask, mask.sum())


def _parallel_body(tp_size, cp_size, rope, untie):
    state = parallel_state.initialize_model_parallel(tp_size, context_parallel_size=cp_size,
                                                     sequence_parallel=tp_size > 1)
    model = GPTModel(_config(rope, untie), state, sequence_parallel=tp_size > 1,
                     mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=0.3)
    held = chunk_positions(SEQ, cp_size, state.cp_rank)
    ids, pos, labels, mask = (t[:, held] for t in _batch())
    total = _batch()[3].sum()
    losses, logged, grads = _run(model, ids, pos, labels, mask, total, cp_size,
                                 state.cp_group)
    named = dict(model.named_parameters())
    grads = {n: full_tensor(g, named[n], state.tp_group, tp_size, reduce_sequence_parallel=True)
             for n, g in grads.items()}
    for grad in grads.values() if cp_size > 1 else ():
        dist.all_reduce(grad, group=state.cp_group)   # each cp rank's tokens give part of it
        grad /= cp_size                  # the data x context average of the training loop
    return held, losses, logged, grads


def _check(ref, results):
    ref_losses, ref_logged, ref_grads = ref
    assert sorted(ref_logged) == [f"mtp_{k + 1} loss" for k in range(DEPTHS)]
    for held, losses, logged, grads in results:
        torch.testing.assert_close(losses, ref_losses[:, held], **TOL)
        assert logged.keys() == ref_logged.keys()
        for key in ref_logged:
            # the MTP loss is formed in float32 (as in a bf16 run): 1e-6 relative
            assert abs(logged[key] - ref_logged[key]) <= 1e-6 * ref_logged[key], (
                logged, ref_logged)
        assert sorted(grads) == sorted(ref_grads)
        assert any(n.startswith("mtp.layers.1.") for n in grads)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], **TOL, msg=n)


@pytest.mark.slow
@pytest.mark.parametrize("rope, untie", [(True, False), (False, True)],
                         ids=["rope-tied", "learned-untied"])
@pytest.mark.parametrize("tp_size, cp_size", [(2, 1), (1, 2)], ids=["tp2-sp", "cp2"])
def test_mtp_with_sequence_or_context_parallelism_matches_one_process(tp_size, cp_size, rope,
                                                                      untie):
    results = run_on_ranks(_parallel_body, tp_size * cp_size, tp_size, cp_size, rope, untie)
    _check(_reference(rope, untie), results)


@pytest.mark.slow
def test_mtp_with_tp2_sp_and_cp2_matches_one_process():
    _check(_reference(True, True), run_on_ranks(_parallel_body, 4, 2, 2, True, True))


def _roll_body(cp_size, tensor):
    state = parallel_state.initialize_model_parallel(1, context_parallel_size=cp_size)
    held = chunk_positions(tensor.size(-1), cp_size, state.cp_rank)
    once = roll_left(tensor[..., held].clone(), state.cp_group)
    return held, once, roll_left(once, state.cp_group)


@pytest.mark.slow
@pytest.mark.parametrize("cp_size", [2, 4])
def test_roll_over_cp_chunks_is_the_whole_sequence_roll_split(cp_size):
    """Each rank's two chunks shifted left once and twice are the chunks of the unsplit
    sequence shifted (the last places of the whole sequence 0), for ints and floats."""
    for tensor in (torch.arange(1, 2 * 16 + 1).view(2, 16), torch.rand(3, 16).double()):
        want_once = roll_left(tensor)
        want_twice = roll_left(want_once)
        for held, once, twice in run_on_ranks(_roll_body, cp_size, cp_size, tensor):
            assert torch.equal(once, want_once[..., held])
            assert torch.equal(twice, want_twice[..., held])


def _packed_roll_body(cp_size, tensor, positions):
    state = parallel_state.initialize_model_parallel(1, context_parallel_size=cp_size)
    held = chunk_positions(tensor.size(-1), cp_size, state.cp_rank)
    ends = sequence_ends(positions[..., held].clone(), state.cp_group)
    once = roll_left(tensor[..., held].clone(), state.cp_group, ends)
    return held, once, roll_left(once, state.cp_group, ends)


@pytest.mark.slow
def test_packed_roll_over_cp_chunks_stays_in_each_sequence():
    """--sft packs: a sequence whose end falls at a chunk edge (place 7 of 16, cp 2: chunks of
    4) still takes 0 there, from the next chunk's first position (0), wherever it lives."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 0, 1, 2, 3, 4]])
    tensor = torch.arange(1, 17).view(1, 16)
    want_ends = sequence_ends(positions)
    want_once = roll_left(tensor, None, want_ends)
    want_twice = roll_left(want_once, None, want_ends)
    for held, once, twice in run_on_ranks(_packed_roll_body, 2, 2, tensor, positions):
        assert torch.equal(once, want_once[..., held])
        assert torch.equal(twice, want_twice[..., held])
