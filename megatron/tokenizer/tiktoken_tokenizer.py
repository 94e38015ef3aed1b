"""Megatron's ``TikTokenizer``: a byte-level BPE vocabulary in Megatron's JSON layout, encoded by
tiktoken, with a block of special tokens in front.

The vocabulary file (``--tokenizer-model``) is a JSON list whose entry ``i`` is
``{"rank": i, "token_bytes": <base64 of the token's bytes>, "token_str": <its text>}``; the first
256 entries are the single bytes 0..255 in order, and a token's rank is its merge priority.

Ids: ``--tiktoken-num-special-tokens`` S (default 1000) special tokens take ids 0..S-1: the
``--tokenizer-special-tokens`` names in order (by default ``<unk> <s> </s> <mask> <pad> <cls>
<sep>``), then fillers ``<SPECIAL_k>`` up to S. The regular token of rank r has id S + r, and
only the first ``--vocab-size`` - S entries of the file are used (``--vocab-size`` defaults to
2**17, Megatron's). ``bos`` is ``<s>``, ``eos`` and ``eod`` are ``</s>``. As Megatron-Core's
tokenizer does, the text of a special token inside the input is encoded as that token.
"""

import base64
import binascii
import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.tokenizer.base import MegatronTokenizer

# --tiktoken-pattern: the pre-tokenization regex (v1, and v2 which splits camel case and keeps
# a newline run to itself).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
DEFAULT_VOCAB_SIZE = 2 ** 17
DEFAULT_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def read_tiktoken_vocab(path: str, max_entries: Optional[int] = None) -> Dict[bytes, int]:
    """Token bytes -> rank from a Megatron tiktoken vocabulary JSON (its first ``max_entries``
    entries when given); errors name the file and the entry."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err.msg} at line {err.lineno}); expected a "
                         "tiktoken vocabulary list") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of {{\"rank\", \"token_bytes\", "
                         f"\"token_str\"}} entries, got a {type(entries).__name__}")
    if max_entries is not None:
        entries = entries[:max_entries]
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"}:
            keys = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
            raise ValueError(f"{path}: entry {i} has {keys}; expected exactly the keys rank, "
                             "token_bytes, token_str")
        if entry["rank"] != i:
            raise ValueError(f"{path}: entry {i} has rank {entry['rank']!r}; ranks must be "
                             "0, 1, 2, ... in order")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise ValueError(f"{path}: entry {i}: token_bytes {entry['token_bytes']!r} is not "
                             "base64") from None
        if i < 256 and token != bytes([i]):
            raise ValueError(f"{path}: entry {i} is {token!r}; the first 256 entries must be the "
                             f"single bytes in order (expected {bytes([i])!r})")
        if token in ranks:
            raise ValueError(f"{path}: entry {i} repeats the token {token!r} of entry "
                             f"{ranks[token]}")
        ranks[token] = i
    return ranks


def _special_tokens(names: Optional[Sequence[str]], count: int) -> List[str]:
    names = list(DEFAULT_SPECIAL_TOKENS if names is None else names)
    if len(set(names)) != len(names):
        raise ValueError(f"--tokenizer-special-tokens {' '.join(names)}: a token is named twice")
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in names]
    if missing:
        raise ValueError(f"--tokenizer-special-tokens must include {' '.join(missing)} "
                         f"(got {' '.join(names)})")
    if len(names) > count:
        raise ValueError(f"--tiktoken-num-special-tokens {count} is fewer than the "
                         f"{len(names)} special tokens named")
    filler = [f"<SPECIAL_{k}>" for k in range(len(names), count)]
    if set(filler) & set(names):
        raise ValueError(f"--tokenizer-special-tokens names a filler token "
                         f"({sorted(set(filler) & set(names))[0]})")
    return names + filler


class TikTokenizer(MegatronTokenizer):
    """See the module docstring; ``path`` is ``--tokenizer-model``."""

    def __init__(self, path: str, pattern: str, vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000,
                 special_tokens: Optional[Sequence[str]] = None):
        super().__init__("TikToken")
        import tiktoken

        if pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern!r}: expected v1 or v2")
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        if not 0 < num_special_tokens < vocab_size:
            raise ValueError(f"--tiktoken-num-special-tokens {num_special_tokens} must be "
                             f"between 1 and --vocab-size {vocab_size} - 1")
        specials = _special_tokens(special_tokens, num_special_tokens)
        inner = vocab_size - num_special_tokens
        ranks = read_tiktoken_vocab(path, inner)
        if len(ranks) < inner:
            raise ValueError(f"{path}: holds {len(ranks)} tokens, but --vocab-size {vocab_size} "
                             f"less --tiktoken-num-special-tokens {num_special_tokens} needs "
                             f"{inner}; pass --vocab-size {len(ranks) + num_special_tokens}")
        self._special_ids = {t: i for i, t in enumerate(specials)}
        self._ids = {t: r + num_special_tokens for t, r in ranks.items()}
        self._encoding = tiktoken.Encoding(
            name=f"tiktoken:{os.path.abspath(path)}:{vocab_size}",
            pat_str=TIKTOKEN_PATTERNS[pattern], mergeable_ranks=self._ids,
            special_tokens=self._special_ids)
        self._vocab_size = vocab_size
        self._num_special = num_special_tokens
        self._vocab: Optional[Dict[str, int]] = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_special_tokens(self) -> int:
        return self._num_special

    @property
    def vocab(self) -> Dict[str, int]:
        """Token text -> id: the special tokens' names, and each regular token's bytes read as
        UTF-8 (with replacement characters where they are not whole characters)."""
        if self._vocab is None:
            table = {t.decode("utf-8", errors="replace"): i for t, i in self._ids.items()}
            table.update(self._special_ids)
            self._vocab = table
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: t for t, i in self.vocab.items()}

    def tokenize(self, text: str) -> List[int]:
        return self._encoding.encode(text, allowed_special="all")

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        pieces = self._encoding.encode_batch(list(texts), allowed_special="all")
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        flat = np.fromiter((i for p in pieces for i in p), dtype=np.int64,
                           count=int(lengths.sum()))
        return flat, lengths

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in token_ids], errors="replace")

    def _special(self, name: str) -> int:
        if name not in self._special_ids:
            return self._missing(f"{name} (not among --tokenizer-special-tokens)")
        return self._special_ids[name]

    @property
    def unk(self) -> int:
        return self._special("<unk>")

    @property
    def bos(self) -> int:
        return self._special("<s>")

    @property
    def eos(self) -> int:
        return self._special("</s>")

    @property
    def eod(self) -> int:
        return self._special("</s>")

    @property
    def pad(self) -> int:
        return self._special("<pad>")

    @property
    def mask(self) -> int:
        return self._special("<mask>")

    @property
    def cls(self) -> int:
        return self._special("<cls>")

    @property
    def sep(self) -> int:
        return self._special("<sep>")
