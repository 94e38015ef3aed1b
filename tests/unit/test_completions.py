"""The OpenAI-style ``POST /completions`` endpoint (``megatron/text_generation/completions.py``).

References: a naive greedy loop (a full forward of the whole sequence for every new token, no
cache) for the text, and the float64 log-softmax of one full forward for every log-probability;
the log-likelihood is read the way lm-evaluation-harness's ``local-completions`` model reads it.
"""

import pytest
import torch

from megatron.text_generation.api import RequestError
from megatron.text_generation.completions import (parse_completion, prepare_completion,
                                                  token_offsets)
from megatron.text_generation.server import GenerationService
from megatron.tokenizer.tokenizer import NullTokenizer
from tests.distributed.test_text_generation import SINGLE, _model

VOCAB, MAX_POSITIONS, EOD = 100, 16, 99


class PieceTokenizer:
    """Token ``t`` is the text ``<t>``, except the ids chosen as newline and blank line; text is
    the pieces joined, tokenized by longest match."""

    def __init__(self, eol=None, blank=None):
        self.vocab_size, self.eod = VOCAB, EOD
        self.pieces = {t: f"<{t}>" for t in range(VOCAB)}
        self.pieces[EOD] = "<|eod|>"
        if eol is not None:
            self.pieces[eol] = "\n"
        if blank is not None:
            self.pieces[blank] = "\n\n"
        self.ids = {piece: t for t, piece in self.pieces.items()}

    def detokenize(self, ids):
        return "".join(self.pieces[int(t)] for t in ids)

    def tokenize(self, text):
        out, at = [], 0
        while at < len(text):
            piece = max((p for p in self.ids if text.startswith(p, at)), key=len, default=None)
            if piece is None:
                raise ValueError(f"no token at {text[at:at + 10]!r}")
            out.append(self.ids[piece])
            at += len(piece)
        return out


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def prompt_ids(model):
    """A prompt whose greedy continuation starts with three different tokens (the stop tests
    need them distinct), found by trying prompts in order."""
    for first in range(1, VOCAB - 1):
        row = [first, (first * 7) % 97 + 1, (first * 13) % 89 + 2]
        free, _ = _naive_greedy(model, row, 3)
        if len(set(free)) == 3 and EOD not in free:
            return row
    raise AssertionError("no prompt of distinct greedy tokens")


def _service(model, tokenizer):
    return GenerationService(model, SINGLE, tokenizer, torch.device("cpu"), MAX_POSITIONS)


