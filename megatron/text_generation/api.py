"""Megatron's generation request (``PUT /api`` JSON) and response, and running one on all ranks.

A request::

    {"prompts": ["Hello", ...], "tokens_to_generate": 64, "logprobs": false,
     "temperature": 1.0, "top_k": 0, "top_p": 0.0, "top_p_decay": 0.0, "top_p_bound": 0.0,
     "add_BOS": false, "stop_on_eol": false, "stop_on_double_eol": false,
     "prevent_newline_after_colon": false,
     "stop_token": <id, default the tokenizer's end-of-document>, "random_seed": <int >= 0>}

Only ``prompts`` is required. ``top_k = 1`` is greedy; ``top_k = 0`` with ``top_p = 0`` samples
from the whole distribution (Megatron's defaults). As in Megatron, ``top_p`` shrinks by
``top_p_decay`` after each token, never below ``top_p_bound``; ``stop_on_eol`` ends a sequence
at a newline (``stop_on_double_eol``: at a blank line) instead of at the stop token, and
``prevent_newline_after_colon`` never lets a newline follow ':'. Megatron hard-codes GPT-2's
ids for those (198, 628); here they are the ids the server's tokenizer gives "\\n", "\\n\\n" and
":" (the same with GPT-2's tokenizer), and a tokenizer without such a token refuses the key.
The response::

    {"text": [prompt + generation, ...], "segments": [[one string per token], ...],
     "logprobs": [[log p of each token after the first], ...] or null, "tokens": [[ids], ...]}

Each sequence ends after its stop token when it emitted one. A bad request raises
:class:`RequestError` (a ``ValueError``) before any rank is involved; the server answers it with
HTTP 400 (413, :class:`RequestTooLarge`, when a prompt has more bytes than could fit the model,
checked before anything is tokenized). Keys other than Megatron's are refused, naming them, so a
misspelt ``top_K`` is never silently ignored; ``no_log`` is accepted.

``beam_width`` (one prompt; ``length_penalty``, ``stop_token``, ``add_BOS`` and
``prevent_newline_after_colon`` apply) runs Megatron's beam search
(:mod:`megatron.text_generation.beam_search`) and answers ``{"text", "segments", "scores",
"tokens"}``, one entry per hypothesis, best first; each ends at its stop token (Megatron
returns the padding after it too). The sampling keys, ``logprobs`` and the line stops, which
Megatron ignores with a beam, are refused with one.

Running a request on every rank: rank 0 validates and tokenizes it into a *payload* (plain JSON:
token ids and settings), :func:`broadcast_payload` gives it to every rank, and
:func:`generate_from_payload` runs the generation there; rank 0 turns the result into the
response with :func:`post_process`.
"""

import difflib
import json
import random
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.text_generation.beam_search import BeamOutput, beam_search
from megatron.text_generation.generation import (EolStop, GenerationOutput, generate_tokens,
                                                  score_tokens)

MAX_PROMPTS = 128
MAX_TOP_K = 1000
MAX_TEMPERATURE = 100.0
DEFAULT_TOKENS_TO_GENERATE = 64
DEFAULT_MAX_TOKENS_TO_OOM = 12000

# A token is rarely more than a few bytes of text and never near this many, so a prompt longer
# than max_position_embeddings x this cannot fit the model whatever the tokenizer: it is refused
# before the (slow) tokenizer sees it.
MAX_PROMPT_BYTES_PER_TOKEN = 128
# Longer integer literals are refused by name instead of by Python's int() conversion limit.
MAX_INT_DIGITS = 30

# Megatron request keys whose features this server does not offer: refused rather than ignored,
# so a client never silently gets something else than it asked for.
UNSUPPORTED = ()
SERVED = ("prompts", "tokens_to_generate", "logprobs", "temperature", "top_k", "top_p",
          "top_p_decay", "top_p_bound", "add_BOS", "stop_on_eol", "stop_on_double_eol",
          "prevent_newline_after_colon", "stop_token", "random_seed", "no_log", "beam_width",
          "length_penalty")
# What beam search does not do (it never samples, returns scores, stops at the stop token):
# set with beam_width, refused rather than ignored.
NOT_WITH_BEAMS = {"temperature": 1.0, "top_k": 0, "top_p": 0.0, "top_p_decay": 0.0,
                  "top_p_bound": 0.0, "logprobs": False, "stop_on_eol": False,
                  "stop_on_double_eol": False}
# Megatron's old names, refused with a message saying what replaced them.
RENAMED = {"sentences": "prompts", "max_len": "tokens_to_generate"}
KNOWN_KEYS = frozenset(SERVED + UNSUPPORTED + tuple(RENAMED))


