"""Every option of Megatron-LM's parser parses here, with Megatron's dest, action, default and
choices, and the table of Megatron's flags stays a table of what arguments.py does not define.

``tests/data/megatron_lm_flags.tsv`` is a record of facts about Megatron-LM's command line at one
HEAD (its first comment line names the commit): for every option of Megatron-LM's
``megatron/training/arguments.py`` parser, its option strings, dest, kind of action, default (as
``repr``) and choices. It is compared here with this project's parser as a whole.
"""

import argparse
import pathlib

import pytest

from megatron.training import arguments, megatron_flags
from megatron.training.arguments import ArgumentsError, build_parser, parse_args, validate_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
TSV = ROOT / "tests" / "data" / "megatron_lm_flags.tsv"

MINIMAL = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
           "--max-position-embeddings 8 --micro-batch-size 1").split()

KINDS = {"Store": argparse._StoreAction, "StoreTrue": argparse._StoreTrueAction,
         "StoreFalse": argparse._StoreFalseAction,
         "BooleanOptional": argparse.BooleanOptionalAction}

# Where this project's own definition (in megatron/training/arguments.py) knowingly differs from
# Megatron's: dest -> (what differs, why). Everything else must match the record.
DEVIATIONS = {
    "norm_epsilon": ("dest", "Megatron stores --norm-epsilon in layernorm_epsilon; here "
                     "--layernorm-epsilon is a separate older spelling, mapped onto norm_epsilon"),
    "apply_layernorm_1p": ("dest", "Megatron stores it in layernorm_zero_centered_gamma"),
    "use_dist_ckpt": ("dest", "Megatron keeps it as use_dist_ckpt_deprecated; here it still "
                      "selects --ckpt-format torch_dist"),
    "cross_entropy_loss_fusion": ("default", "the fused cross-entropy is on by default here; "
                                  "its numbers are the unfused ones"),
    "transformer_impl": ("default", "this project's layers are 'local'; transformer_engine is "
                         "accepted with a note"),
    "local_rank": ("default", "None here: the launcher's LOCAL_RANK is read when the process "
                   "group starts"),
    "profile_ranks": ("default", "[0] here (rank 0 profiles), as Megatron's earlier default"),
    "eval_interval": ("default", "1000 here, as in earlier Megatron releases"),
    "split": ("default", "Megatron sets '969, 30, 1' during validation when --split is not "
              "given; here it is the parser default"),
    "wandb_project": ("default", "'' here; both mean no wandb run"),
    "wandb_exp_name": ("default", "'' here; both mean no run name"),
    "wandb_save_dir": ("default", "'' here; both mean the default folder"),
}


def _records():
    lines = [ln.rstrip("\n").split("\t") for ln in TSV.read_text().splitlines()
             if not ln.startswith("#")]
    header, body = lines[0], lines[1:]
    assert header == ["options", "dest", "kind", "default", "choices"]
    return [dict(zip(header, row)) for row in body]


def _by_option(parser):
    return {s: a for a in parser._actions for s in a.option_strings}


def _defaults(parser):
    """dest -> the value a command line without the flag gives (argparse: the first action's)."""
    out = {}
    for action in parser._actions:
        out.setdefault(action.dest, action.default)
    return out


def test_the_record_is_megatrons_whole_parser():
    records = _records()
    assert len(records) == 838
    assert "d98e8a64dd" in TSV.read_text().splitlines()[0]


def test_every_megatron_option_parses_with_megatrons_dest_default_and_choices():
    actions = _by_option(build_parser())
    missing, wrong = [], []
    for rec in _records():
        for option in rec["options"].split():
            action = actions.get(option)
            if action is None:
                missing.append(option)
                continue
            deviation = DEVIATIONS.get(action.dest, ("", ""))[0]
            if action.dest != rec["dest"] and deviation != "dest":
                wrong.append((option, "dest", action.dest, rec["dest"]))
            if not isinstance(action, KINDS[rec["kind"]]):
                wrong.append((option, "kind", type(action).__name__, rec["kind"]))
            default = repr(action.default)   # the record holds each option's own default
            if default != rec["default"] and not deviation:
                wrong.append((option, "default", default, rec["default"]))
            choices = {str(c) for c in action.choices or ()}
            if not choices >= set(filter(None, rec["choices"].split("|"))):
                wrong.append((option, "choices", sorted(choices), rec["choices"]))
    assert not missing, f"Megatron options this parser does not know: {missing}"
    assert not wrong, wrong


def test_deviations_are_real():
    """A deviation that no longer differs is removed from DEVIATIONS."""
    parser = build_parser()
    actions, defaults = _by_option(parser), _defaults(parser)
    by_dest = {}
    for rec in _records():
        for option in rec["options"].split():
            by_dest.setdefault(actions[option].dest, []).append((actions[option], rec))
    for dest, (what, _) in DEVIATIONS.items():
        pairs = by_dest[dest]
        if what == "dest":
            assert any(a.dest != r["dest"] for a, r in pairs), dest
        else:
            assert any(repr(defaults[dest]) != r["default"] for _, r in pairs), dest


def test_no_table_row_is_shadowed_by_a_real_definition():
    """A row whose every option string arguments.py now defines is a leftover: remove it."""
    own = _by_option(arguments._own_parser())
    leftovers = [row.options for row in megatron_flags.rows()
                 if all(o in own for o in row.options)]
    assert not leftovers, f"defined in arguments.py and still in megatron_flags_table: {leftovers}"


