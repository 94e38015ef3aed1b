"""Tokenizer files of a Hugging Face folder: which to write for a model's ``--tokenizer-type``,
and which ``--tokenizer-type`` a folder's files call for.

Written per type (``AutoTokenizer.from_pretrained(folder)`` then loads them offline):

- ``GPT2BPETokenizer``: ``vocab.json`` and ``merges.txt`` copied from ``--vocab-file`` /
  ``--merge-file``, plus ``tokenizer_config.json`` (class ``GPT2Tokenizer``) and
  ``special_tokens_map.json`` naming ``<|endoftext|>`` as bos, eos and unk.
- ``HuggingFaceTokenizer``: ``tokenizer.json`` copied from ``--tokenizer-model`` (a file, or a
  folder holding one), with the ``tokenizer_config.json`` / ``special_tokens_map.json`` beside
  it; without a ``tokenizer_config.json`` a minimal one (``PreTrainedTokenizerFast``) is written.
- ``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer``, ``Llama2Tokenizer``: the
  ``--tokenizer-model`` file copied as ``tokenizer.model``, and a ``tokenizer_config.json``
  (``PreTrainedTokenizerFast``, bos added for Llama2Tokenizer only). ``SentencePieceTokenizer``'s
  added special tokens (``<EOD>`` ...) exist only in this project and are not written.
- ``BertWordPieceLowerCase`` / ``BertWordPieceCase``: ``vocab.txt`` copied from
  ``--vocab-file``, plus ``tokenizer_config.json`` (class ``BertTokenizer``, ``do_lower_case``
  as the type says) and ``special_tokens_map.json``. The ``[BOS]`` / ``[EOS]`` (and
  ``--vocab-extra-ids``) tokens this project appends when the file lacks them are not written:
  they keep their rows in the model (its ``vocab_size`` counts them) but ``BertTokenizer`` never
  produces them. ``BertTokenizer`` gives up on words longer than 100 characters, ours on words
  longer than 200 (both emit ``[UNK]``).
- ``NullTokenizer`` (or no tokenizer recorded): nothing, and only when the caller opts in.
"""

import dataclasses
import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

from megatron.convert.schema import ConversionError, ModelMeta

GPT2_EOD = "<|endoftext|>"
_SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
_HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_WORDPIECE_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}  # -> lower case
_WORDPIECE_SPECIALS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]",
                       "cls_token": "[CLS]", "mask_token": "[MASK]"}


@dataclasses.dataclass
class TokenizerPlan:
    """What to write: files to copy (source, name in the folder), JSON files to write, and the
    bos / eos (and, for BERT, pad) ids for config.json."""

    copies: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    json_files: Dict[str, dict] = dataclasses.field(default_factory=dict)
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    pad_id: Optional[int] = None


def _readable(path: Optional[str], flag: str, kind: str) -> str:
    """``path`` when it names a readable file, else a ConversionError naming ``flag``."""
    if not path:
        raise ConversionError(f"--tokenizer-type {kind} needs {flag}, which the source does "
                              "not record")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise ConversionError(f"{flag} {path!r} cannot be read for --tokenizer-type {kind}: "
                              f"{err.strerror or err}") from None
    if not os.path.isfile(path):
        raise ConversionError(f"{flag} {path!r} is not a file (--tokenizer-type {kind})")
    return path


def _gpt2_plan(meta: ModelMeta) -> TokenizerPlan:
    kind = meta.tokenizer_type
    vocab_file = _readable(meta.vocab_file, "--vocab-file", kind)
    merge_file = _readable(meta.merge_file, "--merge-file", kind)
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise ConversionError(f"--vocab-file {vocab_file!r} is not a JSON vocabulary: "
                              f"{err}") from None
    eod = vocab.get(GPT2_EOD) if isinstance(vocab, dict) else None
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length":
              meta.max_position_embeddings, "add_prefix_space": False, "add_bos_token": False,
              "clean_up_tokenization_spaces": False}
    specials = {}
    if eod is not None:
        specials = {"bos_token": GPT2_EOD, "eos_token": GPT2_EOD, "unk_token": GPT2_EOD}
        config.update(specials)
    return TokenizerPlan(copies=[(vocab_file, "vocab.json"), (merge_file, "merges.txt")],
                         json_files={"tokenizer_config.json": config,
                                     "special_tokens_map.json": specials},
                         bos_id=eod, eos_id=eod)


