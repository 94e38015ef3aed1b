"""Evaluation data of the zero-shot GPT tasks: rolling windows for perplexity, LAMBADA examples.

Every sample is ``(text, mask)``: ``text`` holds ``seq_length + 1`` token ids (inputs are
``text[:-1]``, targets ``text[1:]``) and ``mask`` says which of the ``seq_length`` targets are
scored. Short samples are padded with the end-of-document id and a zero mask, so every
micro-batch has the fixed shape that pipeline stages exchange.

Input files:

* perplexity (``--task WIKITEXT103``): a plain text file, read and tokenized as one stream (the
  WikiText-103 ``wiki.test.tokens`` files); a JSONL file (``.jsonl`` / ``.json``) with one
  ``{"text": ...}`` document per line, each document followed by the end-of-document token as
  ``tools/preprocess_data.py --append-eod`` writes it; or ``PREFIX`` of a ``PREFIX.bin`` /
  ``PREFIX.idx`` dataset, whose sequences are read in order.
* ``--task LAMBADA``: JSONL, one ``{"text": ...}`` passage per line; the target is the last word.
"""

import json
import math
import os
import re
from typing import Callable, List, Optional, Tuple

import numpy as np

from megatron.data.dataset_utils import DataError
from megatron.data.indexed_dataset import IndexedDataset, get_idx_path

JSONL_SUFFIXES = (".jsonl", ".json")

