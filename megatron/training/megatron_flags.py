"""Registers Megatron-LM's flags from :mod:`megatron.training.megatron_flags_table` on a parser.

:func:`register` runs after the argument groups of :mod:`megatron.training.arguments` and adds
only the option strings those groups do not define, so a real definition always takes
precedence over a table row. It also widens the choices of flags defined there to Megatron's,
remembering the values this project refuses (:data:`EXTRA_CHOICES`).
"""

import argparse
import enum
import functools
import signal
from typing import Dict, List, NamedTuple, Tuple

from megatron.model.moe.config import parse_moe_layer_freq
from megatron.training import megatron_flags_table as table
from megatron.training.megatron_flags_table import NO_EFFECT, REFUSED, WORKS  # noqa: F401


class AttnBackend(enum.Enum):
    """Megatron-Core's attention backends, by the names and values --attention-backend takes."""
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


def _attn_backend(name: str) -> AttnBackend:
    try:
        return AttnBackend[name]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"{name!r}: choose from {', '.join(b.name for b in AttnBackend)}") from None


def _window(text: str) -> Tuple[int, ...]:
    """--window-size "(left, right)" or "left,right" as a tuple of ints."""
    try:
        return tuple(int(v) for v in text.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers like 4096,0") from None


SIGNAL_NUMBERS = [s.value for s in signal.Signals]
TYPES = {"int": int, "float": float, "str": str, "attn_backend": _attn_backend,
         "window": _window, "layer_pattern": parse_moe_layer_freq, "signal": int}

# Values of choice flags defined in arguments.py that Megatron takes and this project refuses:
# (option string, value, reason). A value the flag's own choices already hold is left alone.
EXTRA_CHOICES = (
    ("--position-embedding-type", "mrope", table.VISION),
    ("--position-embedding-type", "relative", table.T5),
    ("--transformer-impl", "inference_optimized", table.INFERENCE),
    ("--tokenizer-type", "MultimodalTokenizer", table.VISION),
    ("--tokenizer-type", "NullMultimodalTokenizer", table.VISION),
    ("--moe-token-dispatcher-type", "flex", table.FLEX),
)


class Row(NamedTuple):
    options: Tuple[str, ...]
    dest: str
    action: str
    default: object
    choices: Tuple[str, ...]
    kind: str
    reason: str


@functools.lru_cache(maxsize=None)
def rows() -> Tuple[Row, ...]:
    """The table's rows, with the dest filled in."""
    out = []
    for options, dest, action, default, choices, kind, reason in table.ROWS:
        names = tuple(options.split())
        dest = dest or names[0][2:].replace("-", "_")
        out.append(Row(names, dest, action, default, tuple(choices.split("|")) if choices else (),
                       kind, reason))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _template_actions() -> Dict[Tuple[str, ...], argparse.Action]:
    """One action per row, built once: parsers share them (argparse only reads an action while
    parsing), which keeps building a parser cheap."""
    template = argparse.ArgumentParser(add_help=False)
    return {row.options: template.add_argument(*row.options, dest=row.dest, help=_help(row),
                                                **_kwargs(row))
            for row in rows()}


# --help of the rows that work here.
WORKS_HELP = {
    "--disable-bf16-reduced-precision-matmul": "cuBLAS accumulates bf16 matmuls in full "
                                               "precision (CUDA only)",
    "--recompute-modules": "with --recompute-granularity selective, what is recomputed in "
                           "backward: core_attn (the default), mlp, moe, moe_act, layernorm, "
                           "shared_experts",
    "--apply-wd-to-qk-layernorm": "weight decay also on the query/key norms' parameters",
    "--no-weight-decay-cond-type": "apply_wd_to_qk_layernorm: as --apply-wd-to-qk-layernorm",
    "--exit-signal": "the signal --exit-signal-handler waits for (besides SIGINT)",
    "--no-check-for-nan-in-loss-and-grad": "turns off the inf/nan check of the losses and "
                                           "gradients before each optimizer step (on by "
                                           "default)",
    "--save-retain-interval": "after each save, delete older checkpoints whose iteration is not "
                              "a multiple of this (the latest is always kept)",
    "--num-virtual-stages-per-pipeline-rank": "interleaved pipeline: virtual stages per rank "
                                              "(instead of --num-layers-per-virtual-pipeline-"
                                              "stage)",
    "--eval-global-batch-size": "samples per evaluation step (default: --global-batch-size)",
    "--no-mmap-bin-files": "read each .bin into memory instead of memory-mapping it",
    "--log-progress": "append job, checkpoint, FLOP and token counts to SAVE/progress.txt",
    "--wandb-entity": "the wandb entity (team) of the --wandb-project run",
    "--logging-level": "level of the root Python logger (e.g. 20 for INFO)",
    "--max-tokens-to-oom": "tools/run_text_generation_server.py: most tokens in one request",
    "--padded-vocab-size": "the model's vocabulary size, instead of padding the tokenizer's",
    "--save-interval": "iterations between checkpoints",
    "--config-logger-dir": "write, per rank, each GPT/BERT model's constructor arguments and "
                           "config as DIR/{Class}.rank_{tp_dp_cp_pp_ep}.iter{N}.json, GPT's "
                           "initial weights (GPTModel_init_ckpt...pth) and each forward's "
                           "inputs and logits (input_and_logits...pth) and the data-parallel "
                           "wrapper's arguments (DistributedDataParallel...json), as Megatron "
                           "does",
    "--yaml-cfg": "take the whole configuration from this Megatron YAML file: top-level keys "
                  "are flag dests (train_iters, lr, ...), a language_model: section holds "
                  "TransformerConfig fields and a model_parallel: section ModelParallelConfig "
                  "fields; ${NAME} reads an environment variable; a key left out (or null) "
                  "takes this parser's default, and the run is validated as its command line "
                  "would be. Unlike Megatron, which ignores other command-line flags beside "
                  "it, any other flag given with it is refused",
    "--enable-msc": "use the Multi-Storage Client (the multi-storage-client package, configured "
                    "by MSC_CONFIG): msc://PROFILE/PATH URLs in the data paths (with "
                    "--object-storage-cache-path, --data-cache-path and --no-mmap-bin-files) "
                    "and in --save / --load (torch_dist format, through a local mirror in "
                    "--object-storage-cache-path); local paths are read directly",
    "--object-storage-cache-path": "local folder where the .idx files of msc:// data paths "
                                   "are copied (the .bin files are read in ranges from the "
                                   "storage service), and where msc:// --save / --load "
                                   "checkpoints are mirrored (checkpoints/PROFILE/PATH)",
    "--enable-ft-package": "hang detection by nvidia-resiliency-ext's rank monitor: launched by "
                           "its ft_launcher, each rank reports its setup, step and "
                           "checkpointing sections; one open past its timeout makes the "
                           "launcher restart the job, which resumes from --save",
    "--calc-ft-timeouts": "with --enable-ft-package: compute the section timeouts from the "
                          "times seen, after saves and at the end, into SAVE/ft_state.json "
                          "(read by the next run)",
    "--ft-num-warmup-iters": "with --enable-ft-package: training and evaluation steps before "
                             "the step section is timed",
    "--no-log-loss-scale-to-tensorboard": "no loss-scale scalar in TensorBoard",
    "--moe-router-force-biased": "benchmark switch: route by random normal logits plus a random "
                                 "per-expert bias of this std, so some experts get more tokens "
                                 "(< 0: one bias per layer for the whole run, the same on every "
                                 "rank; > 0: drawn again at every forward; 0: no bias)",
    "--moe-routing-trace-path": "folder for a trace of the MoE routing in training: per "
                                "rank, router_trace_rank{RANK}.jsonl with one record per "
                                "router call of each training iteration (step, block, layer, "
                                "rank, num_tokens, topk, top_indices: each token's experts "
                                "in the routing map); evaluation and recomputation forwards "
                                "are not recorded",
    "--moe-routing-trace-max-training-iters": "with --moe-routing-trace-path: trace this many "
                                              "iterations, then stop (default: all)",
    "--moe-routing-trace-capture-logits": "with --moe-routing-trace-path: also write each "
                                          "router's logits, bfloat16, to "
                                          "logits_rank{RANK}.bin (records give offset, bytes, "
                                          "shape)",
    "--moe-routing-trace-capture-hidden-states": "with --moe-routing-trace-path: also write "
                                                 "each router's input, bfloat16, to "
                                                 "hidden_states_rank{RANK}.bin (records give "
                                                 "offset, bytes, shape)",
    "--moe-routing-trace-dump-weights": "with --moe-routing-trace-path: also save each "
                                        "router's weight, biases, score function and top-k, "
                                        "as the trace first saw them, to "
                                        "router_state_rank{RANK}.pt",
}


def _help(row: Row) -> str:
    if row.kind == NO_EFFECT:
        return "accepted for Megatron scripts; no effect here: " + row.reason
    if row.kind == REFUSED:
        return "not supported here (a run that sets it stops): " + row.reason
    return WORKS_HELP[row.options[0]]


def _kwargs(row: Row) -> dict:
    if row.action in ("true", "false"):
        return {"action": f"store_{row.action}", "default": row.default}
    if row.action == "bool?":
        return {"action": argparse.BooleanOptionalAction, "default": row.default}
    nargs = row.action[-1] if row.action[-1] in "+*" else None
    kind = row.action.rstrip("+*")
    kwargs = {"type": TYPES[kind], "default": row.default, "nargs": nargs}
    if kind == "attn_backend":
        kwargs.update(choices=list(AttnBackend), default=AttnBackend[row.default],
                      metavar="{" + ",".join(b.name for b in AttnBackend) + "}")
    elif kind == "signal":
        kwargs.update(choices=SIGNAL_NUMBERS)
    elif row.choices:
        kwargs.update(choices=[TYPES[kind](c) for c in row.choices])
    return kwargs


def register(parser: argparse.ArgumentParser) -> List[Row]:
    """Add every table row whose option strings ``parser`` lacks; widen choices to Megatron's.

    Returns:
        the rows added (a row with some option strings already defined adds the others only).
    """
    known = {s: a for a in parser._actions for s in a.option_strings}
    group = parser.add_argument_group(
        "Megatron-LM flags", "every other option of Megatron-LM's parser: each works as there, "
        "has no effect here (its help says why), or is refused when set")
    added, template = [], _template_actions()
    for row in rows():
        new = [o for o in row.options if o not in known]
        if len(new) == len(row.options):
            group._add_action(template[row.options])
        elif new:
            group.add_argument(*new, dest=row.dest, help=_help(row), **_kwargs(row))
        if new:
            added.append(row)
    _widen_choices(known)
    return added


def _widen_choices(known: Dict[str, argparse.Action]) -> None:
    for option, value, reason in EXTRA_CHOICES:
        action = known.get(option)
        if action is None or action.choices is None or value in action.choices:
            continue
        action.choices = list(action.choices) + [value]
        refused = getattr(action, "refused_choices", {})
        refused[value] = reason
        action.refused_choices = refused


def refused_choice(parser: argparse.ArgumentParser, args) -> str:
    """One line for the first flag set to a value :data:`EXTRA_CHOICES` refuses, else ``""``."""
    for action in parser._actions:
        refused = getattr(action, "refused_choices", {})
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, str) and value in refused:
                return f"{action.option_strings[0]} {value} is not supported: {refused[value]}"
    return ""


def registry(added: List[Row]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(no-effect dest -> reason, refused dest -> what to do instead) of the rows added."""
    no_effect = {r.dest: r.reason for r in added if r.kind == NO_EFFECT}
    refused = {r.dest: r.reason for r in added if r.kind == REFUSED}
    return no_effect, refused