def _reference_log_probs(model, seq):
    """float64 log-softmax over the padded vocabulary of one full forward: [len(seq) - 1, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0]
    return torch.log_softmax(logits.double(), dim=-1)[:-1]


def _naive_greedy(model, row, steps, stop_ids=(), eol=None, blank=None):
    """Greedy over the tokenizer's ids, a full forward per token; ends after ``steps`` tokens,
    at a stop id (dropped, as the end of the document is), at ``blank``, or at an ``eol`` after
    an ``eol``. Returns the generated ids and whether a stop ended them."""
    seq = list(row)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None], None)[0, -1]
        new = int(logits[:VOCAB].argmax())
        if new in stop_ids:
            return seq[len(row):], True
        seq.append(new)
        if new == blank or (new == eol is not None and seq[-2] == eol):
            return seq[len(row):], True
    return seq[len(row):], False


def test_loglikelihood_as_lm_evaluation_harness_reads_it(model):
    """lm-evaluation-harness sends [context + continuation] ids with echo, max_tokens 1,
    logprobs 1, temperature 0, and reads sum(token_logprobs[ctxlen:-1]) and whether each
    continuation token was the most likely one."""
    tokenizer = PieceTokenizer()
    context = [5, 17, 42, 8]
    greedy, _ = _naive_greedy(model, context, 3)
    other = [(greedy[0] + 1) % EOD, 3]
    requests = [context + greedy, context + other]
    answer = _service(model, tokenizer).complete(
        {"model": "m", "prompt": requests, "temperature": 0, "max_tokens": 1, "logprobs": 1,
         "seed": 1234, "echo": True})
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    assert answer["object"] == "text_completion" and answer["model"] == "m"
    for choice, seq, want_greedy in zip(answer["choices"], requests, (True, False)):
        lp = choice["logprobs"]
        # echo: every token of the request and the one generated, the first without a value
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(seq) + 1
        assert lp["tokens"][:len(seq)] == [tokenizer.pieces[t] for t in seq]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        reference = _reference_log_probs(model, seq)
        want = [float(reference[j - 1, seq[j]]) for j in range(1, len(seq))]
        assert lp["token_logprobs"][1:len(seq)] == pytest.approx(want, abs=1e-5)
        ctxlen = len(context)
        total = sum(lp["token_logprobs"][ctxlen:-1])
        assert total == pytest.approx(sum(want[ctxlen - 1:]), abs=1e-5)
        is_greedy = all(tok == max(top.values()) for tok, top in
                        zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))
        assert is_greedy is want_greedy
        for j in range(1, len(seq)):   # the top entry is the reference's most likely token
            best = int(reference[j - 1, :VOCAB].argmax())
            assert list(lp["top_logprobs"][j]) == [tokenizer.pieces[best]]
        assert choice["text"] == tokenizer.detokenize(seq) + lp["tokens"][-1]
        assert lp["text_offset"] == [len(tokenizer.detokenize(seq[:j]))
                                     for j in range(len(seq) + 1)]
    prompt_tokens = sum(len(seq) for seq in requests)
    assert answer["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 2,
                               "total_tokens": prompt_tokens + 2}


def test_greedy_text_stops_and_offsets(model, prompt_ids):
    tokenizer = PieceTokenizer()
    service = _service(model, tokenizer)
    prompt = tokenizer.detokenize(prompt_ids)
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 2}
    answer = service.complete(body)["choices"][0]
    generated, stopped = _naive_greedy(model, prompt_ids, 6, stop_ids=(EOD,))
    assert answer["text"] == tokenizer.detokenize(generated)
    assert answer["finish_reason"] == ("stop" if stopped else "length")
    lp = answer["logprobs"]
    seq = prompt_ids + generated
    reference = _reference_log_probs(model, seq)
    # Without echo the first generated token has its log-probability too.
    assert lp["token_logprobs"] == pytest.approx(
        [float(reference[j - 1, seq[j]]) for j in range(len(prompt_ids), len(seq))], abs=1e-5)
    assert all(len(top) == 2 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == len(prompt)
    # echo: the prompt's text and tokens first.
    echoed = service.complete(dict(body, echo=True))["choices"][0]
    assert echoed["text"] == prompt + answer["text"]
    assert echoed["logprobs"]["tokens"][len(prompt_ids):] == lp["tokens"]
    # A stop string in the generated part ends the text before it, whatever tokens follow;
    # the same string in the prompt does not count.
    stop = tokenizer.pieces[generated[2]]
    for echo in (False, True):
        cut = service.complete(dict(body, stop=[stop, "never"], echo=echo))["choices"][0]
        assert cut["text"] == (prompt if echo else "") + tokenizer.detokenize(generated[:2])
        assert cut["finish_reason"] == "stop"
        assert cut["logprobs"]["tokens"][-2:] == [tokenizer.pieces[t] for t in generated[:2]]
    inside = service.complete(dict(body, stop=tokenizer.pieces[prompt_ids[1]], echo=True))
    assert inside["choices"][0]["text"] == echoed["text"]


def test_blank_line_and_end_of_document_end_generation(model, prompt_ids):
    """As Megatron's endpoint: a blank line (one token, or a newline after a newline) and the
    end-of-document token end a completion; the latter is not returned."""
    free, _ = _naive_greedy(model, prompt_ids, 8)
    third = free[2]
    cases = {"blank": dict(blank=third), "eol": dict(eol=third),
             "both": dict(eol=free[1], blank=third)}
    for name, ids in cases.items():
        tokenizer = PieceTokenizer(**ids)
        answer = _service(model, tokenizer).complete(
            {"prompt": prompt_ids, "max_tokens": 8, "temperature": 0})["choices"][0]
        generated, stopped = _naive_greedy(model, prompt_ids, 8, stop_ids=(EOD,), **ids)
        assert answer["text"] == tokenizer.detokenize(generated), name
        assert answer["finish_reason"] == ("stop" if stopped else "length")
        if name != "eol":
            assert stopped and generated == free[:3], name
    # The end of the document: make the greedy third token the tokenizer's eod, with and
    # without line tokens (which end generation at line ends, and at the eod too).
    unused = [t for t in range(VOCAB - 1) if t not in free][:2]
    for lines in ({}, dict(eol=unused[0], blank=unused[1])):
        tokenizer = PieceTokenizer(**lines)
        tokenizer.eod = third
        answer = _service(model, tokenizer).complete(
            {"prompt": prompt_ids, "max_tokens": 8, "temperature": 0, "stop": []})["choices"][0]
        assert answer["text"] == tokenizer.detokenize(free[:2]), lines
        assert answer["finish_reason"] == "stop"
        assert len(answer["logprobs"]["tokens"]) == 2


def test_every_choice_gets_at_most_max_tokens(model):
    tokenizer = PieceTokenizer()
    answer = _service(model, tokenizer).complete(
        {"prompt": [[1, 2, 3, 4, 5, 6], [7]], "max_tokens": 3, "temperature": 0})
    for choice, row in zip(answer["choices"], ([1, 2, 3, 4, 5, 6], [7])):
        generated, stopped = _naive_greedy(model, row, 3, stop_ids=(EOD,))
        assert choice["text"] == tokenizer.detokenize(generated)
        assert len(choice["logprobs"]["tokens"]) == len(generated) <= 3
    assert answer["usage"]["prompt_tokens"] == 7


def test_sampling_is_seeded(model):
    service = _service(model, PieceTokenizer())
    body = {"prompt": [3, 4], "max_tokens": 6, "temperature": 1.5, "top_p": 0.9, "seed": 7}
    first = service.complete(body)["choices"][0]
    assert service.complete(body)["choices"][0] == first


def test_offsets_of_a_tokenizer_that_joins_tokens():
    """NullTokenizer joins ids with spaces: the pieces do not add up to the text, so each
    offset is the length of the prefix's text."""
    tokenizer = NullTokenizer(1000)
    ids = [1, 22, 333]
    text = tokenizer.detokenize(ids)
    assert text == "1 22 333"
    assert token_offsets(tokenizer, ids, text) == [0, 1, 4]
    assert token_offsets(PieceTokenizer(), [1, 22], "<1><22>") == [0, 3]


