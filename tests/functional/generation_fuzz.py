"""Random ``PUT /api`` and ``POST /completions`` bodies for fuzzing the generation server
(bounded in size and work).

The bodies are raw bytes, so they can hold what ``json.dumps`` cannot write: integers of
thousands of digits, ``NaN``, ``1e999``, invalid UTF-8, truncated JSON. About half are valid
requests for the test model (NullTokenizer ids 0..127, 32 positions) with random settings; the
rest get one thing wrong: a type, a range, an unknown or retired key, a size (too many prompts,
prompts larger than the server takes), or the JSON itself. Each generation is bounded by the
model's 32 positions and at most 4 prompts; the largest body is about 300 kB.
"""

import json
import random
from typing import List

KEYS = ["tokens_to_generate", "logprobs", "temperature", "top_k", "top_p", "add_BOS",
        "stop_token", "random_seed", "no_log", "length_penalty", "top_p_decay", "top_p_bound",
        "stop_on_eol", "stop_on_double_eol", "prevent_newline_after_colon"]
ODD_KEYS = ["top_K", "prompt", "sentences", "max_len", "beam_width", "stop_on_EOL", "",
            "prompts ", "x" * 300]


class Raw:
    """JSON text written into a body as it is."""

    def __init__(self, text: str):
        self.text = text


def _valid_value(rng: random.Random, key: str):
    return {
        "tokens_to_generate": lambda: rng.randint(0, 12),
        "logprobs": lambda: rng.random() < 0.5,
        "temperature": lambda: rng.choice([rng.uniform(0.05, 3.0), 1e-300, 1e-45, 100.0]),
        "top_k": lambda: rng.choice([0, 1, 2, 5]),
        "top_p": lambda: rng.choice([0.0, rng.uniform(0.0, 1.0)]),
        "add_BOS": lambda: rng.random() < 0.5,
        "stop_token": lambda: rng.randint(0, 128),
        "random_seed": lambda: rng.randint(0, 2 ** 40),
        "no_log": lambda: rng.random() < 0.5,
        "length_penalty": lambda: rng.uniform(0.0, 2.0),
        "top_p_decay": lambda: rng.uniform(0.0, 1.0),
        "top_p_bound": lambda: rng.uniform(0.0, 0.5),
        # The test model's NullTokenizer has no newline: True is refused, False served.
        "stop_on_eol": lambda: rng.random() < 0.5,
        "stop_on_double_eol": lambda: rng.random() < 0.5,
        "prevent_newline_after_colon": lambda: rng.random() < 0.5,
    }[key]()


def _odd_value(rng: random.Random):
    choices = [
        lambda: rng.randint(-10, 10 ** 6),
        lambda: rng.choice([2 ** 63, -2 ** 63, 2 ** 64, 1001, -1, 0]),
        lambda: Raw(rng.choice("123456789") * rng.randint(25, 5000)),
        lambda: Raw(rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "-0.0", "5e-324"])),
        lambda: rng.uniform(-1e6, 1e6),
        lambda: rng.choice([True, False, None]),
        lambda: rng.choice(["", "1", "4", "true", "\u0663", "\ud800"]),
        lambda: [rng.randint(0, 5)] * rng.randint(0, 3),
        lambda: {"a": rng.randint(0, 3)},
    ]
    return rng.choice(choices)()


def _prompt(rng: random.Random) -> str:
    ids = [rng.randint(0, 127) for _ in range(rng.randint(0, 8))]
    if rng.random() < 0.05:
        ids.append(rng.choice([128, 129, 10 ** 30, -1]))   # eod, past the vocabulary, negative
    return " ".join(map(str, ids))


def _prompts(rng: random.Random):
    r = rng.random()
    if r < 0.75:
        return [_prompt(rng) for _ in range(rng.randint(1, 4))]
    if r < 0.82:
        return ["1 " * rng.randint(1000, 150_000)]   # over 32 positions: 400, or 413 in bytes
    if r < 0.88:
        return ["1"] * rng.choice([0, 129])
    if r < 0.94:
        return [rng.choice(["one two", "\ud800", "\x00", "1\n2", " ", "\u0663"])]
    return _odd_value(rng)


def _request(rng: random.Random) -> dict:
    body = {} if rng.random() < 0.03 else {"prompts": _prompts(rng)}
    if rng.random() < 0.85:   # the default, 64, is longer than the test model's 32 positions
        body["tokens_to_generate"] = rng.randint(0, 12)
    for key in rng.sample(KEYS, rng.randint(0, 4)):
        body[key] = _valid_value(rng, key) if rng.random() < 0.8 else _odd_value(rng)
    if rng.random() < 0.1:
        body[rng.choice(ODD_KEYS)] = _odd_value(rng)
    return body


