"""Convert a GPT or BERT checkpoint: reshard a Megatron checkpoint to another TP / PP, or move
it to and from a Hugging Face folder (``--target-expert-parallel-size``: a mixture-of-experts
target's expert ranks). The command line is Megatron-LM's
``tools/checkpoint/convert.py``::

    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver megatron \
        --load-dir ckpt_tp2_pp2 --save-dir ckpt_tp1_pp1 \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1

The loader turns the source into the canonical stream of :mod:`megatron.convert.schema` one layer
at a time and the saver writes it, so memory holds about one layer, not the model. A BERT
(``--model-type BERT``) goes to and from ``BertForPreTraining`` (post-LN,
``--apply-residual-connection-post-layernorm``) or ``MegatronBertForPreTraining`` (pre-LN), or
their ``*ForMaskedLM`` without the binary head (``--bert-no-binary-head``). A Megatron
target keeps the iteration, consumed samples and LR schedule of the source; the optimizer and RNG
states are dropped (they cannot be resharded exactly), so training resumes with a fresh optimizer.

The source is never written to: a --save-dir that is --load-dir, lies inside it or contains it is
refused, as is a non-empty --save-dir without --overwrite (exit status 2, one line). Every saver
writes into a folder next to --save-dir and renames it into place once complete, so a failed
conversion changes nothing.
"""

import argparse
import itertools
import os
import sys
from typing import Iterable, Iterator, Optional

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir,
                                                os.pardir)))

import torch  # noqa: E402

from megatron.convert.schema import ConversionError, ModelMeta, Piece  # noqa: E402
from megatron.convert.target import check_source_and_target, check_target  # noqa: E402
from megatron.errors import exit_on_user_error  # noqa: E402

PROG = "convert.py"
MODEL_TYPES = ("GPT", "BERT")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a ConversionError: one line, exit status 1."""

    def error(self, message):
        raise ConversionError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", required=True,
                        help="GPT or BERT: the kind of model the source holds")
    parser.add_argument("--loader", default="megatron", choices=["megatron", "hf"])
    parser.add_argument("--saver", default="megatron", choices=["megatron", "hf"])
    parser.add_argument("--load-dir", required=True, help="the checkpoint (or HF folder) to read")
    parser.add_argument("--save-dir", required=True,
                        help="a new or empty folder to write (never --load-dir, nor a folder "
                             "inside it or holding it)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the content of a non-empty --save-dir, once the new "
                             "checkpoint is completely written (without it a non-empty "
                             "--save-dir is refused)")
    g = parser.add_argument_group("megatron loader")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="iteration to read instead of latest_checkpointed_iteration.txt's")
    g.add_argument("--true-vocab-size", type=int, default=None,
                   help="the tokenizer's size, when the tokenizer the checkpoint names is gone")
    g = parser.add_argument_group("megatron saver")
    g.add_argument("--target-tensor-parallel-size", type=int, default=None,
                   help="default: the source's")
    g.add_argument("--target-pipeline-parallel-size", type=int, default=None,
                   help="default: the source's number of pipeline stages")
    g.add_argument("--target-expert-parallel-size", type=int, default=None,
                   help="expert-parallel size of a torch-format MoE target: Megatron-LM's "
                        "mp_rank_..._{ep:03d} files, each with E / ep experts; default 1 "
                        "(Megatron-LM's)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="vocabulary padding of the target; default: the source's")
    g.add_argument("--target-ckpt-format", choices=["torch", "torch_dist"], default=None,
                   help="torch: per-rank model_optim_rng.pt files (default); torch_dist: "
                        "Megatron-Core's distributed checkpoint")
    g = parser.add_argument_group("hf saver")
    g.add_argument("--allow-no-tokenizer", action="store_true",
                   help="write the model without tokenizer files when its tokenizer cannot be "
                        "exported (NullTokenizer, or none recorded); the end-of-document id "
                        "of a NullTokenizer becomes the config's bos/eos token id")
    parser.add_argument("--target-params-dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating-point weights to this type on save")
    g = parser.add_argument_group("accepted for Megatron-LM's scripts, no effect")
    g.add_argument("--max-queue-size", type=int, default=None)
    g.add_argument("--megatron-path", default=None)
    g.add_argument("--no-checking", action="store_true")
    return parser


def _check(args) -> None:
    if args.model_type not in MODEL_TYPES:
        raise ConversionError(f"--model-type {args.model_type} is not supported: only GPT "
                              "and BERT checkpoints can be converted")
    if args.saver != "megatron":
        for flag in ("target_tensor_parallel_size", "target_pipeline_parallel_size",
                     "target_expert_parallel_size", "make_vocab_size_divisible_by",
                     "target_ckpt_format"):
            if getattr(args, flag) is not None:
                raise ConversionError(f"--{flag.replace('_', '-')} applies only to "
                                      f"--saver megatron, not --saver {args.saver}")
    if (args.target_expert_parallel_size or 1) > 1 and args.target_ckpt_format == "torch_dist":
        raise ConversionError(f"--target-expert-parallel-size {args.target_expert_parallel_size}"
                              " applies only to --target-ckpt-format torch: a torch_dist "
                              "checkpoint stores every expert at its global number and loads "
                              "at any expert-parallel size")
    if args.saver != "hf" and args.allow_no_tokenizer:
        raise ConversionError("--allow-no-tokenizer applies only to --saver hf")
    if args.loader != "megatron":
        for flag in ("ckpt_step", "true_vocab_size"):
            if getattr(args, flag) is not None:
                raise ConversionError(f"--{flag.replace('_', '-')} applies only to "
                                      f"--loader megatron, not --loader {args.loader}")
    # Before anything is read: the target must not be the source, nor hold content.
    check_source_and_target(args.load_dir, args.save_dir)
    check_target(args.save_dir, args.overwrite)


def _load(args, view: Optional[str] = None) -> Iterator[Piece]:
    """The source's stream: its weights, or one optimizer field (``view``) in their shapes."""
    if args.loader == "hf":
        from megatron.convert.hf import load_hf

        return load_hf(args.load_dir)
    from megatron.convert import dist_io
    from megatron.convert.megatron_io import load_megatron

    if dist_io.find_dist_checkpoint(args.load_dir, args.ckpt_step) is not None:
        return dist_io.load_dist(args.load_dir, args.ckpt_step,
                                 true_vocab_size=args.true_vocab_size, view=view)
    return load_megatron(args.load_dir, args.ckpt_step, true_vocab_size=args.true_vocab_size,
                         view=view)


