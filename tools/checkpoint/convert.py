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

``--loader`` and ``--saver`` take Megatron-LM's plugin names. Loaders: ``megatron`` (alias
``legacy``, ``core``, ``mcore``) reads a Megatron checkpoint of any format and key spelling;
``hf`` (alias ``llama_mistral``, ``mixtral_hf``, ``llama2_hf``) reads a Hugging Face folder, with
Megatron's ``--model-size`` (checked against the folder's ``model_type``),
``--checkpoint-type hf``, ``--tokenizer-model`` (the tokenizer the target names) and ``--bf16`` /
``--fp16``. Savers: ``megatron`` (alias ``legacy``) writes the legacy model's keys;
``core`` (alias ``mcore``) writes Megatron-Core's, of its TransformerEngine or local layers
(``--saver-transformer-impl``, default transformer_engine as Megatron's), as the state dict of
Megatron-LM's Megatron-Core GPT; ``hf`` writes a Hugging Face folder.

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
# Megatron-LM's plugin names -> what reads or writes them here.
LOADERS = {"megatron": "megatron", "legacy": "megatron", "core": "megatron", "mcore": "megatron",
           "hf": "hf", "llama_mistral": "hf", "mixtral_hf": "hf", "llama2_hf": "hf"}
SAVERS = {"megatron": "megatron", "legacy": "megatron", "core": "megatron", "mcore": "megatron",
          "hf": "hf"}
CORE_SAVERS = ("core", "mcore")
# Megatron's --model-size choices (its llama_mistral loader) -> the folder's model_type.
MODEL_SIZES = {"llama2-7B": "llama", "llama2-13B": "llama", "llama2-70B": "llama",
               "llama2-7Bf": "llama", "llama2-13Bf": "llama", "llama2-70Bf": "llama",
               "llama3": "llama", "mistral": "mistral", "yi-34B": "llama", "qwen2.5": "qwen2"}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a ConversionError: one line, exit status 1."""

    def error(self, message):
        raise ConversionError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-type", required=True,
                        help="GPT or BERT: the kind of model the source holds")
    parser.add_argument("--loader", default="megatron", choices=sorted(LOADERS),
                        help="megatron (legacy, core, mcore): a Megatron checkpoint; hf "
                             "(llama_mistral, mixtral_hf, llama2_hf): a Hugging Face folder")
    parser.add_argument("--saver", default="megatron", choices=sorted(SAVERS),
                        help="megatron (legacy): the legacy model's keys; core (mcore): "
                             "Megatron-Core's; hf: a Hugging Face folder")
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
    g.add_argument("--vocab-file", default=None,
                   help="a vocabulary file whose size is the tokenizer's (as --true-vocab-size; "
                        "a JSON vocabulary's entries or a text file's lines)")
    g = parser.add_argument_group("hf loader (Megatron-LM's llama_mistral / mixtral_hf flags)")
    g.add_argument("--model-size", choices=list(MODEL_SIZES), default=None,
                   help="Megatron's model family name; the folder's config.json must be of it")
    g.add_argument("--checkpoint-type", choices=["hf", "meta"], default=None,
                   help="hf: a Hugging Face folder (Meta's original files are not read here)")
    g.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer the target names (a folder or tokenizer.json: "
                        "HuggingFaceTokenizer; a SentencePiece .model: Llama2Tokenizer for "
                        "llama2 sizes, else GPTSentencePieceTokenizer); default: the folder's own")
    g.add_argument("--bf16", action="store_true", help="as --target-params-dtype bf16")
    g.add_argument("--fp16", action="store_true", help="as --target-params-dtype fp16")
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
    g.add_argument("--saver-transformer-impl", choices=["transformer_engine", "local"],
                   default=None,
                   help="--saver core: the Megatron-Core layers whose keys the files hold "
                        "(default transformer_engine: fused layer-norm names and extra state)")
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
    g.add_argument("--loader-transformer-impl", choices=["local", "transformer_engine"],
                   default=None, help="the reader takes either layer spelling")
    return parser


def _megatron_names(args) -> None:
    """Megatron-LM's plugin names and loader flags as what they do here."""
    args.loader_kind, args.saver_kind = LOADERS[args.loader], SAVERS[args.saver]
    if args.checkpoint_type == "meta":
        raise ConversionError("--checkpoint-type meta: Meta's original consolidated.*.pth files "
                              "are not read here; convert them to a Hugging Face folder "
                              "(transformers' convert_llama_weights_to_hf.py) and pass "
                              "--checkpoint-type hf")
    hf_flags = ("model_size", "checkpoint_type", "tokenizer_model")
    for flag in hf_flags + ("bf16", "fp16"):
        if getattr(args, flag) and args.loader_kind != "hf":
            raise ConversionError(f"--{flag.replace('_', '-')} applies to a Hugging Face "
                                  f"folder (--loader hf, llama_mistral, mixtral_hf), not "
                                  f"--loader {args.loader}")
    if args.bf16 and args.fp16:
        raise ConversionError("--bf16 and --fp16: choose one")
    half = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if half is not None:
        if args.target_params_dtype not in (None, half):
            raise ConversionError(f"--{half} and --target-params-dtype "
                                  f"{args.target_params_dtype} disagree")
        args.target_params_dtype = half
    if args.vocab_file is not None:
        if args.loader_kind != "megatron":
            raise ConversionError("--vocab-file applies to --loader megatron (a Hugging Face "
                                  "folder's config.json gives the vocabulary)")
        size = _vocab_file_size(args.vocab_file)
        if args.true_vocab_size not in (None, size):
            raise ConversionError(f"--vocab-file {args.vocab_file} has {size} entries but "
                                  f"--true-vocab-size is {args.true_vocab_size}")
        args.true_vocab_size = size
    if args.saver_transformer_impl is not None and args.saver not in CORE_SAVERS:
        raise ConversionError("--saver-transformer-impl applies only to --saver core (mcore)")
    args.key_style = "legacy"
    if args.saver in CORE_SAVERS and args.target_ckpt_format != "torch_dist":
        args.key_style = args.saver_transformer_impl or "transformer_engine"


def _vocab_file_size(path: str) -> int:
    """Entries of a JSON vocabulary, else lines of a text one."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConversionError(f"--vocab-file {path}: {err.strerror}") from None
    try:
        vocab = json.loads(text)
    except ValueError:
        return sum(1 for line in text.splitlines() if line.strip())
    if not isinstance(vocab, (dict, list)):
        raise ConversionError(f"--vocab-file {path}: a JSON vocabulary is an object or a list")
    return len(vocab)


def _tokenizer_fields(path: str, model_size: Optional[str]) -> dict:
    """What a target's args name for ``--tokenizer-model path``."""
    from megatron.convert.hf_tokenizer import detect_tokenizer

    if os.path.isdir(path):
        fields = detect_tokenizer(path)
        if fields["tokenizer_type"] is None:
            raise ConversionError(f"--tokenizer-model {path}: the folder has no tokenizer files "
                                  "(tokenizer.json, tokenizer.model or vocab.json + merges.txt)")
        return fields
    if not os.path.isfile(path):
        raise ConversionError(f"--tokenizer-model {path}: no such file or folder")
    full = os.path.abspath(path)
    if path.endswith(".model"):
        kind = ("Llama2Tokenizer" if (model_size or "").startswith("llama2")
                else "GPTSentencePieceTokenizer")
    else:
        kind = "HuggingFaceTokenizer"
    return dict(tokenizer_type=kind, vocab_file=None, merge_file=None, tokenizer_model=full)


def _check_model_size(args) -> None:
    """``--model-size`` against the folder's ``model_type``."""
    import json

    if args.model_size is None:
        return
    config = os.path.join(args.load_dir, "config.json")
    try:
        with open(config, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError):
        return   # the loader names what is wrong with the folder
    want = MODEL_SIZES[args.model_size]
    if model_type != want:
        raise ConversionError(f"--model-size {args.model_size} is a {want} model, but "
                              f"{config} says model_type {model_type!r}")


def _check(args) -> None:
    _megatron_names(args)
    if args.model_type not in MODEL_TYPES:
        raise ConversionError(f"--model-type {args.model_type} is not supported: only GPT "
                              "and BERT checkpoints can be converted")
    if args.saver_kind != "megatron":
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
    if args.saver_kind != "hf" and args.allow_no_tokenizer:
        raise ConversionError("--allow-no-tokenizer applies only to --saver hf")
    if args.loader_kind != "megatron":
        for flag in ("ckpt_step", "true_vocab_size"):
            if getattr(args, flag) is not None:
                raise ConversionError(f"--{flag.replace('_', '-')} applies only to "
                                      f"--loader megatron, not --loader {args.loader}")
    # Before anything is read: the target must not be the source, nor hold content.
    check_source_and_target(args.load_dir, args.save_dir)
    check_target(args.save_dir, args.overwrite)
    if args.loader_kind == "hf":
        _check_model_size(args)


def _load(args, view: Optional[str] = None) -> Iterator[Piece]:
    """The source's stream: its weights, or one optimizer field (``view``) in their shapes."""
    if args.loader_kind == "hf":
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
    if args.tokenizer_model is not None:
        for field, value in _tokenizer_fields(args.tokenizer_model, args.model_size).items():
            setattr(meta, field, value)
    source = _source_layout(meta)
    stream = itertools.chain([meta_piece], pieces)
    if args.target_params_dtype is not None:
        stream = _cast(stream, DTYPES[args.target_params_dtype])
    counter = _Counter(stream)
    source_format = target_format = None
    if meta.source_args is not None:
        source_format = meta.source_args.get("ckpt_format") or "torch"
    if args.saver_kind == "megatron":
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
        if meta.optimizer is not None and args.key_style == "legacy":
            streams = {field: _load(args, view=field)
                       for field in ("exp_avg", "exp_avg_sq", "main")}
        if target_format == "torch_dist":
            save_dist(counter, args.save_dir, tp, pp,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      optimizer_streams=streams, overwrite=args.overwrite)
        else:
            save_megatron(counter, args.save_dir, tp, pp,
                          make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                          optimizer_streams=streams, target_ep=ep, overwrite=args.overwrite,
                          key_style=args.key_style)
        target = (tp, pp, ep if target_format == "torch" else 1)
        if streams is not None:
            dropped = "RNG state (the Adam state is resharded, the LR schedule is kept)"
        elif meta.optimizer is not None:
            dropped = ("optimizer state (--saver core writes the weights only), RNG state (the "
                       "LR schedule is kept)")
        else:
            note = f" ({meta.optimizer_note})" if meta.optimizer_note else ""
            dropped = f"optimizer state{note}, RNG state (the LR schedule is kept)"
    else:
        from megatron.convert.hf import save_hf

        save_hf(counter, args.save_dir, allow_no_tokenizer=args.allow_no_tokenizer,
                overwrite=args.overwrite)
        target = None
        dropped = "optimizer state, RNG state, LR schedule, iteration and consumed samples"
    if source is None and args.loader_kind == "megatron":
        source = (1, 1)
    if args.key_style != "legacy":
        target_format = f"{target_format}, Megatron-Core {args.key_style} keys"
    return (f"converted {meta.model_type}: {counter.layers} layers, hidden {meta.hidden_size}, "
            f"vocabulary {meta.vocab_size}, iteration {meta.iteration}\n"
            f"  {_describe(args.loader, source, source_format)} {args.load_dir}\n"
            f"  -> {_describe(args.saver, target, target_format)} {args.save_dir}\n"
            f"  dropped: {dropped if args.loader_kind == 'megatron' else 'nothing'}")


def main(argv=None) -> int:
    with exit_on_user_error(prog=PROG):
        args = build_parser().parse_args(argv)
        print(convert(args), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