class RequestError(ValueError):
    """A generation request that cannot be served; the message is the HTTP 400 answer."""


class RequestTooLarge(RequestError):
    """A request larger than the server takes (HTTP 413)."""


class LongInteger:
    """An integer literal of more than :data:`MAX_INT_DIGITS` digits in a request body, kept as
    text: no field takes one, and each field's check names itself when it meets one."""

    def __init__(self, literal: str):
        self.digits = len(literal.lstrip("-"))

    def __str__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(literal: str):
    return LongInteger(literal) if len(literal) > MAX_INT_DIGITS else int(literal)


def decode_body(raw: bytes):
    """A request body's JSON; raises :class:`RequestError` for anything that is not JSON."""
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError("the request body is not valid JSON: nested too deeply") from None


def _show(value) -> str:
    """A value as the client sent it, cut short, for an error message."""
    return json.dumps(value, default=str)[:80]


@dataclass
class GenerationRequest:
    """A validated ``PUT /api`` request (see the module docstring)."""

    prompts: List[str]
    tokens_to_generate: int = DEFAULT_TOKENS_TO_GENERATE
    logprobs: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    add_BOS: bool = False
    stop_token: Optional[int] = None
    random_seed: Optional[int] = None
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    stop_on_eol: bool = False
    stop_on_double_eol: bool = False
    prevent_newline_after_colon: bool = False
    beam_width: Optional[int] = None
    length_penalty: float = 1.0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _get(body: dict, key: str, default, valid, message: str):
    if key not in body:
        return default
    value = body[key]
    if not valid(value):
        raise RequestError(f"{message}, got {_show(value)}")
    return value


def suggest_key(key: str, served=SERVED) -> str:
    """``'key'``, with the key of ``served`` it probably meant (case first, then spelling)."""
    lowered = {name.lower(): name for name in served}
    close = difflib.get_close_matches(key.lower(), list(lowered), n=1, cutoff=0.6)
    if key.lower() in lowered:
        close = [key.lower()]
    shown = repr(key) if len(key) <= 40 else repr(key[:40]) + "..."
    return f"{shown} (did you mean {lowered[close[0]]!r}?)" if close else shown


def _check_keys(body: dict) -> None:
    unknown = sorted(key for key in body if key not in KNOWN_KEYS)
    if unknown:
        hints = [suggest_key(key) for key in unknown]
        raise RequestError(f"unknown request key(s) {', '.join(hints)}; the keys are "
                           f"{', '.join(SERVED)}")
    for old, new in RENAMED.items():
        if old in body:
            raise RequestError(f"{old} is no longer used. Replace with {new}")
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False):
            raise RequestError(f"{key} is not supported by this server")


def _check_prompts(body: dict) -> List[str]:
    if "prompts" not in body:
        raise RequestError("prompts argument required")
    prompts = body["prompts"]
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompts is not a list of strings")
    if not prompts:
        raise RequestError("prompts is empty")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"Maximum number of prompts is {MAX_PROMPTS}, got {len(prompts)}")
    return prompts


