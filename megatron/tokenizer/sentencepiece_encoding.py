"""Megatron-Core's SentencePiece wrapper options: how text becomes a model's pieces.

``--tokenizer-sentencepiece-legacy`` splits the ``--tokenizer-special-tokens`` out of the text,
each becoming one id (the model's own piece when it has one, else a new id after the
vocabulary), and encodes the text between them. A lone word-boundary piece (``▁``) that opens the
text right after a special token is dropped, as chat templates write ``"[INST] who"`` for
``[INST]`` + ``who``; Megatron-Core does this only for text followed by a further special token,
not for the text after the last one, and so does this class.

``--no-tokenizer-sentencepiece-ignore-extra-whitespaces``: a model whose normaliser collapses
runs of spaces (``'x  y'`` and ``'x y'`` give the same pieces) keeps them instead. Every extra
space, and a leading or trailing one, becomes a cut in the text; each part is encoded with a
character the model does not know appended, whose piece is then dropped, so the space before
the cut survives as its own ``▁`` piece. Only the ASCII space is handled so (a run of newlines or
tabs is still collapsed by the model), as in Megatron-Core.
"""

import re
from typing import Dict, List, Optional, Sequence

# A character no model is expected to hold: marks where an extra space stood.
_MARK = "\u262f"
_EXTRA_SPACE = re.compile(r"(?<= )(?= )|^ | $")
_WORD_BOUNDARY = "\u2581"


class SentencePieceEncoding:
    """Text <-> ids of one SentencePiece processor, with Megatron-Core's wrapper options.

    Args:
        processor: a loaded ``sentencepiece.SentencePieceProcessor``.
        legacy: split ``special_tokens`` out of the text (``--tokenizer-sentencepiece-legacy``).
        special_tokens: the tokens to split out, in priority order for ties.
        ignore_extra_whitespaces: False keeps the spaces a model would collapse.
        known: token -> id of the owning tokenizer's vocabulary (the model's pieces and whatever
            it added); a special token found there keeps that id.
        next_id: the first id for a special token the vocabulary lacks.
    """

    def __init__(self, processor, legacy: bool = False,
                 special_tokens: Optional[Sequence[str]] = None,
                 ignore_extra_whitespaces: bool = True,
                 known: Optional[Dict[str, int]] = None, next_id: Optional[int] = None):
        self._processor = processor
        self.legacy = legacy
        special_tokens = list(special_tokens or [])
        if special_tokens and not legacy:
            raise ValueError("--tokenizer-special-tokens with a SentencePiece tokenizer needs "
                             "--tokenizer-sentencepiece-legacy (Megatron-Core adds special tokens "
                             "to a SentencePiece model only in its legacy mode)")
        self.removes_extra_spaces = (processor.encode_as_pieces("x  y")
                                     == processor.encode_as_pieces("x y"))
        self.keeps_spaces = self.removes_extra_spaces and not ignore_extra_whitespaces
        if special_tokens and self.keeps_spaces:
            raise ValueError("--tokenizer-sentencepiece-legacy with --tokenizer-special-tokens "
                             "and --no-tokenizer-sentencepiece-ignore-extra-whitespaces is not "
                             "built: Megatron-Core encodes the text between special tokens with "
                             "its space marks still in it, so its ids hold stray unknown pieces")
        self.special_ids = self._assign_ids(special_tokens, known, next_id)
        self.special_of_id = {i: t for t, i in self.special_ids.items()}
        self._boundary_id = processor.piece_to_id(_WORD_BOUNDARY)

    def _assign_ids(self, tokens, known, next_id) -> Dict[str, int]:
        known = known if known is not None else {}
        next_id = self._processor.get_piece_size() if next_id is None else next_id
        unk = self._processor.unk_id()
        ids: Dict[str, int] = {}
        for token in tokens:
            if token in ids:
                continue
            # As Megatron-Core: a token whose id is the unknown piece's counts as missing.
            if token in known and known[token] != unk:
                ids[token] = known[token]
            else:
                ids[token] = next_id
                next_id += 1
        return ids

    @property
    def new_tokens(self) -> Dict[str, int]:
        """The special tokens that got ids after the vocabulary (token -> id)."""
        size = self._processor.get_piece_size()
        return {t: i for t, i in self.special_ids.items() if i >= size}

    def encode(self, text: str) -> List[int]:
        """Ids of ``text``."""
        if self.keeps_spaces:
            text = _EXTRA_SPACE.sub(f" {_MARK} ", text).rstrip()
        if not self.special_ids:
            return self._plain(text)
        ids: List[int] = []
        position = 0
        while True:
            found = self._next_special(text, position)
            if found is None:
                break
            start, token = found
            segment = self._processor.encode_as_ids(text[position:start])
            if ids and segment and segment[0] == self._boundary_id:
                segment = segment[1:]
            ids.extend(segment)
            ids.append(self.special_ids[token])
            position = start + len(token)
        ids.extend(self._plain(text[position:]))
        return ids

    def _next_special(self, text: str, position: int):
        """(index, token) of the earliest special token at or after ``position``; at equal
        indices the one listed first."""
        best = None
        for token in self.special_ids:
            index = text.find(token, position)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, token)
        return best

    def _plain(self, text: str) -> List[int]:
        if not self.keeps_spaces:
            return self._processor.encode_as_ids(text)
        ids: List[int] = []
        for part in text.split(_MARK):
            if part:
                ids.extend(self._processor.encode_as_ids(part + _MARK)[:-1])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; a special token is written between spaces, and with special tokens
        the result is stripped, as Megatron-Core's legacy mode does."""
        ids = [int(i) for i in ids]
        if not self.legacy:
            return self._processor.decode_ids(ids)
        text, run = "", []
        for index in ids:
            if index in self.special_of_id:
                text += self._processor.decode_ids(run) + " " + self.special_of_id[index] + " "
                run = []
            else:
                run.append(index)
        return (text + self._processor.decode_ids(run)).strip()
