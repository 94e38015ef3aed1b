"""Write a JSONL corpus of the Python standard library's source files.

Each line is ``{"content": <file text>, "path": <path relative to the stdlib folder>}``, in sorted
path order, so the same Python installation always gives the same corpus. It is the offline code
corpus the examples, tests and benchmarks tokenize (any machine with Python has it).

Example::

    python tools/build_stdlib_corpus.py --output data/stdlib.jsonl --max-bytes 8000000
"""

import argparse
import json
import os
import sys
import sysconfig
from typing import Iterator, List, Optional, Tuple

_NEVER = ("site-packages", "dist-packages", "__pycache__")
_TESTS = ("test", "tests", "idle_test")


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=str, required=True, help="JSONL file to write")
    parser.add_argument("--max-files", type=int, default=None, help="stop after this many files")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="stop before the corpus's source text would exceed this many bytes")
    parser.add_argument("--include-tests", action="store_true",
                        help="also take files under test/tests folders (skipped by default)")
    parser.add_argument("--stdlib", type=str, default=None,
                        help="folder to read (default: sysconfig's stdlib path)")
    return parser.parse_args(argv)


def stdlib_sources(root: str, include_tests: bool) -> List[str]:
    """Every ``.py`` under ``root``, sorted, without site-packages (and test folders by default)."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _NEVER
                         and (include_tests or d not in _TESTS)]
        found.extend(os.path.join(folder, f) for f in files if f.endswith(".py"))
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def iter_documents(root: str, include_tests: bool, max_files: Optional[int],
                   max_bytes: Optional[int], skipped: List[str]) -> Iterator[Tuple[str, str]]:
    """(relative path, text) pairs within the limits; non-UTF-8 files go to ``skipped``."""
    count, total = 0, 0
    for path in stdlib_sources(root, include_tests):
        if max_files is not None and count >= max_files:
            return
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(path)
            continue
        if max_bytes is not None and total + len(raw) > max_bytes:
            return
        count += 1
        total += len(raw)
        yield os.path.relpath(path, root).replace(os.sep, "/"), text


def main(argv=None) -> int:
    args = get_args(argv)
    root = args.stdlib or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        print(f"error: --stdlib {root!r} is not a folder", file=sys.stderr)
        return 1
    skipped: List[str] = []
    documents, size = 0, 0
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    temporary = args.output + ".tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        for relative, text in iter_documents(root, args.include_tests, args.max_files,
                                             args.max_bytes, skipped):
            out.write(json.dumps({"content": text, "path": relative}, ensure_ascii=False) + "\n")
            documents += 1
            size += len(text.encode("utf-8"))
    os.replace(temporary, args.output)
    print(f"Wrote {documents} files ({size / 1e6:.2f} MB of source) from {root} to {args.output}; "
          f"skipped {len(skipped)} non-UTF-8 file(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
