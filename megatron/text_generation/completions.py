"""The OpenAI-style completions endpoint of Megatron's server: ``POST /completions`` (also
``/v1/completions``, where OpenAI clients append it to their base URL), as
lm-evaluation-harness's ``local-completions`` model calls it.

A request (OpenAI's legacy completions keys)::

    {"prompt": "text" | ["text", ...] | [id, ...] | [[id, ...], ...], "max_tokens": 16,
     "temperature": 1.0, "top_p": 1.0, "logprobs": 0, "echo": false, "seed": <int>,
     "stop": "text" | ["text", ...], "n": 1, "best_of": 1, "model": "...", "user": "..."}

Only ``prompt`` is required. A prompt given as token ids is used as it is (never detokenized and
tokenized again, so an evaluation's context / continuation split stays where it put it).
``temperature`` 0 is greedy; ``top_p`` below 1 samples from the smallest set of tokens holding
that much probability. ``logprobs`` (0-10) asks for that many most likely tokens at every
position. ``seed`` -1 or absent draws a fresh one. ``n`` and ``best_of`` take only 1,
``stream`` only false, ``frequency_penalty`` / ``presence_penalty`` only 0, ``logit_bias`` only
empty and ``suffix`` only null; ``model`` and ``user`` name the caller's model and user and
change nothing. Any other key is refused by name.

As Megatron's endpoint does, generation ends at a blank line (its ``stop_on_double_eol``; here
with the ids the tokenizer gives "\\n" and "\\n\\n", never when neither is one token), at the
end-of-document token (dropped from the answer) or after ``max_tokens``; the text then ends
before the first ``stop`` string found in the generated part (by default the end-of-document
token's text).

The answer::

    {"id": "cmpl-...", "object": "text_completion", "created": <unix time>, "model": ...,
     "choices": [{"index": i, "text": ..., "finish_reason": "stop" | "length",
                  "logprobs": {"tokens": [one string per token], "token_logprobs": [...],
                               "top_logprobs": [{token: log p, ...}, ...] or null,
                               "text_offset": [...]}}, ...],
     "usage": {"prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ...}}

With ``echo`` the text, tokens and log-probabilities start with the prompt's (whose first token
has none: ``null``); without it, with the first generated token. ``token_logprobs[j]`` is the log
probability of ``tokens[j]`` after everything before it, ``top_logprobs[j]`` the most likely
tokens there, both from one forward pass over the finished sequence (so a token that was the
most likely has exactly the largest value), and ``text_offset[j]`` where ``tokens[j]`` starts in
the prompt + completion text. lm-evaluation-harness reads a log-likelihood as
``sum(token_logprobs[len(context):-1])`` of ``echo`` with ``max_tokens`` 1.

Where Megatron's endpoint does otherwise: it drops the first generated token's log-probability
without ``echo``, counts the stop search and the token offsets from the prompt's start (so a
stop string inside an echoed prompt cuts it), refuses ``logprobs`` with ``max_tokens`` above 0
(which lm-evaluation-harness sends) and turns a prompt of ids back into text; here each follows
the OpenAI definition above.
"""

import math
import secrets
import time
from dataclasses import dataclass
from typing import List, Optional

from megatron.text_generation import api
from megatron.text_generation.generation import GenerationOutput

MAX_TOP_LOGPROBS = 10
MAX_STOPS = 32
DEFAULT_MAX_TOKENS = 16
SERVED = ("prompt", "max_tokens", "temperature", "top_p", "logprobs", "echo", "seed", "stop",
          "n", "best_of", "model", "user")
# OpenAI keys of features this server does not have, taken only at the value that asks for
# nothing (clients send them with these defaults).
NEUTRAL = {"stream": ("false", lambda v: v is None or v is False),
           "frequency_penalty": ("0", lambda v: v is None or (_is_number(v) and v == 0)),
           "presence_penalty": ("0", lambda v: v is None or (_is_number(v) and v == 0)),
           "logit_bias": ("{}", lambda v: v is None or v == {}),
           "suffix": ("null", lambda v: v is None)}
KNOWN_KEYS = frozenset(SERVED) | frozenset(NEUTRAL)


@dataclass
class CompletionRequest:
    """A validated ``POST /completions`` request (see the module docstring): ``prompts`` holds
    strings or token-id lists."""

    prompts: list
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: int = 0
    echo: bool = False
    seed: Optional[int] = None
    stop: Optional[List[str]] = None
    model: str = "megatron"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _get(body: dict, key: str, default, valid, message: str):
    value = body.get(key)
    if value is None:
        return default
    if not valid(value):
        raise api.RequestError(f"{message}, got {_show(value)}")
    return value


def _show(value) -> str:
    return str(value)[:80] if not isinstance(value, str) else repr(value[:80])


def _check_keys(body: dict) -> None:
    unknown = sorted(key for key in body if key not in KNOWN_KEYS)
    if unknown:
        hints = [api.suggest_key(key, SERVED) for key in unknown]
        raise api.RequestError(f"unknown completions key(s) {', '.join(hints)}; the keys are "
                               f"{', '.join(SERVED)}")
    for key, (allowed, takes) in NEUTRAL.items():
        if key in body and not takes(body[key]):
            raise api.RequestError(f"{key} is not supported by this server (it takes only "
                                   f"{allowed}), got {_show(body[key])}")


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) for t in value)


