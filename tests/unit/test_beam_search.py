"""Beam search (the server's ``beam_width``) against an exhaustive reference.

The reference scores every continuation of the prompt with one full forward each (float64 sums
of log_softmax over the padded vocabulary, no generation code), then applies beam search's
definition step by step: keep the ``beam_width`` best prefixes among the extensions of the
kept ones. Without a stop token that is the whole algorithm, so the hypotheses and their
scores must come out equal. With a stop token and length penalties, each hypothesis's score is
checked against its own exhaustive log-probability over its length to the power of the
penalty, and the closed ones against the rule (they end at the stop token, found among the
best candidates of their step).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.text_generation.api import RequestError, parse_request, post_process
from megatron.text_generation.beam_search import BeamOutput, beam_search
from megatron.text_generation.generation import GenerationError
from tests.distributed.test_text_generation import SINGLE, _model

V = 6            # ids 0..5 may be chosen; the model's other (padded) ids never
PROMPT = [3, 1, 4]


@pytest.fixture(scope="module")
def model():
    return _model()


def _log_prob(model, ids, start):
    """Summed log p of ``ids[start:]`` given what precedes each, by one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0].double()
    log_probs = F.log_softmax(logits, dim=-1)
    return sum(float(log_probs[i - 1, ids[i]]) for i in range(start, len(ids)))


def _exhaustive_beams(model, prompt, steps, width):
    """Beam search's kept prefixes after ``steps`` steps, from exhaustive scores."""
    kept = [tuple(prompt)]
    for _ in range(steps):
        extended = [p + (t,) for p in kept for t in range(V)]
        scored = sorted(extended, key=lambda s: -_log_prob(model, list(s), len(prompt)))
        kept = scored[:width]
    return kept


def _search(model, steps, width, stop=200, penalty=1.0, **kw):
    return beam_search(model, SINGLE, PROMPT, tokens_to_generate=steps, beam_width=width,
                       stop_token=stop, vocab_size=V, pad_token=0, length_penalty=penalty, **kw)


@pytest.mark.parametrize("steps, width", [(1, 3), (2, 4), (3, 5)])
def test_without_a_stop_it_is_the_exhaustive_beam(model, steps, width):
    out = _search(model, steps, width)
    want = _exhaustive_beams(model, PROMPT, steps, width)
    assert [tuple(ids) for ids in out.tokens] == want
    for ids, score in zip(out.tokens, out.scores):
        assert score == pytest.approx(_log_prob(model, ids, len(PROMPT)) / steps, abs=1e-5)


def test_width_one_is_greedy(model):
    from megatron.text_generation.generation import generate_tokens

    tokens = torch.zeros(1, len(PROMPT) + 4, dtype=torch.int64)
    tokens[0, :len(PROMPT)] = torch.tensor(PROMPT)
    greedy = generate_tokens(model, SINGLE, tokens, torch.tensor([len(PROMPT)]), vocab_size=V,
                             stop_token=200, top_k=1)
    assert _search(model, 4, 1).tokens == [greedy.tokens[0].tolist()]


@pytest.mark.parametrize("penalty", [0.0, 1.0, 2.0])
def test_stop_token_closes_beams_and_scores_follow_the_penalty(model, penalty):
    steps, width = 4, 3
    free = _search(model, steps, width)
    stop = free.tokens[0][len(PROMPT) + 1]         # the best beam's second token: it is met
    out = _search(model, steps, width, stop=stop, penalty=penalty)
    assert out.scores == sorted(out.scores, reverse=True) and len(out.tokens) == width
    closed = 0
    for ids, score in zip(out.tokens, out.scores):
        generated = ids[len(PROMPT):]
        assert ids[:len(PROMPT)] == PROMPT and 1 <= len(generated) <= steps
        assert stop not in generated[:-1]            # a beam ends at its first stop token
        closed += generated[-1] == stop
        if generated[-1] != stop:
            assert len(generated) == steps           # an open beam runs to the end
        want = _log_prob(model, ids, len(PROMPT)) / len(generated) ** penalty
        assert score == pytest.approx(want, abs=1e-5)
    assert closed >= 1


def test_early_stop_when_no_open_beam_can_win(model):
    """Every candidate of the first step a stop token beats: the search ends after one step
    when a short closed hypothesis cannot be beaten (length penalty 0: scores are sums, so a
    longer beam only loses)."""
    free = _search(model, 1, 2)
    first = free.tokens[0][len(PROMPT)]
    steps = []
    hook = model.register_forward_hook(lambda *args: steps.append(1))
    try:
        out = _search(model, 5, 1, stop=first, penalty=0.0)
    finally:
        hook.remove()
    assert out.tokens == [PROMPT + [first]] and len(steps) == 1


def test_banned_pair_is_never_produced(model):
    free = _search(model, 3, 3)
    after, banned = free.tokens[0][len(PROMPT)], free.tokens[0][len(PROMPT) + 1]
    out = _search(model, 3, 3, banned_after=(after, banned))
    for ids in out.tokens:
        assert all((a, b) != (after, banned) for a, b in zip(ids[len(PROMPT) - 1:],
                                                              ids[len(PROMPT):]))
    assert out.tokens != free.tokens


def test_bad_settings(model):
    with pytest.raises(GenerationError, match="beam_width must be between 1"):
        _search(model, 2, V)
    with pytest.raises(GenerationError, match="tokens_to_generate of at least 1"):
        _search(model, 0, 2)


@pytest.mark.parametrize("body, message", [
    ({"prompts": ["1", "2"], "beam_width": 2}, "batch size must be 1"),
    ({"prompts": ["1"], "beam_width": 0}, "beam_width must be an integer > 0"),
    ({"prompts": ["1"], "beam_width": 2, "top_k": 3}, "top_k does not apply to beam search"),
    ({"prompts": ["1"], "beam_width": 2, "logprobs": True}, "logprobs does not apply"),
    ({"prompts": ["1"], "beam_width": 2, "stop_on_eol": True}, "stop_on_eol does not apply"),
    ({"prompts": ["1"], "beam_width": 2, "tokens_to_generate": 0, "logprobs": True},
     "beam_width needs tokens_to_generate > 0"),
])
def test_requests_refused(body, message):
    with pytest.raises(RequestError, match=message):
        parse_request(body)


def test_response_has_one_entry_per_hypothesis():
    class Words:
        def detokenize(self, ids):
            return " ".join(map(str, ids))

    answer = post_process(BeamOutput([[1, 2, 3], [1, 5]], [-0.5, -1.25]), Words(), False)
    assert answer == {"text": ["1 2 3", "1 5"], "segments": [["1", "2", "3"], ["1", "5"]],
                      "scores": [-0.5, -1.25], "tokens": [[1, 2, 3], [1, 5]]}
    request = parse_request({"prompts": ["1"], "beam_width": 3, "length_penalty": 0.5,
                             "random_seed": 4})
    assert (request.beam_width, request.length_penalty) == (3, 0.5)
