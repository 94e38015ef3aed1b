"""--calculate-per-token-loss with a mixture of experts and with multi-token prediction.

Megatron-Core's rule: every micro-batch's losses are left as sums, and the gradients are
divided once by the token count of the whole global batch (the main loss's unmasked tokens,
over micro-batches and data-parallel ranks). The auxiliary losses keep their per-micro-batch
values but are attached times a token count, and start backward at the loss scale alone
(not over the number of micro-batches):

* ``aux_loss`` and the z loss: times the token rows the router saw (``s * b``);
* ``seq_aux_loss``: times the sequence length ``s`` only (Megatron-Core counts the rows of the
  ``[s, b * E]`` view it computes that loss on), so with ``b > 1`` it weighs ``1 / b`` of what
  the averaged run gives it;
* multi-token prediction: each depth's masked loss sum (not its mean) times
  ``--mtp-loss-scaling-factor / --mtp-num-layers``, divided like the main loss by the main
  loss's token count.

Reference: a float64 copy of the model at the step's starting weights, given every micro-batch
the run read (gathered from all data-parallel ranks), whose routers are switched off (no losses
attached) and whose router logits, main logits and MTP outputs are captured; the objective above
is written out from them in plain torch (top-k choices, softmax scores, Switch load balancing,
logsumexp z loss, cross entropies against shifted labels) and differentiated. The run's
gradients after the data-parallel reduction and the division by the token count must equal its
gradients; the logged auxiliary values (unchanged by the flag: per-micro-batch means) must equal
the reference's means.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.functional.gpt_runs import gpt_flags
from tests.functional.test_per_token_loss import corpus  # noqa: F401 (fixture)
from tests.multiprocess import run_on_ranks

# fp32 forward and backward against float64, summed in another order.
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6

EXPERTS, TOPK = 4, 2
AUX, SEQ_AUX, Z = 0.1, 0.2, 0.05
MTP_DEPTHS, MTP_FACTOR = 2, 0.5
DECODER_LAYERS = 2                      # gpt_flags' --num-layers
MOE = ["--num-experts", str(EXPERTS), "--moe-router-topk", str(TOPK), "--no-bias-gelu-fusion",
       "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
       "--moe-aux-loss-coeff", str(AUX), str(SEQ_AUX), "--moe-z-loss-coeff", str(Z)]
MTP = ["--mtp-num-layers", str(MTP_DEPTHS), "--mtp-loss-scaling-factor", str(MTP_FACTOR)]
MODELS = {"moe": MOE, "mtp": MTP, "moe+mtp": MOE + MTP}


def _flags(corpus, micro_batch, model, extra=()):  # noqa: F811
    return gpt_flags(corpus, 1, micro_batch=micro_batch, global_batch=4, dropout=0.0,
                     extra=["--clip-grad", "0", "--weight-decay", "0", "--lr-warmup-iters", "0",
                            "--eval-iters", "0"] + MODELS[model] + list(extra))


def _step_and_reference(argv, router_split=None):
    """Rank body: one training step; returns the logged losses, this rank's gradients and the
    float64 reference (with ``router_split``, see :func:`_float64_reference`; None: no
    reference)."""
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
                          argv=argv)
        if router_split is None:
            return probe["losses"], probe["grads"], None
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, batches)
        reference = _float64_reference(pretrain_gpt.model_provider(), probe["weights"],
                                       [b for rank in everyone for b in rank], router_split)
        return probe["losses"], probe["grads"], reference
    finally:
        pretrain_gpt.get_batch, training.train_step = real_get_batch, real_step
        global_vars.unset_global_variables()


class _Capture:
    """The model's training forward, watched: router logits, main logits, MTP outputs."""

    keeps_logits = True

    def __init__(self, model):
        from megatron.model.moe import TopKRouter

        self.router_logits, self.logits, self.mtp_outputs = [], None, []
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.eval()   # attaches no loss; the reference writes them out
                module.route = self._watch(module.route)
        model.logits_observer = self
        if model.mtp is not None:
            model.mtp.register_forward_hook(lambda m, i, out: self.mtp_outputs.extend(out))

    def _watch(self, route):
        def watched(logits):
            self.router_logits.append(logits)                               # [s, b, E]
            return route(logits)
        return watched

    def __call__(self, logits):
        self.logits = logits                                                 # [s, b, V]

    def clear(self):
        self.router_logits, self.logits, self.mtp_outputs = [], None, []


def _switch(scores, counts, tokens):
    """Megatron's load-balancing loss, written out: E / (k T^2) sum_e counts_e sum_t p_te."""
    return EXPERTS / (TOPK * tokens ** 2) * (scores.sum(dim=0) * counts).sum()