def parse_request(body) -> GenerationRequest:
    """Check a decoded ``PUT /api`` body's keys, types and ranges; raise :class:`RequestError`
    naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_keys(body)
    prompts = _check_prompts(body)
    tokens_to_generate = _get(body, "tokens_to_generate", DEFAULT_TOKENS_TO_GENERATE,
                              lambda v: _is_int(v) and v >= 0,
                              "tokens_to_generate must be an integer greater than or equal to 0")
    logprobs = _get(body, "logprobs", False, lambda v: isinstance(v, bool),
                    "logprobs must be a boolean value")
    if tokens_to_generate == 0 and not logprobs:
        raise RequestError("tokens_to_generate=0 implies logprobs should be True")
    temperature = _get(body, "temperature", 1.0,
                       lambda v: _is_number(v) and 0.0 < v <= MAX_TEMPERATURE,
                       f"temperature must be a positive number less than or equal to "
                       f"{MAX_TEMPERATURE}")
    top_k = _get(body, "top_k", 0, lambda v: _is_int(v) and 0 <= v <= MAX_TOP_K,
                 f"top_k must be an integer equal to or greater than 0 and less than or equal "
                 f"to {MAX_TOP_K}")
    top_p = _get(body, "top_p", 0.0, lambda v: _is_number(v) and 0.0 <= v <= 1.0,
                 "top_p must be a number between 0 and 1.0")
    if top_k > 0 and top_p > 0.0:
        raise RequestError("cannot set both top-k and top-p samplings.")
    top_p_decay = _get(body, "top_p_decay", 0.0, lambda v: _is_number(v) and 0.0 <= v <= 1.0,
                       "top_p_decay must be a number between 0 and 1.0")
    top_p_bound = _get(body, "top_p_bound", 0.0, lambda v: _is_number(v) and 0.0 <= v <= 1.0,
                       "top_p_bound must be a number between 0 and 1.0")
    for key, value in (("top_p_decay", top_p_decay), ("top_p_bound", top_p_bound)):
        if value > 0.0 and top_p == 0.0:
            raise RequestError(f"{key} cannot be set without top_p")
    if top_p_bound > top_p:
        raise RequestError(f"top_p_bound must be greater than 0 and at most top_p ({top_p}), "
                           f"got {_show(top_p_bound)}")
    flags = {key: _get(body, key, False, lambda v: isinstance(v, bool),
                       f"{key} must be a boolean value")
             for key in ("stop_on_eol", "stop_on_double_eol", "prevent_newline_after_colon")}
    add_bos = _get(body, "add_BOS", False, lambda v: isinstance(v, bool),
                   "add_BOS must be a boolean value")
    if not add_bos and any(len(p) == 0 for p in prompts):
        raise RequestError("Empty prompts require add_BOS=true")
    stop_token = _get(body, "stop_token", None, lambda v: v is None or (_is_int(v) and v >= 0),
                      "stop_token must be an integer token id")
    random_seed = _get(body, "random_seed", None,
                       lambda v: v is None or (_is_int(v) and 0 <= v < 2 ** 63),
                       "random_seed must be an integer in [0, 2**63)")
    _get(body, "no_log", False, lambda v: isinstance(v, bool), "no_log must be a boolean value")
    length_penalty = _get(body, "length_penalty", 1.0, _is_number,
                          "length_penalty must be a number")
    beam_width = _get(body, "beam_width", None, lambda v: v is None or (_is_int(v) and v >= 1),
                      "beam_width must be an integer > 0")
    if beam_width is not None:
        if len(prompts) > 1:
            raise RequestError("When doing beam_search, batch size must be 1")
        if tokens_to_generate == 0:
            raise RequestError("beam_width needs tokens_to_generate > 0")
        values = dict(flags, temperature=temperature, top_k=top_k, top_p=top_p,
                      top_p_decay=top_p_decay, top_p_bound=top_p_bound, logprobs=logprobs)
        for key, default in NOT_WITH_BEAMS.items():
            if values[key] != default:
                raise RequestError(f"{key} does not apply to beam search (beam_width): beam "
                                   "search never samples, returns scores instead of logprobs "
                                   "and ends beams at the stop token; drop it")
    return GenerationRequest(prompts, tokens_to_generate, logprobs, float(temperature), top_k,
                             float(top_p), add_bos, stop_token, random_seed, float(top_p_decay),
                             float(top_p_bound), **flags, beam_width=beam_width,
                             length_penalty=float(length_penalty))


def single_token_id(tokenizer, text: str, key: str, first: bool = False) -> int:
    """The id ``text`` tokenizes to (its first with ``first``, as Megatron takes ':' and the
    newline); a :class:`RequestError` naming ``key`` when there is none to take."""
    try:
        ids = list(tokenizer.tokenize(text))
    except (ValueError, KeyError, NotImplementedError):
        ids = []
    if ids and (first or len(ids) == 1):
        return int(ids[0])
    raise RequestError(f"{key} needs {text!r} to be one token, and this server's tokenizer "
                       f"makes it {ids or 'no token'}")


def _line_settings(request: GenerationRequest, tokenizer) -> dict:
    """The payload's line-end stop and banned-newline ids, from the tokenizer (Megatron's are
    GPT-2's: newline 198, blank line 628, which is what GPT-2's tokenizer gives here)."""
    out = {"eol_stop": None, "banned_after": None}
    if request.stop_on_eol or request.stop_on_double_eol:
        key = "stop_on_double_eol" if request.stop_on_double_eol else "stop_on_eol"
        eol = single_token_id(tokenizer, "\n", key)
        try:
            blank = single_token_id(tokenizer, "\n\n", key)
        except RequestError:
            blank = None      # a blank line is two newline tokens: the double check finds it
        out["eol_stop"] = [eol, blank, request.stop_on_double_eol]
    if request.prevent_newline_after_colon:
        key = "prevent_newline_after_colon"
        out["banned_after"] = [single_token_id(tokenizer, ":", key, first=True),
                               single_token_id(tokenizer, "\n", key, first=True)]
    return out


def _tokenize(request: GenerationRequest, tokenizer) -> List[List[int]]:
    rows = []
    for i, prompt in enumerate(request.prompts):
        try:
            ids = list(tokenizer.tokenize(prompt))
        except ValueError as err:
            raise RequestError(f"prompts[{i}] cannot be tokenized: {err}") from None
        if request.add_BOS:
            ids = [tokenizer.eod] + ids
        if not ids:
            raise RequestError(f"prompts[{i}] has no tokens; set add_BOS=true to start from "
                               f"the end-of-document token")
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(f"prompts[{i}] has token ids outside the vocabulary "
                               f"[0, {tokenizer.vocab_size}): {bad[:5]}")
        rows.append(ids)
    return rows


def check_prompt_bytes(prompts: List[str], max_position_embeddings: int,
                       max_tokens_to_oom: int = DEFAULT_MAX_TOKENS_TO_OOM,
                       key: str = "prompts") -> None:
    """Refuse, before tokenizing, prompts with more bytes than could fit the model.

    Raises :class:`RequestTooLarge` naming the first prompt longer than ``max_position_embeddings``
    x :data:`MAX_PROMPT_BYTES_PER_TOKEN` bytes, or when all of them together exceed
    ``max_tokens_to_oom`` x that.
    """
    per_prompt = max_position_embeddings * MAX_PROMPT_BYTES_PER_TOKEN
    total = 0
    for i, prompt in enumerate(prompts):
        # Lone surrogates are legal in JSON strings; count them instead of failing on them.
        size = len(prompt.encode("utf-8", "surrogatepass"))
        if size > per_prompt:
            raise RequestTooLarge(
                f"{key}[{i}] is {size} bytes; a prompt that fits the model's "
                f"--max-position-embeddings ({max_position_embeddings}) has at most {per_prompt}")
        total += size
    if total > max_tokens_to_oom * MAX_PROMPT_BYTES_PER_TOKEN:
        raise RequestTooLarge(
            f"the {key} are {total} bytes together; prompts that fit --max-tokens-to-oom "
            f"({max_tokens_to_oom} tokens) have at most "
            f"{max_tokens_to_oom * MAX_PROMPT_BYTES_PER_TOKEN}")


def check_fits(rows: List[List[int]], tokens_to_generate: int, max_position_embeddings: int,
               max_tokens_to_oom: int, key: str = "tokens_to_generate") -> None:
    """Refuse (:class:`RequestError`) token rows that, with ``tokens_to_generate`` more each,
    are longer than the model takes or hold more tokens than ``--max-tokens-to-oom``; ``key``
    is the request's name for the tokens to generate."""
    longest = max(len(r) for r in rows)
    total = longest + tokens_to_generate
    if total > max_position_embeddings:
        raise RequestError(
            f"the longest prompt ({longest} tokens) + {key} ({tokens_to_generate}) = {total} "
            f"is longer than the model's --max-position-embeddings ({max_position_embeddings})")
    if total * len(rows) > max_tokens_to_oom:
        raise RequestError(
            f"Too many tokens: {len(rows)} prompts x {total} tokens = {total * len(rows)} "
            f"exceeds --max-tokens-to-oom ({max_tokens_to_oom}); send fewer prompts or "
            f"{key}")


