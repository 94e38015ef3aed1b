"""The generation server's Megatron request keys ``top_p_decay`` / ``top_p_bound``,
``stop_on_eol`` / ``stop_on_double_eol`` and ``prevent_newline_after_colon``.

References: a naive greedy loop (a full forward of the whole sequence for every new token, no
cache, the rule applied to its argmax) for the line stops and the banned newline, and plain
greedy generation for the decay (a top-p shrunk to nearly zero keeps only the most likely
token, so every token after the first sampled one is the greedy continuation of it).
"""

import pytest
import torch

from megatron.text_generation.api import (RequestError, _line_settings, parse_request,
                                          prepare_payload)
from megatron.text_generation.generation import EolStop, generate_tokens
from tests.distributed.test_text_generation import SINGLE, _model

VOCAB, STEPS = 100, 12


def _prompts():
    tokens = torch.zeros(3, 3 + STEPS, dtype=torch.int64)
    lengths = torch.tensor([2, 3, 1])
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n] = torch.arange(7 * i + 1, 7 * i + 1 + n)
    return tokens, lengths


def _naive_greedy(model, row, total, stop=None, eol_stop=None, banned_after=None):
    """One prompt, greedy, a full forward per token; returns the sequence as it ends."""
    seq = list(row)
    while len(seq) < total:
        with torch.no_grad():
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0, -1]
        logits = logits[:VOCAB].clone()
        if banned_after is not None and seq[-1] == banned_after[0]:
            logits[banned_after[1]] = -1e10
        new = int(logits.argmax())
        previous = seq[-1]
        seq.append(new)
        if eol_stop is None:
            done = new == stop
        elif eol_stop.double:
            done = new == eol_stop.double_eol or (new == eol_stop.eol and previous == eol_stop.eol)
        else:
            done = new in (eol_stop.eol, eol_stop.double_eol)
        if done:
            break
    return seq


def _generated(out, i):
    return out.tokens[i, :int(out.lengths[i])].tolist()


def _greedy(model, tokens, lengths, **kw):
    kw = dict(dict(vocab_size=VOCAB, stop_token=VOCAB - 1, top_k=1), **kw)
    return generate_tokens(model, SINGLE, tokens, lengths, **kw)


@pytest.fixture(scope="module")
def model():
    return _model()


def test_banned_newline_after_colon_matches_the_naive_loop(model):
    tokens, lengths = _prompts()
    free = _greedy(model, tokens, lengths)
    first = _generated(free, 0)
    after, banned = first[2], first[3]            # the pair greedy makes: ban it
    out = _greedy(model, tokens, lengths, banned_after=(after, banned))
    for i, n in enumerate(lengths.tolist()):
        got = _generated(out, i)
        assert got == _naive_greedy(model, tokens[i, :n].tolist(), tokens.size(1),
                                    stop=VOCAB - 1, banned_after=(after, banned))
        assert all((a, b) != (after, banned) for a, b in zip(got[n - 1:], got[n:]))
    assert _generated(out, 0)[:3] == first[:3] and _generated(out, 0)[3] != banned


@pytest.mark.parametrize("double", [False, True])
def test_line_stops_match_the_naive_loop(model, double):
    tokens, lengths = _prompts()
    free = _greedy(model, tokens, lengths)
    produced = [t for i in range(3) for t in _generated(free, i)[int(lengths[i]):]]
    # The most frequent generated token as the newline, the next as the blank line: each row
    # meets one of them somewhere, so the stops are exercised, not just the length limit.
    ranked = torch.tensor(produced).bincount().argsort(descending=True).tolist()
    eol_stop = EolStop(eol=ranked[0], double_eol=ranked[1], double=double)
    out = _greedy(model, tokens, lengths, eol_stop=eol_stop)
    ended = 0
    for i, n in enumerate(lengths.tolist()):
        want = _naive_greedy(model, tokens[i, :n].tolist(), tokens.size(1), eol_stop=eol_stop)
        assert _generated(out, i) == want
        ended += len(want) < tokens.size(1)
    assert ended >= 1