def _check_prompt(body: dict) -> list:
    if "prompt" not in body:
        raise api.RequestError("prompt is required")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        prompts = prompt
    else:
        raise api.RequestError("prompt must be a string, a list of strings, a list of token ids "
                               "or a list of lists of token ids (none empty)")
    if len(prompts) > api.MAX_PROMPTS:
        raise api.RequestError(f"Maximum number of prompts is {api.MAX_PROMPTS}, got "
                               f"{len(prompts)}")
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not p:
            raise api.RequestError(f"prompt[{i}] is empty; a completion continues at least "
                                   f"one token")
    return prompts


def parse_completion(body) -> CompletionRequest:
    """Check a decoded ``POST /completions`` body; raise :class:`api.RequestError` naming the
    first bad key."""
    if not isinstance(body, dict):
        raise api.RequestError("the request body must be a JSON object")
    _check_keys(body)
    prompts = _check_prompt(body)
    max_tokens = _get(body, "max_tokens", DEFAULT_MAX_TOKENS, lambda v: _is_int(v) and v >= 0,
                      "max_tokens must be an integer greater than or equal to 0")
    temperature = _get(body, "temperature", 1.0,
                       lambda v: _is_number(v) and 0.0 <= v <= api.MAX_TEMPERATURE,
                       f"temperature must be a number from 0 (greedy) to {api.MAX_TEMPERATURE}")
    top_p = _get(body, "top_p", 1.0, lambda v: _is_number(v) and 0.0 < v <= 1.0,
                 "top_p must be a number greater than 0 and at most 1")
    logprobs = _get(body, "logprobs", 0,
                    lambda v: _is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                    f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    echo = _get(body, "echo", False, lambda v: isinstance(v, bool), "echo must be a boolean")
    seed = _get(body, "seed", -1, lambda v: _is_int(v) and -1 <= v < 2 ** 63,
                "seed must be an integer in [0, 2**63), or -1 for a fresh one")
    for key in ("n", "best_of"):
        _get(body, key, 1, lambda v: v == 1 and _is_int(v),
             f"{key} other than 1 is not supported by this server")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and len(stop) <= MAX_STOPS
                                 and all(isinstance(s, str) for s in stop)):
        raise api.RequestError(f"stop must be a string or a list of at most {MAX_STOPS} "
                               f"strings, got {_show(body['stop'])}")
    model = _get(body, "model", "megatron", lambda v: isinstance(v, str),
                 "model must be a string")
    _get(body, "user", "", lambda v: isinstance(v, str), "user must be a string")
    if max_tokens == 0 and not echo:
        raise api.RequestError("max_tokens=0 needs echo=true (there is nothing else to return)")
    return CompletionRequest(prompts, max_tokens, float(temperature), float(top_p), logprobs,
                             echo, None if seed == -1 else seed, stop, model[:200])


def _rows(request: CompletionRequest, tokenizer) -> List[List[int]]:
    rows = []
    for i, prompt in enumerate(request.prompts):
        if isinstance(prompt, str):
            try:
                ids = list(tokenizer.tokenize(prompt))
            except ValueError as err:
                raise api.RequestError(f"prompt[{i}] cannot be tokenized: {err}") from None
            if not ids:
                raise api.RequestError(f"prompt[{i}] has no tokens")
        else:
            ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise api.RequestError(f"prompt[{i}] has token ids outside the vocabulary "
                                   f"[0, {tokenizer.vocab_size}): {bad[:5]}")
        rows.append(ids)
    return rows


def _blank_line_stop(tokenizer) -> Optional[list]:
    """Megatron's blank-line stop with this tokenizer's ids, also ending at the stop token; None
    when the tokenizer has neither a one-token newline nor a one-token blank line."""
    found = []
    for text in ("\n", "\n\n"):
        try:
            found.append(api.single_token_id(tokenizer, text, "stop"))
        except api.RequestError:
            found.append(None)
    eol, blank = found
    if eol is None and blank is None:
        return None
    # Without a newline token only the blank-line one ends a line pair.
    return [blank if eol is None else eol, blank, True, True]