def _encode(value) -> bytes:
    """``value`` as JSON, with each :class:`Raw` written as its text (and lone surrogates as
    their escapes, which is valid JSON)."""
    raws: List[str] = []

    def swap(v):
        if isinstance(v, Raw):
            raws.append(v.text)
            return f"@raw{len(raws) - 1}@"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@raw{i}@"', raw, 1)
    return text.encode()


def _broken(rng: random.Random) -> bytes:
    good = _encode(_request(rng))
    return rng.choice([
        lambda: good[:rng.randint(0, len(good))],                      # truncated
        lambda: bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))),
        lambda: good.replace(b'"', b"\xff", 1),                         # invalid UTF-8
        lambda: rng.choice([b"null", b"[]", b"7", b'"x"', b"{}", b"", b"[" * 5000]),
        lambda: good + b" trailing",
    ])()


def fuzz_bodies(count: int, seed: int) -> List[bytes]:
    """``count`` request bodies, the same for the same seed."""
    rng = random.Random(seed)
    return [_broken(rng) if rng.random() < 0.12 else _encode(_request(rng))
            for _ in range(count)]


COMPLETION_KEYS = ["max_tokens", "temperature", "top_p", "logprobs", "echo", "seed", "stop", "n",
                   "best_of", "model", "user", "stream", "frequency_penalty", "presence_penalty",
                   "logit_bias", "suffix"]
COMPLETION_ODD_KEYS = ["prompts", "max_token", "top_k", "tokens_to_generate", "", "x" * 300]


def _valid_completion_value(rng: random.Random, key: str):
    return {
        "max_tokens": lambda: rng.randint(0, 12),
        "temperature": lambda: rng.choice([0, 0.0, rng.uniform(0.05, 3.0), 1e-300, 100.0]),
        "top_p": lambda: rng.choice([1.0, rng.uniform(1e-6, 1.0)]),
        "logprobs": lambda: rng.choice([None, 0, 1, 5, 10]),
        "echo": lambda: rng.random() < 0.5,
        "seed": lambda: rng.choice([-1, rng.randint(0, 2 ** 40)]),
        "stop": lambda: rng.choice([None, "1", " 2", ["3", ""], [], ["\n"] * 32]),
        "n": lambda: 1, "best_of": lambda: 1,
        "model": lambda: rng.choice(["m", "x" * 1000]), "user": lambda: "u",
        "stream": lambda: False, "frequency_penalty": lambda: 0,
        "presence_penalty": lambda: 0.0, "logit_bias": lambda: {}, "suffix": lambda: None,
    }[key]()


def _completion_prompt(rng: random.Random):
    r = rng.random()
    if r < 0.3:
        return _prompt(rng) or "1"
    if r < 0.5:
        return [_prompt(rng) or "1" for _ in range(rng.randint(1, 4))]
    if r < 0.65:
        return [rng.randint(0, 128) for _ in range(rng.randint(1, 8))]
    if r < 0.8:
        return [[rng.randint(0, 128) for _ in range(rng.randint(1, 8))]
                for _ in range(rng.randint(1, 4))]
    if r < 0.85:
        return [rng.choice([129, -1, 10 ** 30, 2 ** 63])] * rng.randint(1, 3)
    if r < 0.9:
        return [1] * rng.randint(30, 5000)           # longer than the 32 positions
    if r < 0.95:
        return rng.choice([[], [[]], [[1], "2"], "", [""], "one two"])
    return _odd_value(rng)


def _completion_request(rng: random.Random) -> dict:
    body = {} if rng.random() < 0.03 else {"prompt": _completion_prompt(rng)}
    if rng.random() < 0.85:   # the default, 16, with a long prompt is over the 32 positions
        body["max_tokens"] = rng.randint(0, 12)
    for key in rng.sample(COMPLETION_KEYS, rng.randint(0, 5)):
        body[key] = (_valid_completion_value(rng, key) if rng.random() < 0.8
                     else _odd_value(rng))
    if rng.random() < 0.1:
        body[rng.choice(COMPLETION_ODD_KEYS)] = _odd_value(rng)
    return body


def fuzz_completion_bodies(count: int, seed: int) -> List[bytes]:
    """``count`` ``POST /completions`` bodies, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        good = _encode(_completion_request(rng))
        if rng.random() < 0.12:
            good = rng.choice([good[:rng.randint(0, len(good))], good + b" x", b"[]", b""])
        out.append(good)
    return out
