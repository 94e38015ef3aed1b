"""--pipeline-model-parallel-layout and --account-for-embedding/loss-in-pipeline-split: the
parser, the stage contents they imply (against layouts written out by hand) and their errors."""

import pytest

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.pipeline_parallel import layer_layout as ll
from megatron.model.transformer import get_num_layers_and_offset
from megatron.training.arguments import ArgumentsError, parse_args, validate_args


def test_megatron_documented_deepseek_layout():
    # Megatron's example: DeepSeek-V3 (61 layers + 1 MTP) at pp 16 x vp 2.
    stages = ll.parse_pipeline_layout("Et*3|(tt|)*29,m|L")
    assert len(stages) == 32
    assert stages[0] == "Ettt" and stages[1:30] == ["tt"] * 29
    assert stages[30:] == ["m", "L"]
    # Stage i sits on pipeline rank i % 16, virtual stage i // 16.
    assert stages[16] == "tt" and stages[31] == "L"


@pytest.mark.parametrize("text,stages", [
    ("Et|tt|tL", ["Et", "tt", "tL"]),
    ("Et*3|t,t|L", ["Ettt", "tt", "L"]),
    ("E(t|)*2tL", ["Et", "t", "tL"]),
    ("(|t)*2,L", ["", "t", "tL"]),
    ("E(t*2|)*2L", ["Ett", "tt", "L"]),
    ("Et|*2tL", ["Et", "", "tL"]),
])
def test_parser_against_stages_written_by_hand(text, stages):
    assert ll.parse_pipeline_layout(text) == stages


@pytest.mark.parametrize("text,pattern", [
    ("Et|x|L", r"unexpected 'x' .* at position 3"),
    ("E(t(t)*2)*2|L", r"'\(' without a matching '\)\*n' \(groups do not nest\) at position 1"),
    ("Et*|L", r"unexpected '\*' .* at position 2"),
    ("E()*2|tL", r"empty group '\(\)' at position 1"),
    ("Et|(t|q)*2L", r"unexpected 'q' .* at position 6"),
    ("", r" is empty"),
])
def test_parser_errors_name_the_flag_and_position(text, pattern):
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-layout" + ".*" + pattern):
        ll.parse_pipeline_layout(text)


def test_layout_counts_per_rank_and_virtual_stage():
    # pp 2: stages 0 1 2 3 -> rank 0 holds stages 0 and 2, rank 1 holds 1 and 3.
    assert ll.layout_stage_counts("E|tt|t|tL", 2, 4) == [[0, 1], [2, 1]]
    assert ll.layout_stage_counts("Et|tttL", 2, 4) == [[1], [3]]
    assert ll.layout_stage_counts("Et*3|(tt|)*29,t|L", 16, 62) == \
        [[3, 2]] + [[2, 2]] * 13 + [[2, 1], [2, 0]]


@pytest.mark.parametrize("text,pp,layers,pattern", [
    ("Et|tt|tL", 2, 4, r"has 3 stages, not a multiple of --pipeline-model-parallel-size \(2\)"),
    ("Et|ttL", 2, 4, r"holds 3 transformer layers \('t'\), but --num-layers is 4"),
    ("tE|ttL", 2, 3, r"the embedding 'E' must appear once, first in the first stage"),
    ("Et|tLt", 2, 3, r"the loss 'L' must appear once, last in the last stage"),
])
def test_layout_content_errors(text, pp, layers, pattern):
    with pytest.raises(ConfigError, match=pattern):
        ll.layout_stage_counts(text, pp, layers)


