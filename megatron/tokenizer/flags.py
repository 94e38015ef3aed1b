"""The tokenizer options shared by the training parser and tools/preprocess_data.py."""


def add_tokenizer_option_args(group) -> None:
    """Megatron's SentencePiece wrapper, metadata-file, chat-template and gigatoken flags."""
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
    group.add_argument("--use-gigatoken", action="store_true",
                       help="HuggingFaceTokenizer: encode with the gigatoken package (pip install "
                       "gigatoken), a compiled BPE encoder giving the same ids faster; a "
                       "tokenizer.json whose settings gigatoken would not reproduce is refused, "
                       "naming the file")