def test_table_rows_are_unique_and_well_formed():
    rows = megatron_flags.rows()
    options = [o for row in rows for o in row.options]
    assert len(options) == len(set(options))
    for row in rows:
        assert row.kind in (megatron_flags.WORKS, megatron_flags.NO_EFFECT, megatron_flags.REFUSED)
        assert (row.reason is None) == (row.kind == megatron_flags.WORKS), row
        if row.kind == megatron_flags.REFUSED:
            assert "use" in row.reason or "drop" in row.reason, row
        if row.kind == megatron_flags.WORKS:
            assert megatron_flags.WORKS_HELP[row.options[0]], row


def test_value_types_follow_the_defaults():
    """A stored flag whose Megatron default is a float parses floats; one whose default is an
    int parses ints (or floats, where Megatron's type is float with a whole default)."""
    actions = _by_option(build_parser())
    for row in megatron_flags.rows():
        action = actions[row.options[0]]
        default = row.default
        if row.action in ("true", "false", "bool?") or isinstance(default, bool):
            continue
        if isinstance(default, int) and not row.choices:
            assert action.type in (int, float), row
        if isinstance(default, float):
            assert action.type is float, row


def test_types_follow_megatron():
    args = parse_args(argv=MINIMAL + [
        "--recompute-modules", "core_attn", "--attention-backend", "flash", "--window-size",
        "(128,0)", "--moe-router-bias-update-rate", "0.01", "--exit-signal", "2",
        "--hierarchical-context-parallel-sizes", "2", "4", "--no-rope-freq", "4"])
    assert args.recompute_modules == ["core_attn"]
    assert args.attention_backend is megatron_flags.AttnBackend.flash
    assert args.window_size == (128, 0)
    assert args.moe_router_bias_update_rate == 0.01
    assert args.exit_signal == 2
    assert args.hierarchical_context_parallel_sizes == [2, 4]
    assert args.no_rope_freq == 4


def test_a_refused_value_of_a_widened_choice_stops_in_one_line():
    for flags, flag in ((["--position-embedding-type", "relative"],
                         "--position-embedding-type relative"),
                        (["--position-embedding-type", "mrope"], "--position-embedding-type mrope"),
                        (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type")):
        with pytest.raises(ArgumentsError) as err:
            validate_args(parse_args(argv=MINIMAL + flags))
        message = str(err.value)
        assert message.startswith(flag) and "\n" not in message and "not supported" in message


def test_transformer_engine_is_accepted_with_one_note(capsys):
    args = validate_args(parse_args(argv=MINIMAL + ["--transformer-impl", "transformer_engine"]))
    assert args.transformer_impl == "transformer_engine"
    notes = [ln for ln in capsys.readouterr().out.splitlines() if "--transformer-impl" in ln]
    assert len(notes) == 1 and "same function" in notes[0], notes


def test_cp_comm_type_takes_megatrons_list_and_spelling():
    common = MINIMAL + ["--context-parallel-size", "2"]

    def validated(*types):
        args = parse_args(argv=common + ["--cp-comm-type", *types])
        args.world_size = 2
        return validate_args(args)

    assert validated("allgather").cp_comm_type == "all_gather"
    assert validated("a2a", "a2a").cp_comm_type == "a2a"   # one per layer, all the same
    assert validated("p2p", "allgather").cp_comm_type == ["p2p", "all_gather"]  # per layer
    with pytest.raises(ArgumentsError, match="^--cp-comm-type p2p a2a p2p: give one type for "
                                             "every layer, or one per layer"):
        validated("p2p", "a2a", "p2p")
    with pytest.raises(ArgumentsError, match=r"^--cp-comm-type a2a\+p2p needs "
                                             "--hierarchical-context-parallel-sizes"):
        validated("a2a+p2p")


def test_load_balancing_takes_megatrons_one_element_lists():
    moe = MINIMAL + ["--num-experts", "4", "--no-bias-gelu-fusion"]
    args = validate_args(parse_args(argv=moe + ["--moe-router-load-balancing-type",
                                                "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3"]))
    assert args.moe_router_load_balancing_type == "seq_aux_loss"
    assert args.moe_aux_loss_coeff == 1e-3
    args = validate_args(parse_args(argv=moe))
    assert (args.moe_router_load_balancing_type, args.moe_aux_loss_coeff) == ("aux_loss", 0.0)
    args = validate_args(parse_args(argv=moe + ["--moe-router-load-balancing-type", "aux_loss",
                                                "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
                                                "1e-4"]))
    assert args.moe_router_load_balancing_type == ["aux_loss", "seq_aux_loss"]
    assert args.moe_aux_loss_coeff == [1e-3, 1e-4]
    with pytest.raises(ArgumentsError, match="^--moe-router-load-balancing-type aux_loss "
                                             "seq_aux_loss needs one --moe-aux-loss-coeff"):
        validate_args(parse_args(argv=moe + ["--moe-router-load-balancing-type", "aux_loss",
                                             "seq_aux_loss"]))


def test_a_refused_list_flag_shows_its_values():
    with pytest.raises(ArgumentsError, match=r"^--cuda-graph-scope attn mlp is not supported"):
        validate_args(parse_args(argv=MINIMAL + ["--cuda-graph-scope", "attn", "mlp"]))