def test_accounted_split_written_by_hand():
    # 6 layers + embedding + loss = 8 places over 4 stages.
    assert ll.accounted_stage_counts(6, 4, None, True, True) == [[1], [2], [2], [1]]
    assert ll.accounted_stage_counts(7, 4, None, True, False) == [[1], [2], [2], [2]]
    assert ll.accounted_stage_counts(7, 4, None, False, True) == [[2], [2], [2], [1]]
    # pp 2 x vp 3 with both: 6 places, one per chunk.
    assert ll.accounted_stage_counts(4, 2, 3, True, True) == [[0, 1, 1], [1, 1, 0]]
    with pytest.raises(ConfigError, match=r"--num-layers \(6\) plus one place each for "
                       r"--account-for-embedding-in-pipeline-split = 7 is not divisible by "
                       r"--pipeline-model-parallel-size \(4\)"):
        ll.accounted_stage_counts(6, 4, None, True, False)


def _layers(counts):
    """Every chunk's global layer numbers, from the counts by walking the stages in running
    order (virtual stage 0 of every rank, then 1, ...): the reference for the offsets."""
    pp, vp = len(counts), len(counts[0])
    owned, next_layer = {}, 0
    for v in range(vp):
        for p in range(pp):
            owned[(p, v)] = list(range(next_layer, next_layer + counts[p][v]))
            next_layer += counts[p][v]
    return owned


@pytest.mark.parametrize("kw,pp,vp,expected", [
    (dict(pipeline_model_parallel_layout="E|tt|t|tL"), 2, 2,
     {(0, 0): [], (1, 0): [0, 1], (0, 1): [2], (1, 1): [3]}),
    (dict(pipeline_model_parallel_layout="Et|tttL"), 2, None, {(0, 0): [0], (1, 0): [1, 2, 3]}),
    (dict(account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True), 2, 3,
     {(0, 0): [], (1, 0): [0], (0, 1): [1], (1, 1): [2], (0, 2): [3], (1, 2): []}),
    (dict(), 2, 2, {(0, 0): [0], (1, 0): [1], (0, 1): [2], (1, 1): [3]}),
])
def test_model_chunks_hold_the_layers_written_out(kw, pp, vp, expected):
    cfg = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                            padded_vocab_size=128, max_position_embeddings=16, seq_length=16,
                            **kw)
    got = {}
    for p in range(pp):
        for v in range(vp or 1):
            count, offset = get_num_layers_and_offset(cfg, pp, p, vp, v if vp else None)
            got[(p, v)] = list(range(offset, offset + count))
    assert got == expected
    counts = [[len(expected[(p, v)]) for v in range(vp or 1)] for p in range(pp)]
    assert _layers(counts) == expected


BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
        "--train-iters 10 --pipeline-model-parallel-size 2").split()


def _validate(extra, world=2):
    args = parse_args(argv=BASE + list(extra))
    args.world_size = world
    return validate_args(args)


def test_flags_derive_virtual_stages():
    args = _validate(["--pipeline-model-parallel-layout", "E|tt|t|tL"])
    assert args.virtual_pipeline_model_parallel_size == 2
    assert _validate(["--pipeline-model-parallel-layout", "Et|tttL"]) \
        .virtual_pipeline_model_parallel_size is None
    args = _validate(["--account-for-embedding-in-pipeline-split",
                      "--account-for-loss-in-pipeline-split",
                      "--num-virtual-stages-per-pipeline-rank", "3"])
    assert args.virtual_pipeline_model_parallel_size == 3