def _cast(pieces: Iterable[Piece], dtype: torch.dtype) -> Iterator[Piece]:
    """The stream with every floating-point tensor (and the meta's params dtype) in ``dtype``."""
    for piece in pieces:
        if piece.meta is not None:
            piece.meta.params_dtype = dtype
        piece.tensors = {k: t.to(dtype) if t.is_floating_point() else t
                         for k, t in piece.tensors.items()}
        yield piece


class _Counter:
    """Passes the stream through, counting its layers."""

    def __init__(self, pieces: Iterable[Piece]):
        self.pieces, self.layers = pieces, 0

    def __iter__(self):
        for piece in self.pieces:
            self.layers += piece.kind == "layer"
            yield piece


def _source_layout(meta: ModelMeta) -> Optional[tuple]:
    if meta.source_args is None:
        return None
    return (meta.source_args.get("tensor_model_parallel_size", 1),
            meta.source_args.get("pipeline_model_parallel_size", 1),
            meta.source_args.get("expert_model_parallel_size", 1) or 1)


def _describe(kind: str, layout: Optional[tuple], fmt: Optional[str] = None) -> str:
    described = kind if layout is None else f"{kind} TP={layout[0]} PP={layout[1]}"
    if layout is not None and len(layout) > 2 and layout[2] > 1:
        described += f" EP={layout[2]}"
    return described if fmt is None else f"{described} ({fmt})"


def convert(args) -> str:
    """Run the conversion ``args`` describes; returns the summary printed at the end."""
    _check(args)
    pieces = _load(args)
    meta_piece = next(pieces, None)
    if meta_piece is None or meta_piece.meta is None:
        raise ConversionError(f"--load-dir {args.load_dir}: the loader yielded no model")
    meta = meta_piece.meta
    if meta.model_type != args.model_type:
        raise ConversionError(f"--model-type {args.model_type}, but --load-dir {args.load_dir} "
                              f"holds a {meta.model_type} model; pass --model-type "
                              f"{meta.model_type}")
    source = _source_layout(meta)
    stream = itertools.chain([meta_piece], pieces)
    if args.target_params_dtype is not None:
        stream = _cast(stream, DTYPES[args.target_params_dtype])
    counter = _Counter(stream)
    source_format = target_format = None
    if meta.source_args is not None:
        source_format = meta.source_args.get("ckpt_format") or "torch"
    if args.saver == "megatron":
        from megatron.convert.dist_io import save_dist
        from megatron.convert.megatron_io import save_megatron

        tp = args.target_tensor_parallel_size or (source or (1, 1))[0]
        pp = args.target_pipeline_parallel_size or (source or (1, 1))[1]
        ep = args.target_expert_parallel_size or 1
        target_format = args.target_ckpt_format or "torch"
        if meta.source_args is not None:
            meta.source_args["ckpt_format"] = target_format
            if "use_dist_ckpt" in meta.source_args:
                meta.source_args["use_dist_ckpt"] = target_format == "torch_dist"
        streams = None
        if meta.optimizer is not None:
            streams = {field: _load(args, view=field)
                       for field in ("exp_avg", "exp_avg_sq", "main")}
        if target_format == "torch_dist":
            save_dist(counter, args.save_dir, tp, pp,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      optimizer_streams=streams, overwrite=args.overwrite)
        else:
            save_megatron(counter, args.save_dir, tp, pp,
                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                          optimizer_streams=streams, target_ep=ep, overwrite=args.overwrite)
        target = (tp, pp, ep if target_format == "torch" else 1)
        if streams is not None:
            dropped = "RNG state (the Adam state is resharded, the LR schedule is kept)"
        else:
            note = f" ({meta.optimizer_note})" if meta.optimizer_note else ""
            dropped = f"optimizer state{note}, RNG state (the LR schedule is kept)"
    else:
        from megatron.convert.hf import save_hf

        save_hf(counter, args.save_dir, allow_no_tokenizer=args.allow_no_tokenizer,
                overwrite=args.overwrite)
        target = None
        dropped = "optimizer state, RNG state, LR schedule, iteration and consumed samples"
    if source is None and args.loader == "megatron":
        source = (1, 1)
    return (f"converted {meta.model_type}: {counter.layers} layers, hidden {meta.hidden_size}, "
            f"vocabulary {meta.vocab_size}, iteration {meta.iteration}\n"
            f"  {_describe(args.loader, source, source_format)} {args.load_dir}\n"
            f"  -> {_describe(args.saver, target, target_format)} {args.save_dir}\n"
            f"  dropped: {dropped if args.loader == 'megatron' else 'nothing'}")


def main(argv=None) -> int:
    with exit_on_user_error(prog=PROG):
        args = build_parser().parse_args(argv)
        print(convert(args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
