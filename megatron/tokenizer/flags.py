"""The tokenizer options shared by the training parser and tools/preprocess_data.py."""

GIGATOKEN_REASON = ("Megatron hands its Hugging Face tokenizers to the external gigatoken package "
                    "(a compiled BPE encoder), which is not installed here; drop it")


def add_tokenizer_option_args(group) -> None:
    """Megatron's SentencePiece wrapper, metadata-file and chat-template flags (each parser
    adds the refused --use-gigatoken itself, with GIGATOKEN_REASON)."""
    group.add_argument("--tokenizer-metadata", type=str, default=None, dest="metadata_path",
                       help="a tokenizer metadata JSON file (Megatron-Core's "
                       "tokenizer_metadata.json: library, model_type, chat_template); its "
                       "chat_template is the tokenizer's default")
    group.add_argument("--tokenizer-sentencepiece-legacy", action="store_true",
                       help="SentencePiece types: split --tokenizer-special-tokens out of the "
                       "text, each one id (Megatron-Core's legacy wrapper mode)")
    group.add_argument("--no-tokenizer-sentencepiece-ignore-extra-whitespaces",
                       "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces",
                       action="store_false", dest="tokenizer_sentencepiece_ignore_extra_whitespaces",
                       help="SentencePiece types: keep runs of spaces that the model's "
                       "normaliser would collapse, each extra space a piece of its own")
    group.add_argument("--chat-template", type=str, default=None,
                       help="a Jinja chat template (the text itself), used when neither "
                       "--tokenizer-metadata nor the tokenizer's own files give one")
