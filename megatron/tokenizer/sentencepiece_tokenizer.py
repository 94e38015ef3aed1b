"""SentencePiece models (``--tokenizer-model``): Megatron's three SentencePiece tokenizer types."""

import re
from typing import Dict, List, Optional, Sequence

from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.sentencepiece_encoding import SentencePieceEncoding


class SentencePieceTokenizer(MegatronTokenizer):
    """Megatron's ``SentencePieceTokenizer``.

    The model's pieces keep their ids; ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>``, the model's pad,
    bos and eos pieces (``<PAD>``/``<BOS>``/``<EOS>`` when the model has none) and
    ``vocab_extra_ids`` sentinels ``<extra_id_i>`` are special: appended to the vocabulary when
    missing, and recognised verbatim in text, where they become their own id instead of being split
    into pieces.

    ``legacy``, ``special_tokens`` and ``ignore_extra_whitespaces`` are Megatron-Core's wrapper
    options (:class:`SentencePieceEncoding`). With legacy special tokens, the tokens above are
    split out by the same rules, after them in priority; a special token the vocabulary lacks
    gets an id after ``<extra_id_i>``.
    """

    def __init__(self, model_file: str, vocab_extra_ids: int = 0, legacy: bool = False,
                 special_tokens: Optional[Sequence[str]] = None,
                 ignore_extra_whitespaces: bool = True):
        super().__init__("SentencePiece")
        import sentencepiece

        self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._vocab: Dict[str, int] = {}
        self._inv_vocab: Dict[int, str] = {}
        for index in range(self._processor.get_piece_size()):
            piece = self._processor.id_to_piece(index)
            self._vocab[piece] = index
            self._inv_vocab[index] = piece
        self._special: Dict[str, int] = {}
        self._cls_id = self._add_special("<CLS>")
        self._sep_id = self._add_special("<SEP>")
        self._eod_id = self._add_special("<EOD>")
        self._mask_id = self._add_special("<MASK>")
        self._pad_id = self._add_special(self._piece_or(self._processor.pad_id(), "<PAD>"))
        self._bos_id = self._add_special(self._piece_or(self._processor.bos_id(), "<BOS>"))
        self._eos_id = self._add_special(self._piece_or(self._processor.eos_id(), "<EOS>"))
        self._extra_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._extra_tokens:
            self._add_special(token)
        # With legacy special tokens, this tokenizer's own tokens join them in one pass, so the
        # wrapper's rules (earliest match, "▁" dropped after a special token) cover them all.
        user = list(special_tokens or [])
        self._one_pass = legacy and bool(user)
        if self._one_pass:
            user += [t for t in self._special if t not in user]
        self._encoding = SentencePieceEncoding(
            self._processor, legacy, user, ignore_extra_whitespaces,
            known=self._vocab, next_id=len(self._vocab))
        for token, index in self._encoding.new_tokens.items():
            self._vocab[token] = index
            self._inv_vocab[index] = token
        self._inv_special = {i: t for t, i in self._special.items()}
        self._inv_special.update(self._encoding.special_of_id)
        # Alternation in insertion order: at equal positions the earlier-added token wins.
        self._special_re = re.compile("|".join(re.escape(t) for t in self._special))

    def _piece_or(self, index: int, fallback: str) -> str:
        if 0 <= index < self._processor.get_piece_size():
            return self._processor.id_to_piece(index)
        return fallback

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            index = len(self._vocab)
            self._vocab[token] = index
            self._inv_vocab[index] = token
        self._special[token] = self._vocab[token]
        return self._vocab[token]

    @property
    def vocab_size(self) -> int:
        return len(self._inv_vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        if self._one_pass:
            return self._encoding.encode(text)
        ids: List[int] = []
        position = 0
        for match in self._special_re.finditer(text):
            ids.extend(self._encoding.encode(text[position:match.start()]))
            ids.append(self._special[match.group(0)])
            position = match.end()
        ids.extend(self._encoding.encode(text[position:]))
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        parts: List[str] = []
        run: List[int] = []
        for index in (int(i) for i in token_ids):
            if index in self._inv_special:
                parts.append(self._processor.decode_ids(run) + " " + self._inv_special[index] + " ")
                run = []
            else:
                run.append(index)
        parts.append(self._processor.decode_ids(run))
        return "".join(parts)

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def additional_special_tokens_ids(self) -> List[int]:
        return [self._vocab[t] for t in self._extra_tokens]


class GPTSentencePieceTokenizer(MegatronTokenizer):
    """Megatron's ``GPTSentencePieceTokenizer``: the model's pieces only, nothing added.

    ``tokenize`` is the model's plain encoding, with Megatron-Core's wrapper options
    (:class:`SentencePieceEncoding`: ``legacy`` special tokens, which a model lacking them gets
    as new ids after its pieces, and ``ignore_extra_whitespaces``); ``eod`` is the model's eos
    id; the BERT ids are -1.
    """

    def __init__(self, model_file: str, name: str = "GPT SentencePiece", legacy: bool = False,
                 special_tokens: Optional[Sequence[str]] = None,
                 ignore_extra_whitespaces: bool = True):
        super().__init__(name)
        import sentencepiece

        self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self._inv_vocab = {i: self._processor.id_to_piece(i)
                           for i in range(self._processor.get_piece_size())}
        self._vocab = {piece: i for i, piece in self._inv_vocab.items()}
        self._encoding = SentencePieceEncoding(self._processor, legacy, special_tokens,
                                               ignore_extra_whitespaces, known=self._vocab)
        for token, index in self._encoding.new_tokens.items():
            self._vocab[token] = index
            self._inv_vocab[index] = token

    @property
    def vocab_size(self) -> int:
        return len(self._inv_vocab)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        return self._encoding.encode(text)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._encoding.decode(token_ids)

    @property
    def eod(self) -> int:
        return self._processor.eos_id()

    @property
    def eos(self) -> int:
        return self._processor.eos_id()

    @property
    def bos(self) -> int:
        return self._processor.bos_id()

    @property
    def pad(self) -> int:
        return self._processor.pad_id()

    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: as GPTSentencePieceTokenizer, but ``tokenize`` starts every
    text with the bos id (and can end it with eos), as Llama 2 was trained."""

    def __init__(self, model_file: str, **options):
        super().__init__(model_file, name="Llama2 SentencePiece", **options)

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> List[int]:
        ids = self._encoding.encode(text)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])

    def tokenize_text(self, text: str) -> List[int]:
        return self.tokenize(text, bos=False)