@pytest.mark.parametrize("extra,pattern", [
    (["--pipeline-model-parallel-layout", "Et|tt(L"],
     r"--pipeline-model-parallel-layout 'Et\|tt\(L': '\(' without .* at position 5"),
    (["--pipeline-model-parallel-layout", "Et|tttL", "--decoder-first-pipeline-num-layers",
      "1"], r"--pipeline-model-parallel-layout cannot be combined with "
     r"--decoder-first-pipeline-num-layers"),
    (["--pipeline-model-parallel-layout", "Et|tttL", "--account-for-loss-in-pipeline-split"],
     r"--pipeline-model-parallel-layout cannot be combined with "
     r"--account-for-loss-in-pipeline-split"),
    (["--account-for-embedding-in-pipeline-split"],
     r"--num-layers \(4\) plus one place each for --account-for-embedding-in-pipeline-split "
     r"= 5 is not divisible by --pipeline-model-parallel-size \(2\)"),
    (["--account-for-loss-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "1"],
     r"--account-for-loss-in-pipeline-split cannot be combined with "
     r"--num-layers-per-virtual-pipeline-stage"),
])
def test_flag_errors(extra, pattern):
    with pytest.raises(ArgumentsError, match=pattern):
        _validate(extra)


# Megatron's DeepSeek-style launch layouts with one MTP layer: (layout, --num-layers, pp sizes).
MTP_LAYOUTS = [
    ("Et*3|(tt|)*6mL", 15, (2, 4)),
    ("Et*3|(tt|)*6tmL", 16, (2, 4)),
    ("Et*7|t*7mL", 14, (2,)),
    ("Et*2|(tt|)*5t|tmL", 14, (2, 4)),
    ("Et|(tt|)*6mL", 13, (2, 4)),
]


@pytest.mark.parametrize("text,layers,pp", [(t, n, p) for t, n, sizes in MTP_LAYOUTS
                                            for p in sizes])
def test_mtp_letters_in_the_loss_stage_leave_the_layer_numbering_alone(text, layers, pp):
    """The ``m`` before ``L`` is accepted with --mtp-num-layers 1, and every chunk holds the
    layers it holds when the ``m`` is struck out (and when it is not given at all)."""
    stages = ll.parse_pipeline_layout(text)
    assert stages[-1].endswith("mL") and "".join(stages).count("m") == 1
    without = text.replace("m", "")
    counts = ll.layout_stage_counts(text, pp, layers, 1)
    assert counts == ll.layout_stage_counts(without, pp, layers)
    assert counts == ll.layout_stage_counts(text, pp, layers)
    vp = len(stages) // pp
    cfg = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4,
                            padded_vocab_size=128, max_position_embeddings=16, seq_length=16,
                            pipeline_model_parallel_layout=text)
    got = {(p, v): list(range(offset, offset + count)) for p in range(pp) for v in range(vp)
           for count, offset in [get_num_layers_and_offset(cfg, pp, p, vp if vp > 1 else None,
                                                           v if vp > 1 else None)]}
    assert got == _layers(counts)
    # The stage holding 'm' is the last virtual stage of the last rank: the one with the loss.
    assert stages.index(stages[-1]) == (vp - 1) * pp + pp - 1


def test_mtp_layout_by_hand():
    # pp 4 x vp 2: rank 3 holds stages 3 and 7; the last ("mL") has no transformer layer.
    assert ll.layout_stage_counts("Et*3|(tt|)*6mL", 4, 15, 1) == \
        [[3, 2], [2, 2], [2, 2], [2, 0]]
    assert ll.layout_stage_counts("Et*7|t*7mL", 2, 14, 1) == [[7], [7]]
    assert ll.layout_stage_counts("Et|tmmL", 2, 2, 2) == [[1], [1]]


@pytest.mark.parametrize("text,pp,layers,mtp,pattern", [
    ("Et|tmL", 2, 2, 2, r"the number of MTP layers \('m', 1\) must match --mtp-num-layers \(2\)"),
    ("Et|tmmL", 2, 2, 1, r"\('m', 2\) must match --mtp-num-layers \(1\)"),
    ("Et|tmL", 2, 2, 0, r"\('m', 1\) must match --mtp-num-layers \(not given\)"),
    ("Et|mtL", 2, 2, 1, r"decoder layers \('t'\) must be placed before the MTP layers"),
    ("Et|t|m|||L", 2, 2, 1, r"'m'\) must be in the last virtual pipeline stage of their "
     r"pipeline rank"),
    ("Etm|mL", 2, 1, 2, r"all of the MTP layers \('m'\) must be in the same virtual "
     r"pipeline stage"),
    ("Et|tLm", 2, 2, 1, r"the loss 'L' must appear once, last in the last stage"),
])
def test_misplaced_mtp_letters_are_refused_as_megatron_refuses_them(text, pp, layers, mtp,
                                                                    pattern):
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-layout .*" + pattern):
        ll.layout_stage_counts(text, pp, layers, mtp)