# Raw WikiText / Penn Treebank text separates punctuation and number separators by spaces
# ("1 @,@ 000", "word , word"); it is joined back before tokenizing, with the same rules in the
# same order as Megatron-LM's zero-shot evaluation, so perplexities agree with it. Each rule is
# (is_regex, pattern, replacement).
_WIKITEXT_RULES = (
    (False, "s '", "s'"),
    (True, r"/' [0-9]/", r"/'[0-9]/"),
    (False, " @-@ ", "-"), (False, " @,@ ", ","), (False, " @.@ ", "."),
    (False, " : ", ": "), (False, " ; ", "; "), (False, " . ", ". "), (False, " ! ", "! "),
    (False, " ? ", "? "), (False, " , ", ", "),
    (True, r"\(\s*([^\)]*?)\s*\)", r"(\1)"), (True, r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
    (True, r"{\s*([^}]*?)\s*}", r"{\1}"), (True, r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
    (True, r"'\s*([^']*?)\s*'", r"'\1'"),
    (False, "= = = =", "===="), (False, "= = =", "==="), (False, "= =", "=="),
    (False, " \u00b0 ", "\u00b0"), (False, " \n", "\n"), (False, "\n ", "\n"),
    (False, " N ", " 1 "), (False, " 's", "'s"),
)
_PTB_RULES = (
    (False, " '", "'"), (False, " \n", "\n"), (False, "\n ", "\n"), (False, " n't", "n't"),
    (False, " N ", "1 "), (False, "$ 1", "$1"), (False, "# 1", "#1"),
)


def _apply_rules(rules, text: str) -> str:
    for is_regex, pattern, replacement in rules:
        text = re.sub(pattern, replacement, text) if is_regex else \
            text.replace(pattern, replacement)
    return text


def get_detokenizer(path: str) -> Callable[[str], str]:
    """The detokenizer a file's name asks for: "ptb" or "wiki" in the file name select the
    Penn Treebank or WikiText rules; any other text is used as it is."""
    name = os.path.basename(path)
    if "ptb" in name:
        return lambda text: _apply_rules(_PTB_RULES, text)
    if "wiki" in name:
        return lambda text: _apply_rules(_WIKITEXT_RULES, text)
    return lambda text: text


def is_indexed_prefix(path: str) -> bool:
    """``path`` names a ``.bin``/``.idx`` dataset by its prefix."""
    return os.path.isfile(get_idx_path(path))


def is_jsonl(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES)


def read_jsonl_texts(path: str) -> List[Tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of a JSONL file.

    Raises:
        DataError: naming the file and line of a line that is not JSON or has no string under
            ``"text"``.
    """
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not valid JSON ({err.msg} at column "
                                f"{err.colno}); expected one object like {{\"text\": \"...\"}} "
                                "per line") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                seen = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(f"{path}:{number}: no string under \"text\" (found {seen}); "
                                "expected one object like {\"text\": \"...\"} per line")
            texts.append((number, text))
    return texts


def count_words(text: str) -> int:
    """Words of the original text as the adjusted perplexity counts them: pieces between single
    spaces of the stripped text."""
    return len(text.strip().split(" "))


class LMWindowDataset:
    """Rolling windows over one token stream for perplexity.

    Window ``i`` starts at token ``i * stride`` and holds ``seq_length + 1`` tokens. The first
    window scores all its targets; every later one scores only its last ``stride`` targets, each
    seen with at least ``seq_length - stride`` tokens of context. So every token after the first
    is scored exactly once. ``stride == seq_length`` gives consecutive, non-overlapping windows.

    Args:
        tokens: the token ids of the whole text.
        seq_length: the model's ``--seq-length``.
        pad_id: id written into the padding of the last window (never scored).
        stride: ``--overlapping-eval``, 1 to ``seq_length``.
        num_original_tokens: words of the original text (for the adjusted perplexity); None when
            there is no original text (a ``.bin``/``.idx`` dataset).
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, pad_id: int, stride: int,
                 num_original_tokens: Optional[int] = None):
        if not 1 <= stride <= seq_length:
            raise ValueError(f"stride must be in 1..{seq_length}, got {stride}")
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.stride = stride
        self.num_tokenized_tokens = len(self.tokens)
        self.num_original_tokens = (num_original_tokens if num_original_tokens is not None
                                    else self.num_tokenized_tokens)
        targets = self.num_tokenized_tokens - 1
        self.num_windows = 1 + max(0, math.ceil((targets - seq_length) / stride))

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        start = idx * self.stride
        window = self.tokens[start:start + self.seq_length + 1]
        text = np.full(self.seq_length + 1, self.pad_id, dtype=np.int64)
        text[:len(window)] = window
        mask = np.zeros(self.seq_length, dtype=np.float32)
        mask[:len(window) - 1] = 1.0
        if idx > 0:
            mask[:self.seq_length - self.stride] = 0.0
        return text, mask


class LambadaDataset:
    """LAMBADA passages: a context and the tokens of its last word, all of which are scored.

    Without ``strict`` the passage is tokenized whole and its last token is the target. With
    ``strict`` the target is the last whitespace-separated word: the text before it (stripped)
    and ``" " + word`` are tokenized separately, so the target is every token of the word.

    Raises:
        DataError: naming the file and line of a passage with no context or too long for
            ``--seq-length``.
    """

    def __init__(self, path: str, tokenizer, seq_length: int, strict: bool = False):
        self.seq_length = seq_length
        self.pad_id = tokenizer.eod
        self.strict = strict
        self.examples: List[Tuple[List[int], List[int]]] = []
        for number, text in read_jsonl_texts(path):
            context, target = self.split(text, tokenizer, path, number)
            if len(context) + len(target) > seq_length + 1:
                raise DataError(
                    f"{path}:{number}: passage has {len(context) + len(target)} tokens, more "
                    f"than --seq-length + 1 = {seq_length + 1}")
            self.examples.append((context, target))

    def split(self, text: str, tokenizer, path: str, number: int
              ) -> Tuple[List[int], List[int]]:
        """``(context tokens, target tokens)`` of one passage."""
        words = text.split()
        if not words:
            raise DataError(f"{path}:{number}: empty \"text\"; expected a passage")
        if self.strict:
            last = words[-1]
            context = list(tokenizer.tokenize(text[:text.rfind(last)].strip()))
            target = list(tokenizer.tokenize(" " + last))
        else:
            tokens = list(tokenizer.tokenize(text))
            context, target = tokens[:-1], tokens[-1:]
        if not context or not target:
            raise DataError(f"{path}:{number}: the passage has no token before its last "
                            f"{'word' if self.strict else 'token'}, so there is nothing to "
                            "predict it from")
        return context, target

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, idx: int) -> Tuple[np.ndarray, np.ndarray]:
        context, target = self.examples[idx]
        tokens = context + target
        text = np.full(self.seq_length + 1, self.pad_id, dtype=np.int64)
        text[:len(tokens)] = tokens
        mask = np.zeros(self.seq_length, dtype=np.float32)
        # Target token j sits at position len(context) + j of text, i.e. label position - 1.
        mask[len(context) - 1:len(tokens) - 1] = 1.0
        return text, mask


def _indexed_stream(prefix: str, limit: int) -> np.ndarray:
    dataset = IndexedDataset(prefix)
    if len(dataset) == 0:
        return np.zeros(0, dtype=np.int64)
    tokens = np.concatenate(dataset[0:len(dataset)]).astype(np.int64)
    if tokens.size and (tokens.max() >= limit or tokens.min() < 0):
        bad = int(tokens.max() if tokens.max() >= limit else tokens.min())
        raise DataError(f"{get_idx_path(prefix)}: token id {bad} is outside the model's "
                        f"vocabulary 0..{limit - 1} (--vocab-size / tokenizer)")
    return tokens


def _jsonl_stream(path: str, tokenizer, detokenize) -> Tuple[np.ndarray, int]:
    pieces, words = [], 0
    for _, text in read_jsonl_texts(path):
        ids = list(tokenizer.tokenize(detokenize(text)))
        pieces.append(np.array(ids + [tokenizer.eod], dtype=np.int64))
        words += count_words(text) + 1  # the end-of-document token counts as one word
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return tokens, words


def _text_stream(path: str, tokenizer, detokenize) -> Tuple[np.ndarray, int]:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start}); expected a plain text file, "
                        "a .jsonl file or the prefix of a .bin/.idx dataset") from None
    return np.array(tokenizer.tokenize(detokenize(text)), dtype=np.int64), count_words(text)


