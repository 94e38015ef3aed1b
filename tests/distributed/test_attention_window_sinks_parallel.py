"""Sliding windows and learnable softmax offsets (attention sinks) under tensor parallelism
(TP = 2: the offsets split by heads) and context parallelism (CP = 2, every --cp-comm-type: the
window as a mask by global position, the offsets as one more log-sum-exp term) against the same
GPT in one process.

Layer 1 is windowed (3 keys back on a sequence of 16), layer 2 full (--window-attn-skip-freq
2); both have learnable offsets, perturbed so that each head's differs. float64: the splits only
reorder sums (~1e-15 relative), so 1e-10 absolute on O(1) losses and O(1e-2) gradients; a wrong
window, a missing offset term or a wrong head slice moves them by 1e-4 or more.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.context_parallel import chunk_positions
from megatron.model import GPTModel
from tests.distributed.test_gpt_model_tp import full_tensor
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import SEQ, make_batch, make_config, single_process_state

FLAGS = dict(window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable")


def _perturb_offsets(model, tp_rank=0, tp_size=1):
    """Every layer's offsets set to fixed values of order one (this rank's heads of them)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("softmax_offset"):
                every = torch.linspace(-1.5, 2.0, p.numel() * tp_size, dtype=p.dtype)
                p.copy_(every[tp_rank * p.numel():(tp_rank + 1) * p.numel()])


def _summed_loss_grads(model, ids, pos, labels):
    model(ids, pos, None, labels=labels).sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _reference():
    model = GPTModel(make_config(**FLAGS), single_process_state())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    _perturb_offsets(model)
    ids, pos, labels = make_batch()
    losses = model(ids, pos, None, labels=labels).detach()
    return losses, _summed_loss_grads(model, ids, pos, labels), weights


def _tp_body(batch):
    state = parallel_state.initialize_model_parallel(2)
    model = GPTModel(make_config(**FLAGS), state)
    weights = {n: full_tensor(p.detach(), p, state.tp_group, 2).clone()
               for n, p in model.named_parameters()}
    _perturb_offsets(model, dist.get_rank(), 2)
    ids, pos, labels = batch
    losses = model(ids, pos, None, labels=labels).detach()
    grads = _summed_loss_grads(model, ids, pos, labels)
    full = {n: full_tensor(grads[n], p, state.tp_group, 2) for n, p in model.named_parameters()}
    return (losses, full, weights) if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_tp2_matches_one_process():
    ref_losses, ref_grads, ref_weights = _reference()
    losses, grads, weights = run_on_ranks(_tp_body, 2, make_batch())[0]
    offsets = [n for n in weights if n.endswith("core_attention.softmax_offset")]
    assert len(offsets) == 2
    for n in ref_weights:        # drawn for all heads, then split: the same values
        assert torch.equal(weights[n], ref_weights[n]), n
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-10)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=1e-10, msg=n)
    assert all(ref_grads[n].abs().min() > 1e-6 for n in offsets)


def _cp_body(batch, comm_type):
    state = parallel_state.initialize_model_parallel(1, context_parallel_size=2)
    model = GPTModel(make_config(cp_comm_type=comm_type, **FLAGS), state)
    _perturb_offsets(model)
    held = chunk_positions(SEQ, 2, dist.get_rank())
    ids, pos, labels = (t[:, held] for t in batch)
    losses = model(ids, pos, None, labels=labels).detach()
    grads = _summed_loss_grads(model, ids, pos, labels)
    for grad in grads.values():          # each rank's tokens give part of every gradient
        dist.all_reduce(grad, group=state.cp_group)
    return held, losses, grads


@pytest.mark.slow
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather", "a2a"])
def test_cp2_matches_one_process(comm_type):
    ref_losses, ref_grads, _ = _reference()
    for held, losses, grads in run_on_ranks(_cp_body, 2, make_batch(), comm_type):
        torch.testing.assert_close(losses, ref_losses[:, held], rtol=0, atol=1e-10)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=1e-10, msg=n)