BAD = [
    ({}, "prompt is required"),
    ({"prompt": []}, "prompt must be"),
    ({"prompt": [[1], "a"]}, "prompt must be"),
    ({"prompt": [[]]}, "prompt must be"),
    ({"prompt": ""}, "prompt[0] is empty"),
    ({"prompt": "a", "n": 2}, "n other than 1"),
    ({"prompt": "a", "best_of": 3}, "best_of other than 1"),
    ({"prompt": "a", "logprobs": 11}, "logprobs must be an integer from 0 to 10"),
    ({"prompt": "a", "logprobs": True}, "logprobs must be"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens=0 needs echo=true"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens must be"),
    ({"prompt": "a", "temperature": -0.5}, "temperature must be"),
    ({"prompt": "a", "top_p": 0}, "top_p must be"),
    ({"prompt": "a", "seed": -2}, "seed must be"),
    ({"prompt": "a", "stop": [1]}, "stop must be"),
    ({"prompt": "a", "stream": True}, "stream is not supported"),
    ({"prompt": "a", "presence_penalty": 0.5}, "presence_penalty is not supported"),
    ({"prompt": "a", "logit_bias": {"5": 100}}, "logit_bias is not supported"),
    ({"prompt": "a", "max_token": 4}, "'max_token' (did you mean 'max_tokens'?)"),
    ({"prompts": ["a"]}, "'prompts' (did you mean 'prompt'?)"),
]


