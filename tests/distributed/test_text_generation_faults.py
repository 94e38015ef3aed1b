"""A request that fails inside generation, on any rank, leaves every rank alive and in step.

Reproduced first (issue 28): on two ranks with TP = 2, ``temperature = 1e-300`` made the last
stage's ``torch.multinomial`` raise ``RuntimeError: probability tensor contains either inf, nan
or element < 0``; the worker loop caught only ``GenerationError``, so rank 1 died and torchrun
stopped the server. With PP = 2 the first stage waited for the last stage's tokens for ever.

Checked here on gloo ranks, with the server's own code (``GenerationService`` on rank 0, its
``worker_loop`` on the others), for TP = 2, PP = 2 and two data-parallel replicas:

* a distribution that cannot be sampled (``temperature = 1e-300``; NaN logits from a broken
  final norm) is a ``GenerationError`` (HTTP 400) raised on *every* rank at the same step: with
  PP = 2 rank 0 is the first stage and learns the verdict from the last one;
* any other exception (injected into the generation of one request: on every rank, or on rank 1
  alone, which only the data-parallel layout allows, its ranks sharing no collective inside a
  generation) is ``GenerationFailed`` (HTTP 500) on rank 0;
* after each, the next greedy request returns exactly the tokens of the first one.
"""

import pytest
import torch

from tests.distributed.test_text_generation import MODEL_FLAGS, PROMPTS
from tests.multiprocess import run_on_ranks

GREEDY = {"prompts": PROMPTS, "tokens_to_generate": 6, "top_k": 1}
TINY_TEMPERATURE = {"prompts": PROMPTS, "tokens_to_generate": 4, "temperature": 1e-300}
# tokens_to_generate = 3 marks the request that the injected fault breaks.
FAULTY = {"prompts": PROMPTS, "tokens_to_generate": 3, "top_k": 1}


def _build(layout_flags):
    from megatron.inference import initialize_for_inference
    from megatron.training.training import build_model_chunks
    import pretrain_gpt

    args, pstate, tokenizer = initialize_for_inference(None, MODEL_FLAGS + layout_flags)
    model = build_model_chunks(pretrain_gpt.model_provider, pstate)[0].eval()
    return model, pstate, tokenizer


def _final_norm_weights(model):
    """The final norm's weight on the last stage (none elsewhere)."""
    return [p for name, p in model.named_parameters() if "final_layernorm.weight" in name]


def _answer(service, body):
    """Rank 0: what the HTTP handler would make of ``body``: (status, tokens or message)."""
    from megatron.text_generation.server import GenerationFailed

    try:
        return 200, service.generate(body)["tokens"]
    except GenerationFailed as err:
        return 500, str(err)
    except ValueError as err:
        return 400, str(err)


def _serve_requests(layout_flags, fault_ranks):
    """Rank body: rank 0 sends the requests through ``GenerationService.generate``, the others
    run ``worker_loop``; returns rank 0's answers (None elsewhere)."""
    import torch.distributed as dist

    from megatron.text_generation import api
    from megatron.text_generation.server import GenerationService

    model, pstate, tokenizer = _build(layout_flags)
    service = GenerationService(model, pstate, tokenizer, torch.device("cpu"), 32)
    real = api.generate_from_payload

    def with_fault(model, pstate, payload, *args, **kwargs):
        if payload["tokens_to_generate"] == 3 and dist.get_rank() in fault_ranks:
            raise RuntimeError("injected fault")
        return real(model, pstate, payload, *args, **kwargs)

    api.generate_from_payload = with_fault   # this rank's process only; restored below
    norms = _final_norm_weights(model)
    saved = [w.detach().clone() for w in norms]
    try:
        if dist.get_rank() != 0:
            for step in range(5):      # the five requests below, in order
                if step == 2:          # the third runs with a broken final norm
                    for w in norms:
                        w.data.fill_(float("nan"))
                if step == 3:
                    for w, s in zip(norms, saved):
                        w.data.copy_(s)
                assert service.worker_step()
            assert not service.worker_step()      # the shutdown signal
            return None
        answers = [_answer(service, GREEDY), _answer(service, TINY_TEMPERATURE)]
        for w in norms:
            w.data.fill_(float("nan"))
        answers.append(_answer(service, GREEDY))
        for w, s in zip(norms, saved):
            w.data.copy_(s)
        answers += [_answer(service, FAULTY), _answer(service, GREEDY)]
        service.shutdown_workers()
        return answers
    finally:
        api.generate_from_payload = real


LAYOUTS = {
    "tp2": (["--tensor-model-parallel-size", "2"], {0, 1}),
    "pp2": (["--pipeline-model-parallel-size", "2"], {0, 1}),
    "dp2_fault_on_rank_1": ([], {1}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_failed_generations_answer_and_ranks_stay_in_step(layout):
    flags, fault_ranks = LAYOUTS[layout]
    answers = run_on_ranks(_serve_requests, 2, flags, fault_ranks, timeout=120)[0]
    first, tiny, nan_logits, faulty, last = answers
    assert first[0] == 200 and last == first, answers
    assert tiny[0] == 400 and "temperature 1e-300" in tiny[1], tiny
    assert nan_logits[0] == 400 and "logits are not finite" in nan_logits[1], nan_logits
    assert faulty[0] == 500, faulty
    if fault_ranks == {1}:
        assert "another rank" in faulty[1], faulty
    else:
        assert "RuntimeError: injected fault" in faulty[1], faulty