def prepare_payload(request: GenerationRequest, tokenizer, max_position_embeddings: int,
                    max_tokens_to_oom: int = DEFAULT_MAX_TOKENS_TO_OOM) -> dict:
    """Tokenize a request and check it fits the model; returns what every rank needs.

    Raises :class:`RequestError` when a prompt plus ``tokens_to_generate`` is longer than
    ``max_position_embeddings``, the batch holds more than ``max_tokens_to_oom`` tokens or
    ``top_k`` is larger than the vocabulary; :class:`RequestTooLarge` (before tokenizing) when
    the prompts have more bytes than could fit.
    """
    check_prompt_bytes(request.prompts, max_position_embeddings, max_tokens_to_oom)
    if request.beam_width is not None and request.beam_width >= tokenizer.vocab_size:
        raise RequestError(f"beam_width ({request.beam_width}) must be smaller than the "
                           f"vocabulary ({tokenizer.vocab_size} tokens)")
    if request.top_k > tokenizer.vocab_size:
        raise RequestError(f"top_k ({request.top_k}) is larger than the vocabulary "
                           f"({tokenizer.vocab_size} tokens)")
    rows = _tokenize(request, tokenizer)
    check_fits(rows, request.tokens_to_generate, max_position_embeddings, max_tokens_to_oom)
    stop_token = tokenizer.eod if request.stop_token is None else request.stop_token
    if not 0 <= stop_token < tokenizer.vocab_size:
        raise RequestError(f"stop_token must be a token id in [0, {tokenizer.vocab_size}), "
                           f"got {stop_token}")
    seed = request.random_seed
    if seed is None:
        seed = random.SystemRandom().randrange(2 ** 63)
    return {"tokens": rows, "tokens_to_generate": request.tokens_to_generate,
            "logprobs": request.logprobs, "temperature": request.temperature,
            "top_k": request.top_k, "top_p": request.top_p, "stop_token": stop_token,
            "random_seed": seed, "vocab_size": tokenizer.vocab_size, "pad_token": tokenizer.eod,
            "top_p_decay": request.top_p_decay, "top_p_bound": request.top_p_bound,
            "beam_width": request.beam_width, "length_penalty": request.length_penalty,
            **_line_settings(request, tokenizer)}


