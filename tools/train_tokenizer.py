"""Train a tokenizer on a JSONL corpus with the ``tokenizers`` library.

``--tokenizer-type GPT2BPETokenizer`` trains a GPT-2-style byte-level BPE and writes ``vocab.json``
and ``merges.txt`` into the ``--output`` folder (``<|endoftext|>`` is id 0);
``BertWordPieceLowerCase`` / ``BertWordPieceCase`` train a WordPiece vocabulary and write it to the
``--output`` file (vocab.txt). Either result loads with ``build_tokenizer`` under that type.

Example::

    python tools/train_tokenizer.py --input data/stdlib.jsonl --json-keys content \
        --tokenizer-type GPT2BPETokenizer --vocab-size 8000 --output data/code-bpe
"""

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
from typing import Iterator, List

BPE_SPECIAL_TOKENS = ["<|endoftext|>"]
WORDPIECE_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=str, required=True, help="JSONL file (.gz allowed)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="keys whose text to learn from")
    parser.add_argument("--tokenizer-type", type=str, required=True,
                        choices=["GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase"])
    parser.add_argument("--vocab-size", type=int, required=True, help="size of the vocabulary")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="a merge must occur at least this often")
    parser.add_argument("--output", type=str, required=True,
                        help="folder for vocab.json + merges.txt (BPE), or the vocab.txt file "
                             "(WordPiece)")
    args = parser.parse_args(argv)
    bpe = args.tokenizer_type == "GPT2BPETokenizer"
    minimum = 257 if bpe else len(WORDPIECE_SPECIAL_TOKENS) + 1
    if args.vocab_size < minimum:
        parser.error(f"--vocab-size {args.vocab_size} is too small for {args.tokenizer_type}; "
                     f"expected at least {minimum}")
    return args


def iter_texts(path: str, keys: List[str]) -> Iterator[str]:
    """The text under each key of each line; a bad line stops training with its line number."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            try:
                document = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_number}: malformed JSON: {e.msg}") from None
            for key in keys:
                value = document.get(key) if isinstance(document, dict) else None
                if not isinstance(value, str):
                    raise ValueError(
                        f"{path}:{line_number}: no string under key {key!r} (--json-keys)")
                yield value


def train_byte_level_bpe(args: argparse.Namespace) -> List[str]:
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(iter_texts(args.input, args.json_keys),
                                  vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                                  special_tokens=BPE_SPECIAL_TOKENS, show_progress=False)
    os.makedirs(args.output, exist_ok=True)
    return tokenizer.save_model(args.output)


def train_wordpiece(args: argparse.Namespace) -> List[str]:
    from tokenizers import BertWordPieceTokenizer

    lower = args.tokenizer_type == "BertWordPieceLowerCase"
    tokenizer = BertWordPieceTokenizer(lowercase=lower, strip_accents=lower)
    tokenizer.train_from_iterator(iter_texts(args.input, args.json_keys),
                                  vocab_size=args.vocab_size, min_frequency=args.min_frequency,
                                  special_tokens=WORDPIECE_SPECIAL_TOKENS, show_progress=False)
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=directory, prefix=".train_tokenizer.")
    try:
        written = tokenizer.save_model(scratch)
        os.replace(written[0], args.output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return [args.output]


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        if args.tokenizer_type == "GPT2BPETokenizer":
            written = train_byte_level_bpe(args)
        else:
            written = train_wordpiece(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Wrote {', '.join(written)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
