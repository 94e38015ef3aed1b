"""Write the ``--per-dataset-sequences-path`` JSON file of a run's data prefixes (Megatron's tool).

It takes the run's data flags and records, for every prefix they name, ``[N, D]`` from its
``.idx`` header: the number of sequences and of document-index entries. Training with
``--per-dataset-sequences-path FILE`` then opens each prefix from these counts instead of reading
its header.

Example::

    python tools/build_sequences_per_dataset.py --data-path 0.3 data/a_document 0.7 \\
        data/b_document --per-dataset-sequences-path data/sequences.json
"""

import argparse
import json
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.data import sequences_per_dataset  # noqa: E402
from megatron.data.dataset_utils import DataError, parse_data_path  # noqa: E402
from megatron.errors import exit_on_user_error  # noqa: E402


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        parser.add_argument(flag, nargs="*", default=None,
                            help="as for training: one prefix, or weight/prefix pairs")
    parser.add_argument("--data-args-path", type=str, default=None,
                        help="a file holding the --data-path value")
    parser.add_argument("--per-split-data-args-path", type=str, default=None,
                        help='a JSON file {"train": [...], "valid": [...], "test": [...]}')
    parser.add_argument("--per-dataset-sequences-path", type=str, required=True,
                        help="the JSON file to write")
    return parser.parse_args(argv)


def _path_values(args) -> List[tuple]:
    """(flag, value) of every data-path flag given, file-held ones read."""
    values = [(f"--{name.replace('_', '-')}", getattr(args, name))
              for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path")]
    if args.data_args_path:
        with open(args.data_args_path) as f:
            values.append(("--data-args-path", f.read().split()))
    if args.per_split_data_args_path:
        with open(args.per_split_data_args_path) as f:
            splits = json.load(f)
        for split, value in sorted(splits.items()):
            values.append(("--per-split-data-args-path",
                           value.split() if isinstance(value, str) else value))
    return [(flag, [str(v) for v in value]) for flag, value in values if value]


def data_prefixes(args) -> List[str]:
    """Every prefix the data flags name, each once, in the order given."""
    seen: List[str] = []
    for flag, value in _path_values(args):
        prefixes, _ = parse_data_path(value, flag)
        seen += [p for p in prefixes if p not in seen]
    if not seen:
        raise DataError("no data prefixes: give --data-path (or --train-data-path, ...)")
    return seen


def main(argv: Optional[List[str]] = None) -> None:
    args = get_args(argv)
    counts = sequences_per_dataset.build(data_prefixes(args))
    with open(args.per_dataset_sequences_path, "w") as f:
        json.dump({p: list(c) for p, c in counts.items()}, f, indent=1)
    print(f"wrote the counts of {len(counts)} data prefixes to "
          f"{args.per_dataset_sequences_path}")


if __name__ == "__main__":
    with exit_on_user_error():
        main()
