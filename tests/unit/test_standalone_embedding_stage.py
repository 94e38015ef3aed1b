"""--standalone-embedding-stage: pipeline rank 0 holds the input embedding and no transformer
layer; the layers are split evenly over the other ranks.

The reference is the stage table of Megatron-LM's legacy model for this flag
(``_get_num_layers``): with ``pp`` ranks the layers are divided among ranks 1 .. pp-1
(``--num-layers`` divisible by ``pp - 1``), rank 0 holds zero layers, and with virtual stages
rank 0's first virtual stage holds the embedding and its others nothing, while every other
rank's virtual stage holds ``L / ((pp - 1) vp)`` layers (``--num-layers-per-virtual-pipeline-stage``
counted over ``pp - 1`` ranks). The tables below are written out by hand from that rule; the
layers are numbered in the order the stages run.
"""

import pytest

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.pipeline_parallel import layer_layout as ll
from megatron.model.transformer import get_num_layers_and_offset
from megatron.training.arguments import ArgumentsError, parse_args, validate_args

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 8 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --train-iters 10").split()


def _validate(extra, pp, world=None):
    args = parse_args(argv=BASE + ["--pipeline-model-parallel-size", str(pp)] + list(extra))
    args.world_size = world or pp
    return validate_args(args)


@pytest.mark.parametrize("layers,pp,vp,layout,owned", [
    # pp 2: rank 0 [E], rank 1 every layer and the loss.
    (4, 2, None, "E|t*4L", {(0, 0): [], (1, 0): [0, 1, 2, 3]}),
    (4, 3, None, "E|t*2|t*2L", {(0, 0): [], (1, 0): [0, 1], (2, 0): [2, 3]}),
    (3, 4, None, "E|t|t|tL", {(0, 0): [], (1, 0): [0], (2, 0): [1], (3, 0): [2]}),
    # pp 2 x vp 2: rank 0 [E] [], rank 1 [t t] [t t L].
    (4, 2, 2, "E|t*2||t*2L", {(0, 0): [], (1, 0): [0, 1], (0, 1): [], (1, 1): [2, 3]}),
    # pp 3 x vp 2, 8 layers: 8 / (2 x 2) = 2 per virtual stage of ranks 1 and 2.
    (8, 3, 2, "E|t*2|t*2||t*2|t*2L",
     {(0, 0): [], (1, 0): [0, 1], (2, 0): [2, 3], (0, 1): [], (1, 1): [4, 5],
      (2, 1): [6, 7]}),
])
def test_stages_hold_what_megatron_gives_them(layers, pp, vp, layout, owned):
    assert ll.standalone_embedding_layout(layers, pp, vp) == layout
    stages = ll.parse_pipeline_layout(layout)
    assert stages[0] == "E" and stages[-1].endswith("L")
    cfg = TransformerConfig(num_layers=layers, hidden_size=32, num_attention_heads=4,
                            padded_vocab_size=128, max_position_embeddings=16, seq_length=16,
                            pipeline_model_parallel_layout=layout)
    got = {}
    for p in range(pp):
        for v in range(vp or 1):
            count, offset = get_num_layers_and_offset(cfg, pp, p, vp, v if vp else None)
            got[(p, v)] = list(range(offset, offset + count))
    assert got == owned


@pytest.mark.parametrize("extra,pp,layout,vp", [
    ([], 3, "E|t*2|t*2L", None),
    ([], 2, "E|t*4L", None),
    # Megatron counted --num-layers-per-virtual-pipeline-stage over the pp - 1 ranks after
    # the embedding's: 4 / 2 = 2 layers per rank, 1 per virtual stage, so vp 2.
    # (a global batch of pp micro-batches: the interleaved schedule's smallest)
    (["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "6"], 3,
     "E|t|t||t|tL", 2),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "6"], 3,
     "E|t|t||t|tL", 2),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "4"], 2,
     "E|t*2||t*2L", 2),
])
def test_the_flag_becomes_the_equivalent_layout(extra, pp, layout, vp):
    args = _validate(["--standalone-embedding-stage"] + extra, pp)
    assert args.pipeline_model_parallel_layout == layout
    assert args.virtual_pipeline_model_parallel_size == vp
    # Validating again (a resume validates the same namespace) keeps the same split.
    assert validate_args(args).pipeline_model_parallel_layout == layout


def test_without_the_flag_nothing_changes():
    args = _validate([], 2)
    assert args.pipeline_model_parallel_layout is None and not args.standalone_embedding_stage


@pytest.mark.parametrize("extra,pp,message", [
    ([], 1, "--standalone-embedding-stage needs --pipeline-model-parallel-size >= 2 (one stage "
            "for the embedding, the others for the layers), got 1"),
    ([], 4, "--standalone-embedding-stage: --num-layers (4) must be divisible by "
            "--pipeline-model-parallel-size - 1 (3, the ranks after the embedding's)"),
    (["--num-virtual-stages-per-pipeline-rank", "4"], 3,
     "--num-layers (4) must be divisible by --pipeline-model-parallel-size - 1 (2, the ranks "
     "after the embedding's) x virtual stages (4)"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], 3,
     "the 2 layers of each pipeline rank after the first are not divisible by "
     "--num-layers-per-virtual-pipeline-stage (3)"),
    (["--decoder-first-pipeline-num-layers", "1"], 3,
     "--standalone-embedding-stage cannot be combined with --decoder-first-pipeline-num-layers"),
    (["--decoder-last-pipeline-num-layers", "1"], 3,
     "--standalone-embedding-stage cannot be combined with --decoder-last-pipeline-num-layers"),
    (["--account-for-embedding-in-pipeline-split"], 3,
     "--standalone-embedding-stage cannot be combined with "
     "--account-for-embedding-in-pipeline-split"),
    (["--account-for-loss-in-pipeline-split"], 3,
     "--standalone-embedding-stage cannot be combined with --account-for-loss-in-pipeline-split"),
    (["--pipeline-model-parallel-layout", "Et|t|ttL"], 3,
     "--standalone-embedding-stage cannot be combined with --pipeline-model-parallel-layout; "
     "its stages are the layout 'E|t*2|t*2L'"),
])
def test_refusals_name_the_flags_in_one_line(extra, pp, message):
    with pytest.raises(ArgumentsError) as err:
        _validate(["--standalone-embedding-stage"] + extra, pp)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_layout_builder_refuses_an_uneven_split():
    with pytest.raises(ConfigError, match=r"--num-layers \(5\) must be divisible"):
        ll.standalone_embedding_layout(5, 3)