@pytest.mark.parametrize("body, message", BAD)
def test_bad_requests_are_refused_by_key(body, message):
    with pytest.raises(RequestError) as err:
        parse_completion(body)
    assert message in str(err.value)


def test_neutral_openai_keys_are_taken():
    request = parse_completion({"prompt": "a", "stream": False, "frequency_penalty": 0.0,
                                "presence_penalty": 0, "logit_bias": {}, "suffix": None,
                                "user": "u", "n": 1, "best_of": 1, "logprobs": None})
    assert request.prompts == ["a"] and request.logprobs == 0 and request.max_tokens == 16


def test_payload_checks_the_vocabulary_and_the_model_length():
    tokenizer = PieceTokenizer()
    with pytest.raises(RequestError, match=r"prompt\[1\] has token ids outside"):
        prepare_completion(parse_completion({"prompt": [[1], [5, 100]]}), tokenizer,
                           MAX_POSITIONS)
    with pytest.raises(RequestError, match=r"\+ max_tokens \(10\) = 17 is longer"):
        prepare_completion(parse_completion({"prompt": [list(range(7))], "max_tokens": 10}),
                           tokenizer, MAX_POSITIONS)
    with pytest.raises(RequestError, match=r"prompt\[0\] cannot be tokenized"):
        prepare_completion(parse_completion({"prompt": "plain"}), tokenizer, MAX_POSITIONS)
    greedy = prepare_completion(
        parse_completion({"prompt": "<1>", "temperature": 0, "max_tokens": 4}), tokenizer,
        MAX_POSITIONS)
    assert (greedy["top_k"], greedy["top_p"], greedy["eol_stop"]) == (1, 0.0, None)
    lines = prepare_completion(parse_completion({"prompt": "<1>", "top_p": 0.5, "max_tokens": 4}),
                               PieceTokenizer(eol=10, blank=11), MAX_POSITIONS)
    assert (lines["top_k"], lines["top_p"], lines["eol_stop"]) == (0, 0.5, [10, 11, True, True])


def _stdlib_text() -> str:
    import json as json_module

    return "".join(open(json_module.__file__, encoding="utf-8").read()[:3000])


@pytest.mark.parametrize("kind", ["gpt2", "sentencepiece"])
def test_offsets_are_the_decoded_prefix_lengths(kind, tmp_path):
    """Against the naive definition, ``len(detokenize(ids[:j]))``, for text whose characters a
    byte-level BPE splits over tokens (GPT-2's) and for SentencePiece, which drops the space of
    the first piece it decodes; both take the windowed path."""
    from megatron.tokenizer import build_tokenizer, gpt2_vocab_files
    from tests.unit.test_tokenizer import namespace

    text = "naïve café 日本語の文 — ok\n" * 3 + _stdlib_text()
    if kind == "gpt2":
        vocab, merges = gpt2_vocab_files()
        tokenizer = build_tokenizer(namespace(tokenizer_type="GPT2BPETokenizer",
                                              vocab_file=vocab, merge_file=merges))
    else:
        import sentencepiece

        prefix = str(tmp_path / "sp")
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter([line for line in text.splitlines() if line.strip()]),
            model_prefix=prefix, vocab_size=600, model_type="bpe", character_coverage=0.99,
            byte_fallback=True, minloglevel=2)
        tokenizer = build_tokenizer(namespace(tokenizer_type="SentencePieceTokenizer",
                                              tokenizer_model=prefix + ".model"))
    ids = list(tokenizer.tokenize(text))
    decoded = tokenizer.detokenize(ids)
    assert "".join(tokenizer.detokenize([t]) for t in ids) != decoded   # the windowed path
    want = [len(tokenizer.detokenize(ids[:j])) for j in range(len(ids))]
    assert token_offsets(tokenizer, ids, decoded) == want