def _huggingface_plan(meta: ModelMeta) -> TokenizerPlan:
    path = meta.tokenizer_model
    if path and os.path.isdir(path):
        folder, file = path, os.path.join(path, "tokenizer.json")
    else:
        folder, file = (os.path.dirname(path) if path else ""), path
    file = _readable(file, "--tokenizer-model", meta.tokenizer_type)
    plan = TokenizerPlan(copies=[(file, "tokenizer.json")])
    plan.copies += [(os.path.join(folder, name), name) for name in _HF_CONFIG_FILES
                    if os.path.isfile(os.path.join(folder, name))]
    from megatron.tokenizer.huggingface import HuggingFaceTokenizer

    try:
        tokenizer = HuggingFaceTokenizer(file)
    except Exception as err:  # the tokenizers library's errors have no common base class
        raise ConversionError(f"--tokenizer-model {file!r} is not a readable tokenizer.json: "
                              f"{err}") from None
    try:
        plan.eos_id = tokenizer.eod
    except NotImplementedError:
        plan.eos_id = None
    if not any(name == "tokenizer_config.json" for _, name in plan.copies):
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  "model_max_length": meta.max_position_embeddings,
                  "clean_up_tokenization_spaces": False}
        if plan.eos_id is not None:
            config["eos_token"] = tokenizer.inv_vocab[plan.eos_id]
        plan.json_files["tokenizer_config.json"] = config
    return plan


def _sentencepiece_plan(meta: ModelMeta) -> TokenizerPlan:
    kind = meta.tokenizer_type
    model = _readable(meta.tokenizer_model, "--tokenizer-model", kind)
    import sentencepiece

    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=model)
    except (RuntimeError, OSError) as err:
        raise ConversionError(f"--tokenizer-model {model!r} is not a SentencePiece model: "
                              f"{err}") from None
    # The generic fast tokenizer built from tokenizer.model encodes as the model does; only
    # Llama2Tokenizer starts every text with bos.
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "add_bos_token": kind == "Llama2Tokenizer", "add_eos_token": False,
              "model_max_length": meta.max_position_embeddings,
              "clean_up_tokenization_spaces": False}
    plan = TokenizerPlan(copies=[(model, "tokenizer.model")],
                         json_files={"tokenizer_config.json": config})
    for name, index in (("bos", processor.bos_id()), ("eos", processor.eos_id()),
                        ("unk", processor.unk_id())):
        if 0 <= index < processor.get_piece_size():
            config[f"{name}_token"] = processor.id_to_piece(index)
            if name != "unk":
                setattr(plan, f"{name}_id", index)
    return plan


def _wordpiece_plan(meta: ModelMeta) -> TokenizerPlan:
    kind = meta.tokenizer_type
    vocab_file = _readable(meta.vocab_file, "--vocab-file", kind)
    from megatron.tokenizer.bert_wordpiece import read_wordpiece_vocab

    try:
        vocab = read_wordpiece_vocab(vocab_file)
    except UnicodeDecodeError as err:
        raise ConversionError(f"--vocab-file {vocab_file!r} is not a UTF-8 vocab.txt: "
                              f"{err}") from None
    missing = [token for token in _WORDPIECE_SPECIALS.values() if token not in vocab]
    if missing:
        raise ConversionError(f"--vocab-file {vocab_file!r} has no {', '.join(missing)} token; "
                              f"--tokenizer-type {kind} needs [CLS] [SEP] [PAD] [MASK] [UNK]")
    lower = _WORDPIECE_TYPES[kind]
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": lower,
              "tokenize_chinese_chars": True, "strip_accents": None,
              "model_max_length": meta.max_position_embeddings,
              "clean_up_tokenization_spaces": False, **_WORDPIECE_SPECIALS}
    return TokenizerPlan(copies=[(vocab_file, "vocab.txt")],
                         json_files={"tokenizer_config.json": config,
                                     "special_tokens_map.json": dict(_WORDPIECE_SPECIALS)},
                         pad_id=vocab["[PAD]"])