def _router_terms(logits):
    """(aux, seq_aux, z) of one router's logits ``[s, b, E]``, float64, as Megatron defines
    them (before coefficients)."""
    s, b, _ = logits.shape
    scores = torch.softmax(logits, dim=-1)                                   # [s, b, E]
    chosen = F.one_hot(torch.topk(logits, TOPK, dim=-1).indices, EXPERTS).sum(dim=-2)
    aux = _switch(scores.reshape(s * b, -1), chosen.reshape(s * b, -1).sum(dim=0).double(),
                  s * b)
    seq = sum(_switch(scores[:, j], chosen[:, j].sum(dim=0).double(), s) for j in range(b)) / b
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return aux, seq, z


def _cross_entropy(logits, labels, mask, shift):
    """Sum of mask x cross entropy of ``logits [s, b, V]`` at position t against
    ``labels[:, t + shift]`` (positions without a label count nothing)."""
    s = labels.size(1)
    logits = logits.transpose(0, 1)[:, :s - shift]                           # [b, s', V]
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                             labels[:, shift:].reshape(-1), reduction="none")
    mask = mask[:, shift:].reshape(-1).double()
    return (losses * mask).sum(), mask.sum()


def _float64_reference(model, weights, batches, router_split=1):
    """The objective of Megatron-Core's rule, differentiated. ``router_split``: the routers of
    the run each saw ``1 / router_split`` of every sequence (context parallelism), so their
    losses are attached times that many fewer tokens (the values, summed over the ranks that
    split a sequence, are the whole sequence's)."""
    model = model.double()
    model.load_state_dict({n: w.double() if w.is_floating_point() else w
                           for n, w in weights.items()})
    capture = _Capture(model)
    head = model.shared_embedding_or_output_weight()                         # [V, h]
    objective, count = 0.0, 0.0
    logged = {"load_balancing_loss": [], "seq_load_balancing_loss": [], "z_loss": []}
    logged.update({f"mtp_{d + 1} loss": [] for d in range(MTP_DEPTHS)})
    for tokens, labels, loss_mask, position_ids in batches:
        capture.clear()
        model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
        main, tokens_counted = _cross_entropy(capture.logits, labels, loss_mask, 0)
        objective, count = objective + main, count + float(tokens_counted)
        for logits in capture.router_logits:
            s, b, _ = logits.shape
            aux, seq, z = _router_terms(logits)
            rows = s * b / router_split
            objective = (objective + AUX * aux * rows + SEQ_AUX * seq * s / router_split
                         + Z * z * rows)
            # Logged per micro-batch: the sum over every MoE layer (MTP's too) over the
            # decoder's MoE layers, as Megatron logs it.
            for name, value in zip(("load_balancing_loss", "seq_load_balancing_loss", "z_loss"),
                                   (aux, seq, z)):
                logged[name].append(float(value) / DECODER_LAYERS)
        for depth, output in enumerate(capture.mtp_outputs):
            mtp_sum, mtp_count = _cross_entropy(output @ head.t(), labels, loss_mask, depth + 1)
            objective = objective + MTP_FACTOR / MTP_DEPTHS * mtp_sum
            logged[f"mtp_{depth + 1} loss"].append(float(mtp_sum / mtp_count))
    (objective / count).backward()
    means = {k: sum(v) / len(batches) for k, v in logged.items() if v}
    return {"logged": means, "counts": [float(b[2].sum()) for b in batches],
            "grads": {n: p.grad.float() for n, p in model.named_parameters()}}