@pytest.mark.parametrize("text,layers,pp", [(t, n, p) for t, n, sizes in MTP_LAYOUTS
                                            for p in sizes])
def test_megatron_mtp_layouts_validate_with_their_flags(text, layers, pp):
    args = parse_args(argv=["--num-layers", str(layers), "--hidden-size", "64",
                            "--num-attention-heads", "8", "--seq-length", "32",
                            "--max-position-embeddings", "32", "--micro-batch-size", "2",
                            "--global-batch-size", "16", "--train-iters", "10", "--pipeline-model-parallel-size", str(pp),
                            "--position-embedding-type", "rope", "--mtp-num-layers", "1",
                            "--pipeline-model-parallel-layout", text])
    args.world_size = pp
    args = validate_args(args)
    vp = len(ll.parse_pipeline_layout(text)) // pp
    assert args.virtual_pipeline_model_parallel_size == (vp if vp > 1 else None)


def test_mtp_letters_without_mtp_layers_or_a_count_apart_are_refused_by_the_flags():
    rope = ["--position-embedding-type", "rope"]
    with pytest.raises(ArgumentsError, match=r"\('m', 1\) must match --mtp-num-layers "
                       r"\(not given\)"):
        _validate(["--pipeline-model-parallel-layout", "Et|tttmL"])
    with pytest.raises(ArgumentsError, match=r"\('m', 1\) must match --mtp-num-layers \(2\)"):
        _validate(rope + ["--pipeline-model-parallel-layout", "Et|tttmL", "--mtp-num-layers",
                          "2"])
    # No 'm' at all: refused as well (Megatron asks for the MTP layers to be placed).
    with pytest.raises(ArgumentsError, match=r"\('m', 0\) must match --mtp-num-layers \(2\)"):
        _validate(rope + ["--pipeline-model-parallel-layout", "Et|tttL", "--mtp-num-layers",
                          "2"])
    assert _validate(rope + ["--pipeline-model-parallel-layout", "Et|tttmmL",
                             "--mtp-num-layers", "2"]).mtp_num_layers == 2


def test_mtp_layers_must_be_placed_in_a_layout_as_megatron_asks():
    # Megatron's rule: the 'm' count equals --mtp-num-layers, none placed is refused too.
    with pytest.raises(ConfigError, match=r"'Et\|tL': the number of MTP layers \('m', 0\) "
                                          r"must match --mtp-num-layers \(1\)"):
        ll.layout_stage_counts("Et|tL", 2, 2, 1)
    assert ll.layout_stage_counts("Et|tL", 2, 2, 0) == [[1], [1]]
    assert ll.layout_stage_counts("Et|tmL", 2, 2, 1) == [[1], [1]]
    # Without a count (a model built from a checked layout) the letters are not counted.
    assert ll.layout_stage_counts("Et|tmL", 2, 2) == [[1], [1]]


def test_standalone_mtp_stage_just_before_the_loss_stage_is_accepted():
    """Megatron's standalone MTP stage, built just before the loss stage: the loss stage holds no transformer layer; the MTP stage's copy of the word
    embedding joins the embedding group (with the loss stage's only when tied)."""
    assert ll.layout_stage_counts("Ettmm|L", 2, 2, 2) == [[2], [0]]
    assert ll.mtp_standalone_stage("Ettmm|L") == 0
    assert ll.layout_stage_counts("Et|t|tmm|L", 4, 3, 2) == [[1], [1], [1], [0]]
    assert ll.mtp_standalone_stage("Et|t|tmm|L") == 2
    assert ll.mtp_embedding_stages("Et|t|tmm|L", 4, tied=True) == [0, 2, 3]
    assert ll.mtp_embedding_stages("Et|t|tmm|L", 4, tied=False) == [0, 2]
    assert ll.mtp_embedding_stages("Ettmm|L", 2, tied=False) == [0]
    assert ll.mtp_embedding_stages("Et|tmmL", 2, tied=True) is None
    assert ll.mtp_standalone_stage("Et|tmmL") is None
    assert ll.mtp_standalone_stage("Et|tL") is None