def test_eol_stop_ends_nothing_at_the_stop_token(model):
    """As in Megatron: with a line stop, the stop token is an ordinary token."""
    tokens, lengths = _prompts()
    free = _greedy(model, tokens, lengths)
    stop = _generated(free, 0)[int(lengths[0])]            # the first token row 0 makes
    stopped = _greedy(model, tokens, lengths, stop_token=stop)
    assert int(stopped.lengths[0]) == int(lengths[0]) + 1
    never = EolStop(eol=VOCAB + 5, double_eol=None, double=False)   # an id never sampled
    out = _greedy(model, tokens, lengths, stop_token=stop, eol_stop=never)
    assert torch.equal(out.tokens, free.tokens) and int(out.lengths[0]) == tokens.size(1)


def test_top_p_decay_shrinks_to_greedy_and_the_bound_holds_it(model):
    tokens, lengths = _prompts()
    one = torch.ones(1, dtype=torch.int64)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        out = generate_tokens(model, SINGLE, tokens[:1, :3 + STEPS], lengths[:1],
                              vocab_size=VOCAB, stop_token=VOCAB - 1, top_p=0.999,
                              temperature=3.0, top_p_decay=1e-6, generator=gen)
        got = _generated(out, 0)
        n = int(lengths[0])
        greedy = _greedy(model, torch.tensor([got[:n + 1] + [0] * (STEPS - 1 + 3 - n)]),
                         one * (n + 1))
        assert got == _generated(greedy, 0)
    # With a bound at top_p itself the nucleus never shrinks: the same stream as no decay.
    plain, bounded = (
        generate_tokens(model, SINGLE, tokens, lengths, vocab_size=VOCAB, stop_token=VOCAB - 1,
                        top_p=0.9, temperature=3.0, generator=torch.Generator().manual_seed(9),
                        **kw)
        for kw in ({}, dict(top_p_decay=0.5, top_p_bound=0.9)))
    assert torch.equal(plain.tokens, bounded.tokens)
    decayed = generate_tokens(model, SINGLE, tokens, lengths, vocab_size=VOCAB,
                              stop_token=VOCAB - 1, top_p=0.9, temperature=3.0,
                              generator=torch.Generator().manual_seed(9), top_p_decay=0.5)
    assert not torch.equal(plain.tokens, decayed.tokens)


class _Tokenizer:
    """What the server needs of a tokenizer: GPT-2's ids for the three texts, or none."""

    vocab_size, eod = 1000, 999

    def __init__(self, table):
        self.table = table

    def tokenize(self, text):
        if text in self.table:
            return self.table[text]
        return [int(t) for t in text.split()]


GPT2_LIKE = {"\n": [198], "\n\n": [628], ":": [25]}


def test_payload_takes_the_tokenizers_ids():
    request = parse_request({"prompts": ["1 2"], "stop_on_double_eol": True,
                             "prevent_newline_after_colon": True})
    payload = prepare_payload(request, _Tokenizer(GPT2_LIKE), 128)
    assert payload["eol_stop"] == [198, 628, True] and payload["banned_after"] == [25, 198]
    # A tokenizer that writes a blank line as two newlines: the double check alone finds it.
    two = dict(GPT2_LIKE, **{"\n\n": [198, 198]})
    request = parse_request({"prompts": ["1"], "stop_on_eol": True})
    assert _line_settings(request, _Tokenizer(two))["eol_stop"] == [198, None, False]
    with pytest.raises(RequestError, match="stop_on_eol needs '\\\\n' to be one token"):
        _line_settings(request, _Tokenizer({"\n": [5, 6]}))


@pytest.mark.parametrize("body, message", [
    ({"top_p_decay": 0.5}, "top_p_decay cannot be set without top_p"),
    ({"top_p": 0.5, "top_p_decay": 1.5}, "top_p_decay must be a number between 0 and 1.0"),
    ({"top_p": 0.5, "top_p_bound": 0.7}, "top_p_bound must be greater than 0 and at most"),
    ({"top_p_bound": 0.1}, "top_p_bound cannot be set without top_p"),
    ({"stop_on_eol": "yes"}, "stop_on_eol must be a boolean"),
    ({"prevent_newline_after_colon": 1}, "prevent_newline_after_colon must be a boolean"),
])
def test_bad_values_are_refused_by_key(body, message):
    with pytest.raises(RequestError, match=message):
        parse_request(dict(body, prompts=["1"]))
