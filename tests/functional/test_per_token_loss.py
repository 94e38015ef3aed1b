"""--calculate-per-token-loss: the loss is the mean over every unmasked token of the global batch.

Reference: a float64 copy of the model, given the step's starting weights and every micro-batch
the run read (gathered from all data-parallel ranks), computes sum(loss x mask) / sum(mask) over
all of them at once, with autograd for the gradients. The run's logged loss and its gradients
(``main_grad`` after the data-parallel reduction and the division by the token count, before the
optimizer step) must equal it. With --eod-mask-loss and documents of uneven length the
micro-batches count different numbers of tokens, so the mean of per-micro-batch means (the run
without the flag) is a different number; without a mask every micro-batch counts the same and
the two agree.
"""

import pytest
import torch

from tests.functional.gpt_runs import VOCAB_SIZE, gpt_flags
from tests.multiprocess import run_on_ranks

# fp32 forward and backward against float64, summed in another order over micro-batches and ranks.
LOSS_ATOL = 2e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Short counting documents (1 to 23 tokens, then the end of document), so the
    16-token sequences hold different numbers of end-of-document tokens."""
    import numpy as np

    from megatron.data.indexed_dataset import IndexedDatasetBuilder, get_idx_path
    from megatron.tokenizer import NullTokenizer

    prefix = str(tmp_path_factory.mktemp("corpus") / "short_document")
    eod = NullTokenizer(VOCAB_SIZE).eod
    rng = np.random.RandomState(3)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(300):
        doc = (rng.randint(0, 120) + np.arange(rng.randint(1, 24))) % 120
        builder.add_item(np.append(doc, eod).astype(np.int64))
        builder.end_document()
    builder.finalize(get_idx_path(prefix))
    return prefix


def _flags(corpus, micro_batch, extra=()):
    return gpt_flags(corpus, 1, micro_batch=micro_batch, global_batch=4, dropout=0.0,
                     extra=["--clip-grad", "0", "--weight-decay", "0", "--lr-warmup-iters", "0"]
                     + list(extra))


def _step_and_reference(argv):
    """Rank body: one training step with probes; returns the logged losses, this rank's
    gradients, and the float64 reference loss, mean of micro-batch means and gradients."""
    import torch.distributed as dist

    import pretrain_gpt
    from megatron.training import global_vars, training

    batches, probe = [], {}
    real_get_batch, real_step = pretrain_gpt.get_batch, training.train_step

    def get_batch(*a, **k):
        out = real_get_batch(*a, **k)
        tokens, labels, loss_mask, _, position_ids = out
        batches.append((tokens.clone(), labels.clone(), loss_mask.clone(), position_ids.clone()))
        return out

    def train_step(forward_step_func, data_iterator, model, *a, **k):
        probe["weights"] = {n: p.detach().clone() for n, p in model[0].module.state_dict().items()}
        result = real_step(forward_step_func, data_iterator, model, *a, **k)
        probe["losses"] = result[0]
        probe["grads"] = {n: p.main_grad.detach().clone()
                          for n, p in model[0].module.named_parameters()}
        return result

    pretrain_gpt.get_batch, training.train_step = get_batch, train_step
    try:
        training.pretrain(pretrain_gpt.train_valid_test_datasets_provider,
                          pretrain_gpt.model_provider, None, pretrain_gpt.forward_step,
                          argv=argv + ["--eval-iters", "0"])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, batches)
        reference = _float64_reference(pretrain_gpt.model_provider(), probe["weights"],
                                       [b for rank in everyone for b in rank])
        return probe["losses"], probe["grads"], reference
    finally:
        pretrain_gpt.get_batch, training.train_step = real_get_batch, real_step
        global_vars.unset_global_variables()


def _float64_reference(model, weights, batches):
    model = model.double()
    model.load_state_dict({n: w.double() if w.is_floating_point() else w
                           for n, w in weights.items()})
    total, count, means = 0.0, 0.0, []
    for tokens, labels, loss_mask, position_ids in batches:
        losses = model(tokens, position_ids, None, labels=labels)          # [b, s]
        mask = loss_mask.double()
        total = total + (losses * mask).sum()
        count += float(mask.sum())
        means.append(float((losses * mask).sum().detach() / mask.sum()))
    loss = total / count
    loss.backward()
    return {"loss": float(loss), "mean_of_means": sum(means) / len(means),
            "counts": [float(b[2].sum()) for b in batches],
            "grads": {n: p.grad.float() for n, p in model.named_parameters()}}


def _check_against_reference(losses, grads, reference):
    assert losses["lm loss"] == pytest.approx(reference["loss"], abs=LOSS_ATOL)
    assert grads.keys() == reference["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference["grads"][name], rtol=GRAD_RTOL,
                                   atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")


def test_per_token_loss_over_micro_batches_matches_float64(corpus):
    """Four micro-batches of one sequence, end-of-document tokens masked: uneven counts."""
    argv = _flags(corpus, 1, ["--calculate-per-token-loss", "--eod-mask-loss"])
    losses, grads, reference = run_on_ranks(_step_and_reference, 1, argv)[0]
    assert len(set(reference["counts"])) > 1, "the masks should count different tokens"
    assert abs(reference["loss"] - reference["mean_of_means"]) > 1e-4
    _check_against_reference(losses, grads, reference)


def test_without_the_flag_the_mean_of_micro_batch_means_is_kept(corpus):
    argv = _flags(corpus, 1, ["--eod-mask-loss"])
    losses, _, reference = run_on_ranks(_step_and_reference, 1, argv)[0]
    assert losses["lm loss"] == pytest.approx(reference["mean_of_means"], abs=LOSS_ATOL)
    assert abs(losses["lm loss"] - reference["loss"]) > 1e-4


def test_without_a_mask_per_token_equals_the_averaged_loss(corpus):
    per_token = run_on_ranks(_step_and_reference, 1,
                             _flags(corpus, 2, ["--calculate-per-token-loss"]))[0]
    averaged = run_on_ranks(_step_and_reference, 1, _flags(corpus, 2))[0]
    assert per_token[0]["lm loss"] == pytest.approx(averaged[0]["lm loss"], abs=LOSS_ATOL)
    for name, grad in per_token[1].items():
        torch.testing.assert_close(grad, averaged[1][name], rtol=GRAD_RTOL, atol=GRAD_ATOL)
    _check_against_reference(*per_token)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_per_token_loss_over_data_parallel_ranks_matches_float64(corpus, micro_batch):
    """DP=2: the token count and the gradients are summed over both ranks; every rank ends
    with the gradient of the mean over all four sequences, as one process does."""
    argv = _flags(corpus, micro_batch, ["--calculate-per-token-loss", "--eod-mask-loss"])
    results = run_on_ranks(_step_and_reference, 2, argv)
    for losses, grads, reference in results:
        assert len(reference["counts"]) == 4 // micro_batch
        _check_against_reference(losses, grads, reference)
    single = run_on_ranks(_step_and_reference, 1, argv)[0]
    assert results[0][0]["lm loss"] == pytest.approx(single[0]["lm loss"], abs=LOSS_ATOL)


def _layout_losses(corpus, ranks, layout=()):
    from tests.functional.gpt_runs import run_pretrain

    extra = ["--num-layers", "4", "--calculate-per-token-loss", "--eod-mask-loss"] + list(layout)
    argv = gpt_flags(corpus, 4, micro_batch=1, global_batch=4, dropout=0.0, extra=extra)
    return [loss for _, loss in run_on_ranks(run_pretrain, ranks, argv)[-1]["losses"]]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["--pipeline-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ["--context-parallel-size", "2"],
], ids=["1f1b", "interleaved", "context-parallel"])
def test_per_token_loss_in_other_layouts_trains_as_one_process(corpus, layout):
    """Pipeline stages: the token count lives on the last stage, and every stage must divide
    its gradients by it. Context parallelism: each rank counts its part of every sequence.
    Four iterations: the later losses follow from the earlier steps' gradients on every rank
    (a rank left undivided moves them by far more than the tolerance)."""
    single = _layout_losses(corpus, 1)
    other = _layout_losses(corpus, 2, layout)
    assert len(other) == len(single) == 4
    assert other == pytest.approx(single, rel=1e-5)
