"""The interface every tokenizer offers, with Megatron's attribute names."""

import abc
from typing import Dict, List, Sequence, Tuple

import numpy as np


class MegatronTokenizer(abc.ABC):
    """Text <-> token ids.

    Subclasses provide ``vocab_size``, ``vocab`` (token -> id), ``inv_vocab`` (id -> token),
    ``tokenize`` and ``detokenize``; the special ids (``eod``, ``cls``, ``sep``, ``pad``, ``mask``,
    ``bos``, ``eos``) raise ``NotImplementedError`` unless the tokenizer defines them, so a model
    that needs one it lacks fails at once, naming the tokenizer.
    """

    def __init__(self, name: str):
        self.name = name

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (before padding for the embedding table)."""

    @property
    @abc.abstractmethod
    def vocab(self) -> Dict[str, int]:
        """Token text -> id."""

    @property
    @abc.abstractmethod
    def inv_vocab(self) -> Dict[int, str]:
        """Id -> token text."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Ids of ``text``."""

    def tokenize_text(self, text: str) -> List[int]:
        """Ids of ``text`` alone, without the begin/end tokens that ``tokenize`` may add (a
        Hugging Face post-processor's, Llama 2's bos): the pieces of a fill-in-the-middle
        sample are tokenized this way."""
        return self.tokenize(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``."""
        raise NotImplementedError(f"detokenize is not provided by the {self.name} tokenizer")

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        """Tokenize many texts at once: (all ids back to back as int64, one length per text).

        The preprocessing tool uses this; tokenizers with a native batch or array path override it
        so that no per-token Python work is done.
        """
        pieces = [self.tokenize(text) for text in texts]
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        flat = np.fromiter((i for p in pieces for i in p), dtype=np.int64, count=int(lengths.sum()))
        return flat, lengths

    def _missing(self, what: str):
        raise NotImplementedError(f"the {self.name} tokenizer has no {what} token")

    @property
    def eod(self) -> int:
        """End-of-document id."""
        return self._missing("end-of-document (eod)")

    @property
    def cls(self) -> int:
        return self._missing("CLS")

    @property
    def sep(self) -> int:
        return self._missing("SEP")

    @property
    def pad(self) -> int:
        return self._missing("PAD")

    @property
    def mask(self) -> int:
        return self._missing("MASK")

    @property
    def bos(self) -> int:
        return self._missing("BOS")

    @property
    def eos(self) -> int:
        return self._missing("EOS")
