"""Merge every ``.bin``/``.idx`` dataset in a folder into one (Megatron's merge_datasets.py).

Datasets are taken in sorted order of their prefixes; their documents keep their order and their
token bytes are copied as they are. All of them must have the same dtype.

Example::

    python tools/merge_datasets.py --input data/shards --output-prefix data/all_text_document
"""

import argparse
import os
import sys
from typing import List

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data.indexed_dataset import (  # noqa: E402
    IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, get_bin_path, get_idx_path)


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="folder holding the PREFIX.bin/PREFIX.idx pairs to merge")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True,
                       help="path prefix of the merged dataset, without .bin/.idx")
    group = parser.add_argument_group(title="miscellaneous")
    group.add_argument("--multimodal", action="store_true",
                       help="accepted for Megatron's scripts; multimodal datasets are not "
                            "supported")
    return parser.parse_args(argv)


def dataset_prefixes(folder: str) -> List[str]:
    """Sorted prefixes of the datasets in ``folder``; every .bin needs its .idx and vice versa."""
    if not os.path.isdir(folder):
        raise IndexedDatasetError(f"--input {folder!r} is not a folder")
    stems = set()
    for name in os.listdir(folder):
        stem, extension = os.path.splitext(name)
        if extension in (".bin", ".idx") and os.path.isfile(os.path.join(folder, name)):
            stems.add(stem)
    prefixes = []
    for stem in sorted(stems):
        prefix = os.path.join(folder, stem)
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path} is missing: every dataset in --input needs both "
                                          ".bin and .idx")
        prefixes.append(prefix)
    if not prefixes:
        raise IndexedDatasetError(f"--input {folder!r} holds no .bin/.idx datasets")
    return prefixes


def merge(prefixes: List[str], output_prefix: str) -> None:
    """Write the datasets at ``prefixes``, in that order, as one dataset at ``output_prefix``."""
    first = IndexedDataset(prefixes[0])
    dtype = first.dtype
    first.close()
    with IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dtype) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(get_idx_path(output_prefix))


def main(argv=None) -> int:
    args = get_args(argv)
    if args.multimodal:
        print("error: --multimodal datasets are not supported", file=sys.stderr)
        return 1
    try:
        prefixes = dataset_prefixes(args.input)
        output = os.path.abspath(args.output_prefix)
        if any(os.path.abspath(p) == output for p in prefixes):
            raise IndexedDatasetError(
                f"--output-prefix {args.output_prefix!r} is one of the inputs")
        merge(prefixes, args.output_prefix)
    except IndexedDatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"Merged {len(prefixes)} datasets into {args.output_prefix}.bin/.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