def _check(losses, grads, reference):
    for name, value in reference["logged"].items():
        assert losses[name] == pytest.approx(value, rel=LOSS_RTOL), name
    assert grads.keys() == reference["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference["grads"][name], rtol=GRAD_RTOL,
                                   atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("model", ["moe", "mtp",
                                   pytest.param("moe+mtp", marks=pytest.mark.slow)])
def test_per_token_auxiliary_losses_match_float64(corpus, model):  # noqa: F811
    """Two micro-batches of two sequences, end-of-document tokens masked: uneven counts, and
    ``seq_aux_loss`` weighed by ``s``, not ``s * b``."""
    argv = _flags(corpus, 2, model, ["--calculate-per-token-loss", "--eod-mask-loss"])
    losses, grads, reference = run_on_ranks(_step_and_reference, 1, argv, 1)[0]
    assert len(set(reference["counts"])) > 1, "the masks should count different tokens"
    _check(losses, grads, reference)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_per_token_auxiliary_losses_over_data_parallel_ranks(corpus, micro_batch):  # noqa: F811
    """DP=2: each rank attaches its own micro-batches' auxiliary losses, the gradients are
    summed over both ranks and divided by both ranks' token count: every rank ends with the
    float64 gradient of the whole global batch, and logs what one process logs."""
    argv = _flags(corpus, micro_batch, "moe+mtp",
                  ["--calculate-per-token-loss", "--eod-mask-loss"])
    results = run_on_ranks(_step_and_reference, 2, argv, 1)
    for losses, grads, reference in results:
        assert len(reference["counts"]) == 4 // micro_batch
        _check(losses, grads, reference)
    single = run_on_ranks(_step_and_reference, 1, argv, 1)[0]
    for name, value in single[0].items():
        assert results[0][0][name] == pytest.approx(value, rel=LOSS_RTOL), name
    for name, grad in single[1].items():
        torch.testing.assert_close(results[0][1][name], grad, rtol=GRAD_RTOL, atol=GRAD_ATOL)


@pytest.mark.slow
def test_with_every_token_counting_per_token_equals_the_averaged_run(corpus):  # noqa: F811
    """No mask and one sequence per micro-batch: every micro-batch counts ``s`` tokens, so
    ``s / N`` is ``1 / num_microbatches`` and the MoE auxiliary losses (``seq_aux_loss`` too)
    get the averaged run's gradients, as Megatron-Core's rule intends. (Multi-token prediction
    is left out: its sums are divided by the main loss's count, which is larger than its own
    by the ``depth + 1`` unlabelled last places, so there it is smaller by ``(s - d - 1) / s``,
    as in Megatron-Core; the float64 tests above cover it.)"""
    per_token = run_on_ranks(_step_and_reference, 1,
                             _flags(corpus, 1, "moe", ["--calculate-per-token-loss"]), 1)[0]
    averaged = run_on_ranks(_step_and_reference, 1, _flags(corpus, 1, "moe"))[0]
    for name in ("lm loss", "load_balancing_loss", "seq_load_balancing_loss", "z_loss"):
        assert per_token[0][name] == pytest.approx(averaged[0][name], rel=LOSS_RTOL), name
    for name, grad in per_token[1].items():
        torch.testing.assert_close(grad, averaged[1][name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m: f"{name}: {m}")
    _check(*per_token)


@pytest.mark.slow
def test_per_token_auxiliary_losses_under_context_parallelism(corpus):  # noqa: F811
    """CP=2: each rank routes half of every sequence and attaches its share of each loss times
    its own token rows, as Megatron-Core does; summed over the two ranks and divided by the
    global count, the auxiliary losses reach the gradients with half the one-process weight
    (Megatron-Core counts local rows against the global count). The one-process run on the
    same batches computes that reference; the CP run must give it, and log what one process
    logs."""
    argv = _flags(corpus, 2, "moe", ["--calculate-per-token-loss", "--eod-mask-loss"])
    single, _, split = run_on_ranks(_step_and_reference, 1, argv, 2)[0]
    _, _, whole = run_on_ranks(_step_and_reference, 1, argv, 1)[0]
    results = run_on_ranks(_step_and_reference, 2, argv + ["--context-parallel-size", "2"])
    router = next(n for n in split["grads"] if n.endswith("router.weight"))
    assert not torch.allclose(split["grads"][router], whole["grads"][router], rtol=1e-2)
    for losses, grads, _ in results:
        for name, value in single.items():
            assert losses[name] == pytest.approx(value, rel=LOSS_RTOL), name
        for name, grad in grads.items():
            torch.testing.assert_close(grad, split["grads"][name], rtol=GRAD_RTOL,
                                       atol=GRAD_ATOL, msg=lambda m: f"{name}: {m}")


def _losses(argv):
    from tests.functional.gpt_runs import run_pretrain

    return run_pretrain(argv)["losses"]


@pytest.mark.slow
def test_pretrain_gpt_with_both_flags_is_deterministic(corpus):  # noqa: F811
    """Three iterations of pretrain_gpt with experts, multi-token prediction and per-token
    losses, twice: the same losses bit for bit (and they move, so the steps did something)."""
    argv = gpt_flags(corpus, 3, micro_batch=2, global_batch=4, dropout=0.0,
                     extra=MOE + MTP + ["--calculate-per-token-loss", "--eod-mask-loss",
                                        "--eval-iters", "0"])
    first = run_on_ranks(_losses, 1, argv)[0]
    second = run_on_ranks(_losses, 1, argv)[0]
    assert len(first) == 3 and first == second
    assert len({loss for _, loss in first}) == 3