def prepare_completion(request: CompletionRequest, tokenizer, max_position_embeddings: int,
                       max_tokens_to_oom: int = api.DEFAULT_MAX_TOKENS_TO_OOM) -> dict:
    """Tokenize a completions request and check it fits the model: the payload every rank
    runs (:func:`api.generate_from_payload`)."""
    texts = [p for p in request.prompts if isinstance(p, str)]
    api.check_prompt_bytes(texts, max_position_embeddings, max_tokens_to_oom, key="prompt")
    if request.logprobs >= tokenizer.vocab_size:
        raise api.RequestError(f"logprobs ({request.logprobs}) must be smaller than the "
                               f"vocabulary ({tokenizer.vocab_size} tokens)")
    rows = _rows(request, tokenizer)
    api.check_fits(rows, request.max_tokens, max_position_embeddings, max_tokens_to_oom,
                   key="max_tokens")
    greedy = request.temperature == 0.0
    seed = request.seed
    if seed is None:
        seed = secrets.randbelow(2 ** 63)
    return {"tokens": rows, "tokens_to_generate": request.max_tokens, "logprobs": True,
            "temperature": 1.0 if greedy else request.temperature,
            "top_k": 1 if greedy else 0,
            "top_p": 0.0 if greedy or request.top_p >= 1.0 else request.top_p,
            "stop_token": tokenizer.eod, "random_seed": seed,
            "vocab_size": tokenizer.vocab_size, "pad_token": tokenizer.eod,
            "top_p_decay": 0.0, "top_p_bound": 0.0, "beam_width": None, "length_penalty": 1.0,
            "eol_stop": _blank_line_stop(tokenizer) if request.max_tokens else None,
            "banned_after": None, "top_logprobs": request.logprobs}


# Tokens of context before each one when its start is worked out from decoded text: more than
# any tokenizer here needs to finish a character split over tokens or to join a word.
OFFSET_WINDOW = 8


def token_offsets(tokenizer, ids: List[int], text: str) -> List[int]:
    """Where each of ``ids`` starts in ``text`` (their detokenization): the running length of
    the tokens' own texts where those add up to ``text``; otherwise (tokenizers that join or
    clean up tokens, or split a character over two) the length the text before each token
    decodes to, ``len(detokenize(ids[:j]))``, worked out over the :data:`OFFSET_WINDOW` tokens
    before it (the growth from ``j - 1`` to ``j`` tokens decoded from the same start), so a long
    prompt costs a few short decodes per token rather than one of its whole prefix."""
    pieces = [tokenizer.detokenize([t]) for t in ids]
    offsets = []
    if "".join(pieces) == text:
        at = 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return offsets
    at = 0
    for j in range(len(ids)):
        if j:
            start = max(0, j - OFFSET_WINDOW)
            grown = (len(tokenizer.detokenize(ids[start:j]))
                     - len(tokenizer.detokenize(ids[start:j - 1])))
            # Not kept monotone: a character decoded from several byte tokens counts one
            # replacement mark per byte until it is whole, then one character.
            at = min(max(at + grown, 0), len(text))
        offsets.append(at)
    return offsets


def _choice(index: int, request: CompletionRequest, tokenizer, prompt_ids: List[int],
            output: GenerationOutput, row: int, stops: List[str]) -> dict:
    n_prompt = len(prompt_ids)
    end = min(int(output.lengths[row]), n_prompt + request.max_tokens)
    ids = output.tokens[row, :end].tolist()
    ended = output.finished is not None and bool(output.finished[row]) \
        and int(output.lengths[row]) <= n_prompt + request.max_tokens
    if ended and len(ids) > n_prompt and ids[-1] == tokenizer.eod:
        ids = ids[:-1]                     # the end of the document is not text to return
    text = tokenizer.detokenize(ids)
    offsets = token_offsets(tokenizer, ids, text)
    generated_from = offsets[n_prompt] if len(ids) > n_prompt else len(text)
    cut = len(text)
    for stop in stops:
        found = text.find(stop, generated_from)
        if found != -1:
            cut = min(cut, found)
            ended = True
    first = 0 if request.echo else n_prompt
    kept = [j for j in range(first, len(ids)) if j < n_prompt or offsets[j] < cut]
    log_probs = output.log_probs[row].tolist() if output.log_probs is not None else []
    token_logprobs = [log_probs[j - 1] if j > 0 else None for j in kept]
    top = None
    if request.logprobs:
        values = output.top_log_probs[row].tolist()
        top_ids = output.top_ids[row].tolist()
        top = [None if j == 0 else
               {tokenizer.detokenize([t]): v for t, v in zip(top_ids[j - 1], values[j - 1])}
               for j in kept]
    return {"index": index,
            "text": text[0 if request.echo else generated_from:cut],
            "finish_reason": "stop" if ended else "length",
            "logprobs": {"tokens": [tokenizer.detokenize([ids[j]]) for j in kept],
                         "token_logprobs": token_logprobs, "top_logprobs": top,
                         "text_offset": [offsets[j] for j in kept]},
            "_generated": sum(1 for j in kept if j >= n_prompt)}


def completion_response(request: CompletionRequest, payload: dict, output: GenerationOutput,
                        tokenizer) -> dict:
    """The answer to a finished completions request (see the module docstring)."""
    stops = request.stop if request.stop is not None else [tokenizer.detokenize([tokenizer.eod])]
    stops = [s for s in stops if s]
    choices = [_choice(i, request, tokenizer, row, output, i, stops)
               for i, row in enumerate(payload["tokens"])]
    prompt_tokens = sum(len(row) for row in payload["tokens"])
    generated = sum(choice.pop("_generated") for choice in choices)
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
            "created": int(time.time()), "model": request.model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                      "total_tokens": prompt_tokens + generated}}
