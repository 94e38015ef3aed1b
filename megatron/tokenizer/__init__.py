"""Tokenizers with Megatron's names; ``build_tokenizer(args)`` picks one by ``--tokenizer-type``."""

from megatron.tokenizer.base import MegatronTokenizer
from megatron.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    NullTokenizer,
    TokenizerError,
    build_tokenizer,
    gpt2_vocab_files,
    vocab_size_with_padding,
)

__all__ = [
    "MegatronTokenizer",
    "NullTokenizer",
    "TOKENIZER_TYPES",
    "TokenizerError",
    "build_tokenizer",
    "gpt2_vocab_files",
    "vocab_size_with_padding",
]