def test_standalone_mtp_stage_further_from_the_loss_is_accepted_as_megatron_accepts_it():
    """The MTP stage may be any rank's last virtual stage before the loss's; the stages between
    are empty (they hand its output on)."""
    assert ll.layout_stage_counts("Etm||L", 3, 1, 1) == [[1], [0], [0]]
    assert ll.mtp_standalone_stage("Etm||L") == 0 and ll.mtp_standalone_rank("Etm||L", 3) == 0
    assert ll.layout_stage_counts("Et|t|t|m||L", 3, 3, 1) == [[1, 0], [1, 0], [1, 0]]
    assert ll.mtp_standalone_stage("Et|t|t|m||L") == 3
    assert ll.is_mtp_standalone_stage("Et|t|t|m||L", 3, 0, 1)
    assert ll.mtp_embedding_stages("Et|t|t|m||L", 3, True) == [0, 2]


def test_standalone_mtp_stage_with_virtual_stages_is_the_last_chunk_before_the_loss():
    """With virtual stages the MTP stage is the stage just before the loss's: the last chunk
    of the rank before the loss's rank, which at pp 2 is rank 0, holding the embedding too."""
    assert ll.layout_stage_counts("Et|t|ttmm|L", 2, 4, 2) == [[1, 2], [1, 0]]
    assert ll.mtp_standalone_stage("Et|t|ttmm|L") == 2
    assert ll.mtp_standalone_rank("Et|t|ttmm|L", 2) == 0
    assert ll.mtp_embedding_stages("Et|t|ttmm|L", 2, tied=True) == [0, 1]
    assert ll.mtp_embedding_stages("Et|t|ttmm|L", 2, tied=False) == [0]
    assert [ll.is_mtp_standalone_stage("Et|t|ttmm|L", 2, rank, vp)
            for rank in (0, 1) for vp in (0, 1)] == [False, True, False, False]
    assert ll.mtp_standalone_rank("E|t|t|t|tmm|L", 3) == 1
    assert ll.mtp_embedding_stages("E|t|t|t|tmm|L", 3, tied=True) == [0, 1, 2]
    assert ll.is_mtp_standalone_stage("E|t|t|t|tmm|L", 3, 1, 1)
    assert not ll.is_mtp_standalone_stage("Et|t|ttmm|L", 2, 0, None)
    assert not ll.is_mtp_standalone_stage(None, 2, 0, 1)


def test_mtp_standalone_follows_the_layout():
    """``--mtp-standalone`` is set from the layout, as Megatron sets it; given by hand it must
    agree with the layout, or the run stops with one line naming both."""
    rope = ["--position-embedding-type", "rope", "--mtp-num-layers", "2"]
    assert _validate(rope + ["--pipeline-model-parallel-layout", "Ettttmm|L"]).mtp_standalone
    assert _validate(rope + ["--pipeline-model-parallel-layout", "Ettttmm|L",
                             "--mtp-standalone"]).mtp_standalone
    beside = ["--pipeline-model-parallel-layout", "Et|tttmmL"]
    assert not _validate(rope + beside).mtp_standalone
    with pytest.raises(ArgumentsError, match=r"--mtp-standalone: --pipeline-model-parallel-"
                       r"layout 'Et\|tttmmL' puts the MTP layers beside the loss"):
        _validate(rope + beside + ["--mtp-standalone"])
    with pytest.raises(ArgumentsError, match=r"--mtp-standalone needs "
                       r"--pipeline-model-parallel-layout"):
        _validate(rope + ["--mtp-standalone"])
