"""``--per-dataset-sequences-path``: each data prefix's counts, so its ``.idx`` header is not read.

The file is Megatron's: one JSON object mapping every data prefix, spelled as in the data flags,
to ``[N, D]``: its number of sequences and of document-index entries (the header fields at
bytes 18 and 26 of ``PREFIX.idx``, FORMATS.md 1), e.g. ``{"/data/web_text_document": [1758,
1787]}``. ``tools/build_sequences_per_dataset.py`` writes it. The token dtype is then not read
either: as Megatron does, it follows from the tokenizer's vocabulary size (int32 above 65,536
ids, else uint16).
"""

import json
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from megatron.data.dataset_utils import DataError

FLAG = "--per-dataset-sequences-path"

# The dtype codes of FORMATS.md 1 that Megatron's fast path chooses between.
_INT32_CODE, _UINT16_CODE = 4, 8


def token_dtype_code(vocab_size: Optional[int]) -> int:
    """Megatron's token dtype code for a vocabulary: 4 (int32) when it holds more than 65,536
    ids, else 8 (uint16)."""
    if vocab_size is None:
        raise DataError(f"{FLAG} needs the tokenizer's vocabulary size to know the token dtype; "
                        "drop the flag or use a tokenizer with a vocabulary size")
    return _INT32_CODE if int(vocab_size) > np.iinfo(np.uint16).max + 1 else _UINT16_CODE


def _counts(path: str, prefix, value) -> Tuple[int, int]:
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))
    if not ok:
        raise DataError(f"{FLAG} {path}: entry {prefix!r} is {value!r}; expected [N, D], the "
                        "number of sequences and of document-index entries (integers >= 0)")
    return int(value[0]), int(value[1])


def load(path: str) -> Dict[str, Tuple[int, int]]:
    """``{prefix: (N, D)}`` from the file; a file that is not that is refused in one line."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise DataError(f"{FLAG} {path}: cannot read it ({e.strerror or e})") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise DataError(f"{FLAG} {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{FLAG} {path}: expected a JSON object {{prefix: [N, D]}}, got "
                        f"{type(data).__name__}")
    return {prefix: _counts(path, prefix, value) for prefix, value in data.items()}


def counts_for(table: Dict[str, Tuple[int, int]], path: str, prefix: str) -> Tuple[int, int]:
    """The counts of ``prefix``; a prefix the file does not list is refused."""
    if prefix not in table:
        raise DataError(f"{FLAG} {path}: no entry for data prefix {prefix!r} (the file lists "
                        f"{len(table)} prefixes; rebuild it with "
                        "tools/build_sequences_per_dataset.py)")
    return table[prefix]


def build(prefixes: Sequence[str]) -> Dict[str, Tuple[int, int]]:
    """The file's content for ``prefixes``, read from their ``.idx`` headers."""
    from megatron.data.indexed_dataset import header_counts

    return {prefix: header_counts(prefix) for prefix in prefixes}
