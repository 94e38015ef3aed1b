"""Megatron's standalone MTP stage in the model, float64, against the same GPT in one stage.

The two stages of ``"Ettmm|L"`` run one after the other in this process, the first's output
handed to the second as the pipeline would hand it: the MTP stage returns the main and the
two MTP hidden states as one ``[3 s, b, h]`` tensor; the loss stage's per-token main loss,
its logged ``mtp_K loss`` values, every gradient (the tied word embedding's summed over its
two copies, as the embedding group sums it) and the evaluation logits must equal one stage's.
The same sums in the same order: 1e-12 absolute, where a depth fed the wrong hidden state or
a final norm applied twice moves them by far more.
"""

import pytest
import torch

from megatron.model import GPTModel
from tests.unit.test_gpt_model import BATCH, SEQ, make_batch, make_config, single_process_state

TOL = dict(rtol=0, atol=1e-12)
DEPTHS = 2


def _config(untie, layout=None):
    return make_config(position_embedding_type="rope", untie_embeddings_and_output_weights=untie,
                       pipeline_model_parallel_layout=layout)


def _batch():
    ids, pos, labels = make_batch()
    mask = (torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3)) > 0.25)
    return ids, pos, labels, mask.double()


def _stages(untie):
    config = _config(untie, "Ettmm|L")
    kw = dict(mtp_num_layers=DEPTHS, mtp_loss_scaling_factor=0.3, mtp_standalone=True)
    first = GPTModel(config, single_process_state(pp_size=2, pp_rank=0), pre_process=True,
                     post_process=False, mtp_stage=True, **kw)
    last = GPTModel(config, single_process_state(pp_size=2, pp_rank=1), pre_process=False,
                    post_process=True, **kw)
    return first, last


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_standalone_mtp_stage_gives_one_stage_losses_and_gradients(untie):
    ids, pos, labels, mask = _batch()
    reference = GPTModel(_config(untie), single_process_state(), mtp_num_layers=DEPTHS,
                         mtp_loss_scaling_factor=0.3)
    reference.train()
    want = reference(ids, pos, None, labels=labels, loss_mask=mask)             # [b, s]
    ((want * mask).sum() / mask.sum()).backward()
    want_logged, want_grads = reference.mtp_tracker.report(), _grads(reference)

    first, last = _stages(untie)
    first.train()
    last.train()
    sent = first(ids, pos, None)                                 # [3s, b, h]
    assert sent.shape == (3 * SEQ, BATCH, 32)
    received = sent.detach().requires_grad_()
    last.set_input_tensor(received)
    got = last(None, pos, None, labels=labels, loss_mask=mask)
    ((got * mask).sum() / mask.sum()).backward()
    sent.backward(received.grad)
    torch.testing.assert_close(got, want, **TOL)
    got_logged = last.mtp_tracker.report()
    assert sorted(got_logged) == sorted(want_logged) == ["mtp_1 loss", "mtp_2 loss"]
    for key in want_logged:
        assert abs(got_logged[key] - want_logged[key]) <= 1e-12, (got_logged, want_logged)

    grads = _grads(first)
    assert not hasattr(first, "word_embeddings_for_head") and last.mtp is None
    assert "language_model.encoder.final_layernorm.weight" in grads
    for name, grad in _grads(last).items():
        if name == "word_embeddings_for_head.weight":
            grads["language_model.embedding.word_embeddings.weight"] += grad
        else:
            assert name not in grads, name
            grads[name] = grad
    assert sorted(grads) == sorted(want_grads)
    assert any(n.startswith("mtp.layers.1.") for n in grads)
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], **TOL, msg=name)


def test_standalone_loss_stage_evaluates_the_main_head():
    """Without labels (evaluation, generation) the loss stage returns the main head's logits
    of the first of the hidden states it receives."""
    ids, pos, _ = make_batch()
    reference = GPTModel(_config(False), single_process_state(), mtp_num_layers=DEPTHS)
    reference.eval()
    first, last = _stages(False)
    first.eval()
    last.eval()
    with torch.no_grad():
        last.set_input_tensor(first(ids, pos, None))
        got = last(None, pos, None)
        want = reference(ids, pos, None)
    torch.testing.assert_close(got, want, **TOL)
