"""BERT WordPiece (``vocab.txt``), lower-cased or cased, encoded by the ``tokenizers`` library."""

from typing import Dict, List, Sequence, Tuple

import numpy as np

from megatron.tokenizer.base import MegatronTokenizer

# Megatron's BERT tokenizer gives up on words longer than this and emits [UNK].
_MAX_CHARS_PER_WORD = 200


def read_wordpiece_vocab(vocab_file: str) -> Dict[str, int]:
    """Token -> id from a vocab.txt: one token per line, id = line number from 0."""
    vocab: Dict[str, int] = {}
    with open(vocab_file, encoding="utf-8") as f:
        for index, line in enumerate(f):
            vocab[line.strip()] = index
    return vocab


class BertWordPieceTokenizer(MegatronTokenizer):
    """Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``.

    Like Megatron, ``[BOS]`` and ``[EOS]`` and ``vocab_extra_ids`` sentinel tokens
    ``<extra_id_0>``... are appended to the vocabulary when missing (they count in ``vocab_size``);
    ``tokenize`` adds no ``[CLS]``/``[SEP]``.
    """

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        super().__init__("BERT Lower Case" if lower_case else "BERT Upper Case")
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

        self._vocab = read_wordpiece_vocab(vocab_file)
        for required in ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]"):
            if required not in self._vocab:
                raise ValueError(f"{vocab_file}: the WordPiece vocabulary has no {required} token")
        self._tokenizer = Tokenizer(models.WordPiece(
            dict(self._vocab), unk_token="[UNK]", max_input_chars_per_word=_MAX_CHARS_PER_WORD))
        self._tokenizer.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=lower_case,
            lowercase=lower_case)
        self._tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self.cls_id, self.sep_id = self._vocab["[CLS]"], self._vocab["[SEP]"]
        self.pad_id, self.mask_id = self._vocab["[PAD]"], self._vocab["[MASK]"]
        self._bos_token_id = self._add_token("[BOS]")
        self._eos_token_id = self._add_token("[EOS]")
        self._additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._additional_special_tokens:
            self._add_token(token)

    def _add_token(self, token: str) -> int:
        if token not in self._vocab:
            index = len(self._vocab)
            self._vocab[token] = index
            self._inv_vocab[index] = token
        return self._vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        pieces = [e.ids for e in encodings]
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        flat = np.fromiter((i for p in pieces for i in p), dtype=np.int64, count=int(lengths.sum()))
        return flat, lengths

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Word pieces joined by spaces, ``##`` continuations glued to the piece before them."""
        tokens = [self._inv_vocab[int(i)] for i in token_ids]
        return " ".join(tokens).replace(" ##", "").strip()

    decode = detokenize

    @property
    def cls(self) -> int:
        return self.cls_id

    @property
    def sep(self) -> int:
        return self.sep_id

    @property
    def pad(self) -> int:
        return self.pad_id

    @property
    def mask(self) -> int:
        return self.mask_id

    @property
    def bos(self) -> int:
        return self._bos_token_id

    @property
    def eos(self) -> int:
        return self._eos_token_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._vocab[t] for t in self._additional_special_tokens]
