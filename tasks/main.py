"""Run a downstream task on a trained checkpoint, with the training run's model flags + --load.

Zero-shot GPT evaluation, as Megatron-LM's ``tasks/main.py`` runs it::

    python tasks/main.py --task WIKITEXT103 --valid-data wiki.test.tokens --overlapping-eval 32 \\
        --load CKPT <the run's model and tokenizer flags> --micro-batch-size 8
    torchrun --nproc_per_node 4 tasks/main.py --task LAMBADA --valid-data lambada_test.jsonl \\
        --strict-lambada --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --load CKPT <the run's model and tokenizer flags>

``--valid-data`` takes one or more files; for WIKITEXT103 each is a plain text file, a JSONL
file of ``{"text": ...}`` documents, or the prefix of a ``.bin``/``.idx`` dataset (see
``tasks/zeroshot_gpt/datasets.py``). The checkpoint must be loaded with the tensor / pipeline
sizes it was saved with; any data-parallel size works.
"""

import argparse
import os
import sys
from typing import List, Optional

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

TASKS = ("WIKITEXT103", "LAMBADA")


def get_tasks_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's task flags (the zero-shot GPT ones)."""
    group = parser.add_argument_group(title="tasks")
    group.add_argument("--task", type=str, default=None,
                       help=f"task to run: {', '.join(TASKS)}")
    group.add_argument("--valid-data", nargs="*", default=None,
                       help="file(s) to evaluate: text, JSONL of {\"text\": ...} lines, or a "
                            ".bin/.idx prefix (perplexity); JSONL passages (LAMBADA)")
    group.add_argument("--overlapping-eval", type=int, default=32,
                       help="stride of the rolling perplexity windows: each window after the "
                            "first scores only its last N tokens (N = --seq-length: "
                            "consecutive windows)")
    group.add_argument("--strict-lambada", action="store_true",
                       help="LAMBADA target = every token of the last word (default: the last "
                            "token)")
    return parser


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        from megatron.training.arguments import ArgumentsError

        raise ArgumentsError(message)


def check_task_args(argv: List[str]) -> Optional[argparse.Namespace]:
    """The task flags of ``argv``, checked before any process group or model is built (None
    with ``--help``, which the full parser answers).

    Raises:
        ArgumentsError: naming the flag, the value seen and what is expected.
    """
    from megatron.training.arguments import ArgumentsError
    from tasks.zeroshot_gpt.datasets import is_indexed_prefix

    if "-h" in argv or "--help" in argv:
        return None
    parser = get_tasks_args(_RaisingParser(add_help=False, allow_abbrev=False))
    args, _ = parser.parse_known_args(argv)
    if args.task is None:
        raise ArgumentsError(f"--task is required; expected one of {', '.join(TASKS)}")
    if args.task not in TASKS:
        raise ArgumentsError(f"--task {args.task} is not implemented; expected one of "
                             f"{', '.join(TASKS)}")
    if not args.valid_data:
        raise ArgumentsError(f"--valid-data is required for --task {args.task}: the file(s) to "
                             "evaluate")
    for path in args.valid_data:
        if not (os.path.isfile(path) or is_indexed_prefix(path)):
            raise ArgumentsError(f"--valid-data {path}: no such file (nor {path}.idx)")
    if args.task == "WIKITEXT103" and args.overlapping_eval < 1:
        raise ArgumentsError(f"--overlapping-eval must be >= 1, got {args.overlapping_eval}")
    return args


def _check_against_model(args) -> None:
    from megatron.training.arguments import ArgumentsError

    if args.task == "WIKITEXT103" and args.overlapping_eval > args.seq_length:
        raise ArgumentsError(f"--overlapping-eval ({args.overlapping_eval}) is larger than "
                             f"--seq-length ({args.seq_length}); expected 1..{args.seq_length}")


def main(argv: Optional[List[str]] = None) -> List[dict]:
    """Parse the flags, start the process group, run the task; returns its results per
    ``--valid-data`` file (the same on every rank)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    check_task_args(argv)
    from megatron.training import global_vars
    from megatron.core import parallel_state
    from megatron.inference import initialize_for_inference

    args, pstate, tokenizer = initialize_for_inference(get_tasks_args, argv)
    try:
        _check_against_model(args)
        from tasks.zeroshot_gpt.evaluate import main as zeroshot_main

        return zeroshot_main(args, pstate, tokenizer)
    finally:
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()


def _close_process_group() -> None:
    """Leave the job together: a gloo rank that exits with its process group still open can
    abort while a peer is still talking to it, failing the launcher's exit status."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    from megatron.errors import exit_on_user_error

    with exit_on_user_error(exit_code=2):
        check_task_args(sys.argv[1:])
    with exit_on_user_error():
        main()
    _close_process_group()
