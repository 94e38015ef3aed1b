"""The interface every tokenizer offers, with Megatron's attribute names."""

import abc
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np


class MegatronTokenizer(abc.ABC):
    """Text <-> token ids.

    Subclasses provide ``vocab_size``, ``vocab`` (token -> id), ``inv_vocab`` (id -> token),
    ``tokenize`` and ``detokenize``; the special ids (``eod``, ``cls``, ``sep``, ``pad``, ``mask``,
    ``bos``, ``eos``) raise ``NotImplementedError`` unless the tokenizer defines them, so a model
    that needs one it lacks fails at once, naming the tokenizer.
    """

    # The Jinja template apply_chat_template uses by default (set by build_tokenizer from a
    # --tokenizer-metadata file, the tokenizer's own files or --chat-template).
    chat_template: Optional[str] = None

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

    def apply_chat_template(self, conversation: List[Dict[str, Any]],
                            chat_template: Optional[str] = None, tokenize: bool = True,
                            truncation: bool = False, max_length: Optional[int] = None,
                            add_generation_prompt: bool = False) -> Union[str, List[int]]:
        """Render ``conversation`` (``[{"role": ..., "content": ...}, ...]``) with a Jinja chat
        template, as Megatron-Core's tokenizers do: the template sees ``messages`` and
        ``add_generation_prompt`` (and :meth:`chat_template_variables`); with ``tokenize`` the
        text's ids (:meth:`tokenize_text`, no begin/end tokens added), cut to ``max_length``
        with ``truncation``.
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(f"the {self.name} tokenizer has no chat template: give "
                             "--chat-template, or a --tokenizer-metadata file with 'chat_template'")
        if truncation and not max_length:
            raise ValueError("apply_chat_template: truncation needs max_length")
        from transformers.utils.chat_template_utils import _compile_jinja_template

        text = _compile_jinja_template(template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt,
            **self.chat_template_variables())
        if not tokenize:
            return text
        ids = self.tokenize_text(text)
        return ids[:max_length] if truncation else ids

    def chat_template_variables(self) -> Dict[str, str]:
        """Further names a chat template may use (a Hugging Face tokenizer's special tokens)."""
        return {}

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