def broadcast_payload(payload: Optional[dict], device, src: int = 0) -> dict:
    """Global rank ``src``'s payload on every rank of the job (JSON bytes, no pickle): every
    rank of every model copy runs the request, so the group is the whole world, by name."""
    group = dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return payload
    is_src = dist.get_rank() == src
    data = json.dumps(payload).encode() if is_src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if is_src:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=src, group=group)
    return payload if is_src else json.loads(buffer.cpu().numpy().tobytes().decode())


def generate_from_payload(model, pstate, payload: dict, device,
                          use_kv_cache: bool = True) -> GenerationOutput:
    """Run a payload on this rank (every rank of the model calls this with the same payload)."""
    rows = payload["tokens"]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=device)
    total = max(len(r) for r in rows) + payload["tokens_to_generate"]
    tokens = torch.full((len(rows), total), payload["pad_token"], dtype=torch.int64,
                        device=device)
    for i, row in enumerate(rows):
        tokens[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    top_k = payload.get("top_logprobs", 0)
    if payload["tokens_to_generate"] == 0:
        return score_tokens(model, pstate, tokens, lengths, payload["vocab_size"], top_k=top_k)
    banned_after = payload.get("banned_after")
    if payload.get("beam_width"):
        return beam_search(model, pstate, rows[0],
                           tokens_to_generate=payload["tokens_to_generate"],
                           beam_width=payload["beam_width"], stop_token=payload["stop_token"],
                           vocab_size=payload["vocab_size"], pad_token=payload["pad_token"],
                           length_penalty=payload["length_penalty"],
                           banned_after=tuple(banned_after) if banned_after else None,
                           device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(payload["random_seed"])
    eol_stop = payload.get("eol_stop")
    output = generate_tokens(
        model, pstate, tokens, lengths, vocab_size=payload["vocab_size"],
        stop_token=payload["stop_token"], top_k=payload["top_k"], top_p=payload["top_p"],
        temperature=payload["temperature"], return_log_probs=payload["logprobs"],
        use_kv_cache=use_kv_cache, generator=generator,
        top_p_decay=payload.get("top_p_decay", 0.0), top_p_bound=payload.get("top_p_bound", 0.0),
        eol_stop=EolStop(*eol_stop) if eol_stop else None,
        banned_after=tuple(banned_after) if banned_after else None)
    if top_k:
        # The most likely tokens at every position, and the chosen ones' log-probabilities
        # with them, from one forward over the finished sequences (the completions endpoint).
        scored = score_tokens(model, pstate, output.tokens, output.lengths,
                              payload["vocab_size"], top_k=top_k)
        output = GenerationOutput(output.tokens, output.lengths, scored.log_probs,
                                  output.finished, scored.top_log_probs, scored.top_ids)
    return output


def post_process(output, tokenizer, return_logprobs: bool) -> dict:
    """The response JSON of a finished generation (see the module docstring)."""
    if isinstance(output, BeamOutput):
        return {"text": [tokenizer.detokenize(ids) for ids in output.tokens],
                "segments": [[tokenizer.detokenize([t]) for t in ids] for ids in output.tokens],
                "scores": output.scores, "tokens": output.tokens}
    texts, segments, logprobs, tokens = [], [], [], []
    for i in range(output.tokens.size(0)):
        ids = output.tokens[i, :int(output.lengths[i])].tolist()
        tokens.append(ids)
        texts.append(tokenizer.detokenize(ids))
        segments.append([tokenizer.detokenize([t]) for t in ids])
        if return_logprobs:
            logprobs.append(output.log_probs[i, :len(ids) - 1].tolist())
    return {"text": texts, "segments": segments,
            "logprobs": logprobs if return_logprobs else None, "tokens": tokens}