def build_perplexity_dataset(path: str, tokenizer, seq_length: int, stride: int,
                             vocab_limit: int) -> LMWindowDataset:
    """Rolling windows over the text of ``path`` (text, JSONL or ``.bin``/``.idx`` prefix).

    Args:
        vocab_limit: ids a ``.bin``/``.idx`` dataset may hold (the padded vocabulary).
    """
    if is_indexed_prefix(path):
        tokens, words = _indexed_stream(path, vocab_limit), None
    elif not os.path.isfile(path):
        raise FileNotFoundError(f"--valid-data {path}: no such file (nor {get_idx_path(path)})")
    elif is_jsonl(path):
        tokens, words = _jsonl_stream(path, tokenizer, get_detokenizer(path))
    else:
        tokens, words = _text_stream(path, tokenizer, get_detokenizer(path))
    if len(tokens) < 2:
        raise DataError(f"--valid-data {path}: {len(tokens)} token(s); perplexity needs at "
                        "least 2")
    return LMWindowDataset(tokens, seq_length, tokenizer.eod, stride, words)


def build_lambada_dataset(path: str, tokenizer, seq_length: int,
                          strict: bool) -> LambadaDataset:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--valid-data {path}: no such file")
    if not is_jsonl(path) and is_indexed_prefix(path):
        raise DataError(f"--valid-data {path}: --task LAMBADA reads a JSONL file of passages, "
                        "not a .bin/.idx dataset")
    dataset = LambadaDataset(path, tokenizer, seq_length, strict)
    if len(dataset) == 0:
        raise DataError(f"--valid-data {path}: no passages")
    return dataset