def plan_tokenizer(meta: ModelMeta, allow_no_tokenizer: bool) -> TokenizerPlan:
    """Check the tokenizer files ``meta`` names and decide what to write, before anything is.

    Raises:
        ConversionError: a named file is missing or unreadable, or the model has no exportable
            tokenizer and ``allow_no_tokenizer`` is False.
    """
    kind = meta.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return _gpt2_plan(meta)
    if kind == "HuggingFaceTokenizer":
        return _huggingface_plan(meta)
    if kind in _SENTENCEPIECE_TYPES:
        return _sentencepiece_plan(meta)
    if kind in _WORDPIECE_TYPES:
        return _wordpiece_plan(meta)
    if not allow_no_tokenizer:
        shown = kind or "(none recorded)"
        raise ConversionError(
            f"--tokenizer-type {shown}: a Hugging Face folder needs tokenizer files, and only "
            f"GPT2BPETokenizer, HuggingFaceTokenizer, {', '.join(_SENTENCEPIECE_TYPES)} and "
            f"{', '.join(_WORDPIECE_TYPES)} can be exported; pass --allow-no-tokenizer "
            "(save_hf(..., allow_no_tokenizer=True)) to write the model without tokenizer files")
    # NullTokenizer: ids 0..V-1 are data and V (= vocab_size - 1) is the end of document.
    eod = meta.vocab_size - 1 if kind == "NullTokenizer" else None
    return TokenizerPlan(bos_id=eod, eos_id=eod)


def write_tokenizer(plan: TokenizerPlan, save_dir: str) -> None:
    """Copy and write the planned files into ``save_dir``."""
    for source, name in plan.copies:
        shutil.copyfile(source, os.path.join(save_dir, name))
    for name, content in plan.json_files.items():
        with open(os.path.join(save_dir, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)
            f.write("\n")


def detect_tokenizer(folder: str) -> Dict[str, Optional[str]]:
    """The ``tokenizer_type`` / ``vocab_file`` / ``merge_file`` / ``tokenizer_model`` that read
    ``folder``'s tokenizer files (absolute paths; all None when the folder has none).

    ``vocab.json`` + ``merges.txt`` -> GPT2BPETokenizer; else ``tokenizer.json`` ->
    HuggingFaceTokenizer; else ``tokenizer.model`` -> Llama2Tokenizer when tokenizer_config.json
    has ``add_bos_token: true``, else GPTSentencePieceTokenizer: the two types that encode as
    AutoTokenizer does (SentencePieceTokenizer adds tokens the folder does not have).
    """
    def path(name):
        full = os.path.abspath(os.path.join(folder, name))
        return full if os.path.isfile(full) else None

    fields = dict(tokenizer_type=None, vocab_file=None, merge_file=None, tokenizer_model=None)
    if path("vocab.json") and path("merges.txt"):
        fields.update(tokenizer_type="GPT2BPETokenizer", vocab_file=path("vocab.json"),
                      merge_file=path("merges.txt"))
    elif path("tokenizer.json"):
        fields.update(tokenizer_type="HuggingFaceTokenizer",
                      tokenizer_model=path("tokenizer.json"))
    elif path("tokenizer.model"):
        kind = ("Llama2Tokenizer" if _tokenizer_config(folder).get("add_bos_token") is True
                else "GPTSentencePieceTokenizer")
        fields.update(tokenizer_type=kind, tokenizer_model=path("tokenizer.model"))
    return fields


def detect_wordpiece(folder: str) -> Dict[str, Optional[str]]:
    """For a BERT folder: ``vocab.txt`` -> BertWordPieceLowerCase, or BertWordPieceCase when
    tokenizer_config.json says ``do_lower_case: false``; otherwise :func:`detect_tokenizer`."""
    vocab = os.path.abspath(os.path.join(folder, "vocab.txt"))
    if not os.path.isfile(vocab):
        return detect_tokenizer(folder)
    lower = _tokenizer_config(folder).get("do_lower_case", True) is not False
    kind = next(k for k, v in _WORDPIECE_TYPES.items() if v == lower)
    return dict(tokenizer_type=kind, vocab_file=vocab, merge_file=None, tokenizer_model=None)


def _tokenizer_config(folder: str) -> dict:
    """The folder's tokenizer_config.json, or {} when it has none (or an unreadable one)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
