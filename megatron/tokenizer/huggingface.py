"""A Hugging Face ``tokenizer.json`` (a file, or a local folder holding one), read by tokenizers.

Megatron's ``HuggingFaceTokenizer`` goes through ``transformers.AutoTokenizer``; this project reads
the same ``tokenizer.json`` with the ``tokenizers`` library, which is what AutoTokenizer's fast
tokenizers run, so ids agree. Nothing is downloaded: ``--tokenizer-model`` must be a local path.
With ``--use-gigatoken`` the text is encoded by the gigatoken package instead, with the same ids
(:mod:`megatron.tokenizer.gigatoken_backend`); decoding stays on the tokenizers library.
"""

import json
import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron.tokenizer.base import MegatronTokenizer

# Tried in order when the folder's tokenizer_config.json / special_tokens_map.json name no eos.
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]")


def _token_text(value) -> Optional[str]:
    """An eos entry of tokenizer_config.json is a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class HuggingFaceTokenizer(MegatronTokenizer):
    """Tokenizes as ``AutoTokenizer(path)(text).input_ids`` does (the post-processor's special
    tokens included); ``eod`` is the eos token named in the folder's config, else the first of
    ``<|endoftext|>``, ``</s>``, ``<|end_of_text|>``, ``<eos>``, ``[EOS]`` in the vocabulary."""

    def __init__(self, pretrained_model_name_or_path: str, include_special_tokens: bool = True,
                 use_gigatoken: bool = False):
        super().__init__("HuggingFace")
        # --tokenizer-hf-no-include-special-tokens: the post-processor's tokens (a BOS, ...)
        # are not added, as AutoTokenizer's add_special_tokens=False.
        self._add_special = include_special_tokens
        from tokenizers import Tokenizer

        path = pretrained_model_name_or_path
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(
                f"--tokenizer-model {path!r}: no tokenizer.json there; HuggingFaceTokenizer "
                "needs a local tokenizer.json or a folder holding one (nothing is downloaded)")
        self._path = file
        self._tokenizer = Tokenizer.from_file(file)
        # --use-gigatoken: gigatoken's transformers-compatible encoder, else None.
        self._gigatoken = None
        if use_gigatoken:
            from megatron.tokenizer.gigatoken_backend import load_gigatoken

            self._gigatoken = load_gigatoken(file, self._tokenizer, self._add_special)
        self._vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        self._eos_token = self._find_eos(folder)
        self._config = self._read_config(folder)
        template = self._config.get("chat_template")
        self.chat_template = template if isinstance(template, str) else None

    @staticmethod
    def _read_config(folder: str) -> Dict:
        """The folder's tokenizer_config.json (empty when there is none)."""
        path = os.path.join(folder, "tokenizer_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return config

    def chat_template_variables(self) -> Dict[str, str]:
        """The special tokens of tokenizer_config.json (``bos_token``, ``eos_token``, ...), which
        transformers' apply_chat_template hands to the template."""
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
        found = {n: _token_text(self._config.get(n)) for n in names}
        return {n: t for n, t in found.items() if t is not None}

    def _find_eos(self, folder: str) -> Optional[str]:
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            config_path = os.path.join(folder, name)
            if os.path.isfile(config_path):
                with open(config_path, encoding="utf-8") as f:
                    token = _token_text(json.load(f).get("eos_token"))
                if token is not None and token in self._vocab:
                    return token
        return next((t for t in _EOS_CANDIDATES if t in self._vocab), None)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return self._inv_vocab

    @property
    def uses_gigatoken(self) -> bool:
        return self._gigatoken is not None

    def _encode(self, text: str, add_special_tokens: bool) -> List[int]:
        if self._gigatoken is not None:
            return self._gigatoken.encode(text, add_special_tokens=add_special_tokens)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def tokenize(self, text: str) -> List[int]:
        return self._encode(text, self._add_special)

    def tokenize_text(self, text: str) -> List[int]:
        return self._encode(text, False)

    def tokenize_batch_flat(self, texts: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
        if self._gigatoken is not None:
            pieces = self._gigatoken(list(texts), add_special_tokens=self._add_special,
                                     return_attention_mask=False)["input_ids"]
        else:
            pieces = [e.ids for e in self._tokenizer.encode_batch(
                list(texts), add_special_tokens=self._add_special)]
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        flat = np.fromiter((i for p in pieces for i in p), dtype=np.int64, count=int(lengths.sum()))
        return flat, lengths

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=False)

    @property
    def eod(self) -> int:
        if self._eos_token is None:
            raise NotImplementedError(
                f"{self._path}: this tokenizer names no eos token (tokenizer_config.json "
                f"'eos_token') and has none of {', '.join(_EOS_CANDIDATES)}, so it has no "
                "end-of-document id")
        return self._vocab[self._eos_token]

    @property
    def eos(self) -> int:
        return self.eod
