"""Megatron-Core's tokenizer metadata file (``--tokenizer-metadata``) and chat templates.

The metadata file is a JSON object, written by :func:`write_metadata` (Megatron-Core's
``MegatronTokenizer.write_metadata``) as::

    {"library": "sentencepiece", "class_name": null, "class_path": null,
     "model_type": "gpt", "chat_template": "{% for m in messages %}...{% endfor %}"}

``library`` names the tokenizer library (sentencepiece, huggingface, megatron, tiktoken, sft,
...); ``model_type`` (default-text, gpt, bert, t5, mamba) picks a tokenizer class that behaves the
same for every type; ``chat_template`` is a Jinja template; ``class_name``/``class_path`` name a
custom class, which Megatron-Core never loads from this file. Megatron-Core builds the library the
file names in place of the one ``--tokenizer-type`` implies; this project builds the tokenizer
``--tokenizer-type`` names, so a file naming another library is refused.

The chat template a tokenizer applies is the metadata file's, else the tokenizer's own (a Hugging
Face folder's ``tokenizer_config.json``), else ``--chat-template``.
"""

import json
import os
from typing import Any, Dict, Optional

LIBRARY_OF_TYPE = {
    "BertWordPieceLowerCase": "megatron", "BertWordPieceCase": "megatron",
    "GPT2BPETokenizer": "megatron", "SentencePieceTokenizer": "sentencepiece",
    "GPTSentencePieceTokenizer": "sentencepiece", "Llama2Tokenizer": "sentencepiece",
    "HuggingFaceTokenizer": "huggingface", "TikTokenizer": "tiktoken", "SFTTokenizer": "sft",
    "NullTokenizer": "null-text",
}
TEXT_LIBRARIES = ("sentencepiece", "huggingface", "megatron", "tiktoken", "byte-level",
                  "null-text", "sft")
VISION_LIBRARIES = ("multimodal", "null-multimodal")
MODEL_TYPES = ("default-text", "gpt", "mamba", "bert", "t5", "default-vision")
METADATA_FILE = "tokenizer_metadata.json"


def default_metadata_path(tokenizer_path: str) -> str:
    """``tokenizer_metadata.json`` beside a tokenizer file, or inside a tokenizer folder."""
    folder = os.path.dirname(tokenizer_path) if os.path.isfile(tokenizer_path) else tokenizer_path
    return os.path.join(folder, METADATA_FILE)


def write_metadata(tokenizer_path: str, tokenizer_library: str, model_type: Optional[str] = None,
                   chat_template: Optional[str] = None, overwrite: bool = False,
                   metadata_path: Optional[str] = None) -> str:
    """Write a metadata file for the tokenizer at ``tokenizer_path``; returns its path."""
    if not os.path.exists(tokenizer_path):
        raise FileNotFoundError(f"{tokenizer_path}: no such tokenizer file or folder")
    if tokenizer_library not in TEXT_LIBRARIES + VISION_LIBRARIES:
        raise ValueError(f"tokenizer library {tokenizer_library!r} is not one of "
                         f"{', '.join(TEXT_LIBRARIES + VISION_LIBRARIES)}")
    if model_type is None:
        model_type = "default-text" if tokenizer_library in TEXT_LIBRARIES else "default-vision"
    path = metadata_path or default_metadata_path(tokenizer_path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path}: the metadata file exists already (overwrite=True "
                              "replaces it)")
    metadata = {"library": tokenizer_library, "class_name": None, "class_path": None,
                "model_type": model_type, "chat_template": chat_template}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(metadata, f)
    return path


def read_metadata(path: str, tokenizer_type: Optional[str] = None) -> Dict[str, Any]:
    """The metadata object of ``path``, checked; ``tokenizer_type`` must use its library."""
    where = f"--tokenizer-metadata {path}"
    try:
        with open(path, encoding="utf-8") as f:
            metadata = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: not a JSON file ({error})") from None
    if not isinstance(metadata, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(metadata).__name__}")
    library = metadata.get("library")
    if library not in TEXT_LIBRARIES + VISION_LIBRARIES:
        raise ValueError(f"{where}: key 'library' is {library!r}; expected one of "
                         f"{', '.join(TEXT_LIBRARIES + VISION_LIBRARIES)}")
    model_type = metadata.get("model_type")
    if model_type is not None and model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: key 'model_type' is {model_type!r}; expected one of "
                         f"{', '.join(MODEL_TYPES)} (or null)")
    for key in ("chat_template", "class_name", "class_path"):
        if metadata.get(key) is not None and not isinstance(metadata[key], str):
            raise ValueError(f"{where}: key {key!r} must be a string or null, got "
                             f"{type(metadata[key]).__name__}")
    expected = LIBRARY_OF_TYPE.get(tokenizer_type)
    if expected is not None and library != expected:
        raise ValueError(f"{where}: key 'library' is {library!r}, but --tokenizer-type "
                         f"{tokenizer_type} is a {expected!r} tokenizer; this project builds "
                         "the tokenizer --tokenizer-type names (give a file for that library)")
    return metadata


def resolve_chat_template(metadata: Optional[Dict[str, Any]], own: Optional[str],
                          flag: Optional[str]) -> Optional[str]:
    """The metadata file's template, else the tokenizer's own, else ``--chat-template``'s."""
    for template in ((metadata or {}).get("chat_template"), own, flag):
        if template is not None:
            return template
    return None
