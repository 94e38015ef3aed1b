"""GPT-2 byte-level BPE (``vocab.json`` + ``merges.txt``) encoded by tiktoken.

tiktoken's encoder is a compiled byte-pair merger that ranks candidate merges by the id of the
token they produce. ``vocab.json`` gives those ids and ``merges.txt`` their priority; for GPT-2 and
for vocabularies trained with the ``tokenizers`` library (tools/train_tokenizer.py) the ids of merge
results grow with merge priority, so the ids serve as ranks directly and tiktoken's output needs no
translation. For any other pair of files the ranks are taken from the merge order and the output is
mapped back to vocabulary ids.

The files are read here rather than through ``tiktoken.load``: that loader keeps a copy of each file
in a cache keyed by path (so a retrained vocabulary at the same path would be ignored) and accepts
only GPT-2's own id layout.
"""

import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.tokenizer.base import MegatronTokenizer

# GPT-2's pre-tokenization: contractions, letter runs, digit runs, other symbols, whitespace.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

EOD_TOKEN = "<|endoftext|>"


def byte_to_unicode() -> Dict[int, str]:
    """GPT-2's printable stand-in character for each byte value, as used in vocab.json/merges.txt.

    Printable Latin-1 bytes stand for themselves; the others (control characters, space, and a few
    more) are given the characters from U+0100 upwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def read_merges(merge_file: str) -> List[Tuple[str, str]]:
    """The merge pairs of a ``merges.txt``, in priority order (the ``#version`` line skipped)."""
    with open(merge_file, encoding="utf-8") as f:
        lines = f.read().replace("\r\n", "\n").split("\n")
    first = 1 if lines and lines[0].startswith("#version") else 0
    merges = [tuple(line.split(" ")) for line in lines[first:] if line]
    for index, pair in enumerate(merges):
        if len(pair) != 2 or not pair[0] or not pair[1]:
            raise ValueError(f"{merge_file}: merge {index + 1} is {' '.join(pair)!r}; expected two "
                             "tokens separated by one space")
    return merges


class _ByteLevelText:
    """Converts vocab.json/merges.txt token text to the bytes it stands for."""

    def __init__(self):
        self.char_of_byte = byte_to_unicode()
        self._translation = {ord(c): b for b, c in self.char_of_byte.items()}
        self._foreign = re.compile("[^" + "".join(map(re.escape, self.char_of_byte.values())) + "]")

    def to_bytes(self, tokens: List[str]) -> List[Optional[bytes]]:
        """The bytes each token stands for, or None for one that is not byte-level text (a special).

        Every stand-in character is one byte, so the tokens are converted as one joined string and
        cut apart again by length; this keeps loading a 50k vocabulary fast.
        """
        joined = "".join(tokens)
        data = joined.translate(self._translation).encode("latin-1", errors="replace")
        ends = np.cumsum([len(t) for t in tokens])
        foreign = {int(np.searchsorted(ends, m.start(), side="right"))
                   for m in self._foreign.finditer(joined)}
        starts = np.concatenate(([0], ends[:-1])).tolist()
        pieces: List[Optional[bytes]] = [data[start:end]
                                         for start, end in zip(starts, ends.tolist())]
        for index in foreign:
            pieces[index] = None
        return pieces


def mergeable_ranks(vocab: Dict[str, int], merges: List[Tuple[str, str]], merge_file: str = "merges"
                    ) -> Tuple[Dict[bytes, int], Optional[np.ndarray]]:
    """tiktoken's ``mergeable_ranks`` for a vocabulary, and the rank -> id map when ids differ.

    Returns (ranks, rank_to_id): rank_to_id is None when vocabulary ids can be used as ranks.
    """
    text = _ByteLevelText()
    single = {}
    for b in range(256):
        if text.char_of_byte[b] not in vocab:
            raise ValueError(f"the vocabulary lacks the byte token {text.char_of_byte[b]!r} "
                             f"(byte {b}); a byte-level BPE vocabulary must hold all 256 bytes")
        single[bytes([b])] = vocab[text.char_of_byte[b]]
    tokens = [left + right for left, right in merges]
    missing = [i for i, token in enumerate(tokens) if token not in vocab]
    if missing:
        left, right = merges[missing[0]]
        raise ValueError(f"{merge_file}: merge {missing[0] + 1} ({left!r} + {right!r}) makes "
                         f"{left + right!r}, which is not in the vocabulary")
    keys = text.to_bytes(tokens)
    if None in keys:
        index = keys.index(None)
        raise ValueError(f"{merge_file}: merge {index + 1} makes {tokens[index]!r}, which is not "
                         "byte-level text")
    ids = [vocab[token] for token in tokens]
    # Fast path (GPT-2, tokenizers-trained files): distinct results whose ids grow with priority.
    if len(set(keys)) == len(keys) and (len(ids) < 2 or bool(np.all(np.diff(ids) > 0))):
        return {**single, **dict(zip(keys, ids))}, None
    merged: Dict[bytes, int] = {}
    ordered: List[bytes] = []
    monotone, previous = True, -1
    for key, index in zip(keys, ids):
        if key in merged:
            continue  # a later merge producing an existing token never outranks the first one
        merged[key] = index
        ordered.append(key)
        monotone = monotone and merged[key] > previous
        previous = merged[key]
    if monotone:
        return {**single, **merged}, None
    ranks = {bytes([b]): b for b in range(256)}
    for offset, key in enumerate(ordered):
        ranks[key] = 256 + offset
    rank_to_id = np.empty(256 + len(ordered), dtype=np.int64)
    for key, rank in ranks.items():
        rank_to_id[rank] = single[key] if len(key) == 1 else merged[key]
    return ranks, rank_to_id


class GPT2BPETokenizer(MegatronTokenizer):
    """Megatron's ``GPT2BPETokenizer``: ``--vocab-file`` vocab.json and ``--merge-file`` merges.txt.

    ``<|endoftext|>`` in text is encoded as ordinary text (as Megatron does); ``eod`` is its id.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        super().__init__("GPT2 BPE")
        import tiktoken

        with open(vocab_file, encoding="utf-8") as f:
            self._vocab: Dict[str, int] = json.load(f)
        if not isinstance(self._vocab, dict):
            raise ValueError(f"{vocab_file}: expected a JSON object mapping tokens to ids")
        if EOD_TOKEN not in self._vocab:
            raise ValueError(f"{vocab_file}: the vocabulary has no {EOD_TOKEN} token, which "
                             "GPT2BPETokenizer uses as its end-of-document id")
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        if len(self._inv_vocab) != len(self._vocab):
            raise ValueError(f"{vocab_file}: two tokens share one id; every id must be unique")
        ranks, self._rank_to_id = mergeable_ranks(self._vocab, read_merges(merge_file), merge_file)
        self._encoding = tiktoken.Encoding(
            name=f"gpt2bpe:{os.path.abspath(vocab_file)}", pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks, special_tokens={})
        self._eod_id = self._vocab[EOD_TOKEN]
        self._id_to_bytes: Optional[List[bytes]] = None  # built on first detokenize

    def _decode_table(self) -> List[bytes]:
        tokens = list(self._vocab)
        table = [b""] * (max(self._inv_vocab) + 1)
        for token, as_bytes in zip(tokens, _ByteLevelText().to_bytes(tokens)):
            table[self._vocab[token]] = token.encode("utf-8") if as_bytes is None else as_bytes
        return table

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    @property
    def eod(self) -> int:
        return self._eod_id

    def tokenize(self, text: str) -> List[int]:
        ids = self._encoding.encode_ordinary(text)
        if self._rank_to_id is not None:
            ids = self._rank_to_id[np.asarray(ids, dtype=np.int64)].tolist()
        return ids

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        arrays = [self._encode_array(text) for text in texts]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.uint32)
        if self._rank_to_id is not None:
            return self._rank_to_id[flat], lengths
        return flat, lengths

    def _encode_array(self, text: str) -> np.ndarray:
        try:
            return self._encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:
            # Lone surrogates (legal in JSON escapes) cannot be passed on; encode_ordinary
            # repairs them.
            return np.asarray(self._encoding.encode_ordinary(text), dtype=np.uint32)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if self._id_to_bytes is None:
            self._id_to_bytes = self._decode_table()
        table = self._id_to_bytes
        ids = [int(i) for i in token_ids]
        for i in ids:
            if not 0 <= i < len(table):
                raise ValueError(f"token id {i} is outside the vocabulary (0..{len(table) - 1})")
        return b"".join([table[i] for i in ids]).decode("utf-8", errors="replace")
