"""Megatron's standalone MTP stage: a layout whose ``m`` letters sit in a stage before the
loss's (``"Ettttmm|L"`` at PP 2: the decoder, the final norm and the MTP layers on rank 0, the
loss alone on rank 1). Rank 0 sends rank 1 the main and the two MTP hidden states, one
``[3 s, b, h]`` tensor; the run trains as one process does and as the layout with the MTP
layers beside the loss (``"Et|tttmmL"``); it resumes bit for bit (torch and torch_dist), and
its torch_dist checkpoint resumes at one process and at the other PP 2 layout."""

import pytest

from tests.functional.test_mtp_pipeline import _assert_parity, _run, corpus  # noqa: F401

PP2 = ["--pipeline-model-parallel-size", "2"]
STANDALONE = PP2 + ["--pipeline-model-parallel-layout", "Ettttmm|L"]
BESIDE_LOSS = PP2 + ["--pipeline-model-parallel-layout", "Et|tttmmL"]
MOE = ["--num-experts", "2", "--moe-router-topk", "1", "--moe-aux-loss-coeff", "0.01"]


@pytest.mark.slow
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_standalone_mtp_stage_trains_as_one_process(corpus, untie):  # noqa: F811
    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    single = _run(corpus, 1, extra)
    standalone = _run(corpus, 2, extra + STANDALONE)
    _assert_parity(standalone, single)
    _assert_parity(standalone, _run(corpus, 2, extra + BESIDE_LOSS))


@pytest.mark.slow
@pytest.mark.parametrize("layout, pp", [("Et|tttmm|L", 3), ("Et|t|ttmm|L", 4)])
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_standalone_mtp_stage_on_a_middle_rank_trains_as_one_process(  # noqa: F811
        corpus, layout, pp, untie):
    """The MTP stage without the embedding keeps its own copy of it, summed with the first
    stage's (and, tied, the loss stage's) over the embedding group."""
    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    got = _run(corpus, pp, extra + ["--pipeline-model-parallel-size", str(pp),
                                    "--pipeline-model-parallel-layout", layout])
    _assert_parity(got, _run(corpus, 1, extra))


@pytest.mark.slow
@pytest.mark.parametrize("extra, ranks, reference", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 4, (1, [])),
    (["--use-distributed-optimizer", "--untie-embeddings-and-output-weights"], 4,
     (2, ["--use-distributed-optimizer", "--untie-embeddings-and-output-weights"])),
    (["--calculate-per-token-loss"], 2, (1, ["--calculate-per-token-loss"])),
    (MOE + ["--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout",
            "Et|tttmm|L"], 3, (1, MOE))],
    ids=["tp2-sp", "dp2-distributed-optimizer", "per-token-loss", "moe-pp3"])
def test_standalone_mtp_stage_with_other_parallelism(corpus, extra, ranks,  # noqa: F811
                                                     reference):
    """Under sequence parallelism the hand-over is ``[3 s/tp, b, h]``, against one process;
    with data parallelism the reference is the data-parallel run without pipeline
    parallelism; MoE layers (the MTP layers' too) at pp 3 against one process."""
    layout = [] if "--pipeline-model-parallel-layout" in extra else STANDALONE
    _assert_parity(_run(corpus, ranks, extra + layout), _run(corpus, *reference))


# Virtual stages: the standalone MTP stage is the last chunk of the rank before the loss's.
# At pp 2 that is rank 0, which then holds the embedding (first chunk) and its MTP copy (last
# chunk); at pp 3 rank 1's last chunk.
VIRTUAL_PP2 = PP2 + ["--pipeline-model-parallel-layout", "Et|t|ttmm|L"]
VIRTUAL_PP3 = ["--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout",
               "E|t|t|t|tmm|L"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [VIRTUAL_PP2, VIRTUAL_PP3], ids=["pp2-vp2", "pp3-vp2"])
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_standalone_mtp_stage_with_virtual_stages_trains_as_one_process(  # noqa: F811
        corpus, layout, untie):
    """The interleaved schedule hands ``[3 s, b, h]`` over the one boundary into the loss
    stage (and its gradient back) and ``[s, b, h]`` elsewhere; the embedding copies, two on
    one rank at pp 2, are summed with each other and over the embedding group."""
    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    extra += ["--global-batch-size", "12"] if "3" in layout else []
    ranks = int(layout[1])
    _assert_parity(_run(corpus, ranks, extra + layout), _run(corpus, 1, extra))


# Further from the loss: the MTP stage is its rank's last virtual stage and the (empty) stages
# between it and the loss's pass the wide hand-over on, as Megatron allows.
FAR_PP3_VP2 = ["--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout",
               "Et|t|t|tmm||L", "--global-batch-size", "12"]
FAR_PP4_VP2 = ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout",
               "Et|t|t|t|mm|||L"]


@pytest.mark.slow
@pytest.mark.parametrize("layout, ranks", [(FAR_PP3_VP2, 3), (FAR_PP4_VP2, 4)],
                         ids=["pp3-vp2", "pp4-vp2"])
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_standalone_mtp_stage_further_from_the_loss_trains_as_one_process(  # noqa: F811
        corpus, layout, ranks, untie):
    """``[3 s, b, h]`` from the MTP stage (rank 0's second chunk) through the empty second
    chunks of the ranks between into the loss's."""
    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    reference = extra + (["--global-batch-size", "12"] if layout is FAR_PP3_VP2 else [])
    _assert_parity(_run(corpus, ranks, extra + layout), _run(corpus, 1, reference))


def test_a_layout_leaving_a_rank_without_parameters_is_refused(corpus):  # noqa: F811
    """At pp 3 without virtual stages, an MTP stage two before the loss leaves rank 1 only an
    empty stage: refused in one line before any process group exists."""
    from megatron.training.arguments import ArgumentsError, parse_args, validate_args
    from tests.functional.gpt_runs import gpt_flags
    from tests.functional.test_mtp_pipeline import MTP

    args = parse_args(argv=gpt_flags(corpus, 2, extra=MTP + [
        "--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout",
        "Ettttmm||L"]))
    args.world_size = 3
    with pytest.raises(ArgumentsError, match=r"'Ettttmm\|\|L': pipeline rank\(s\) 1 hold only "
                                             r"empty stages, so no parameter to train"):
        validate_args(args)


@pytest.mark.slow
@pytest.mark.parametrize("extra, reference", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], (1, [])),
    (["--use-distributed-optimizer", "--untie-embeddings-and-output-weights"],
     (2, ["--use-distributed-optimizer", "--untie-embeddings-and-output-weights"]))],
    ids=["tp2-sp", "dp2-distributed-optimizer"])
def test_standalone_mtp_stage_with_virtual_stages_and_other_parallelism(  # noqa: F811
        corpus, extra, reference):
    """``[3 s/tp, b, h]`` over the loss boundary under sequence parallelism; the rank holding
    both embedding tables shards each in the distributed optimizer."""
    _assert_parity(_run(corpus, 4, extra + VIRTUAL_PP2), _run(corpus, *reference))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_standalone_mtp_stage_with_virtual_stages_resumes_bit_for_bit(  # noqa: F811
        corpus, tmp_path, fmt):
    extra = ["--ckpt-format", fmt] + VIRTUAL_PP2
    straight = _run(corpus, 2, extra)
    save = str(tmp_path / "ckpt")
    assert _run(corpus, 2, extra + ["--save", save, "--exit-interval", "2"])["iteration"] == 2
    resumed = _run(corpus, 2, extra + ["--load", save])
    assert resumed["iteration"] == 4
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["grad_norms"] == straight["grad_norms"][2:]
    assert resumed["mtp"] == straight["mtp"][2:]
    if fmt == "torch_dist":
        single = _run(corpus, 1, ["--ckpt-format", fmt])
        tail = dict(single, losses=single["losses"][2:], grad_norms=single["grad_norms"][2:],
                    mtp=single["mtp"][2:])
        _assert_parity(_run(corpus, 1, ["--ckpt-format", fmt, "--load", save]), tail)


@pytest.mark.slow
def test_megatron_flag_agrees_with_the_standalone_layout(corpus):  # noqa: F811
    """``--mtp-standalone`` (which Megatron sets itself from such a layout) is accepted with
    it, and refused with a layout that puts the MTP layers beside the loss."""
    single = _run(corpus, 1)
    _assert_parity(_run(corpus, 2, STANDALONE + ["--mtp-standalone"]), single)
    with pytest.raises(AssertionError, match=r"--mtp-standalone.*'Et\|tttmmL'"):
        _run(corpus, 2, BESIDE_LOSS + ["--mtp-standalone"])


MIDDLE = ["--pipeline-model-parallel-size", "3", "--pipeline-model-parallel-layout",
          "Et|tttmm|L"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
@pytest.mark.parametrize("layout", [STANDALONE, MIDDLE], ids=["pp2", "pp3"])
def test_standalone_mtp_stage_resumes_bit_for_bit(corpus, tmp_path, fmt, untie,  # noqa: F811
                                                  layout):
    extra = ["--ckpt-format", fmt] + (["--untie-embeddings-and-output-weights"] if untie
                                      else [])
    ranks = int(layout[1])
    straight = _run(corpus, ranks, extra + layout)
    save = str(tmp_path / "ckpt")
    first = _run(corpus, ranks, extra + layout + ["--save", save, "--exit-interval", "2"])
    assert first["iteration"] == 2
    resumed = _run(corpus, ranks, extra + layout + ["--load", save])
    assert resumed["iteration"] == 4
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["grad_norms"] == straight["grad_norms"][2:]
    assert resumed["mtp"] == straight["mtp"][2:]


@pytest.mark.slow
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_standalone_torch_dist_checkpoint_loads_at_other_layouts(corpus, tmp_path,  # noqa: F811
                                                                 untie):
    """Written with the MTP stage of its own, resumed at one process, with the MTP layers
    beside the loss (whose last stage keeps a copy of the embedding) and with the MTP stage
    on a middle rank (its own copy), the run continues as the single process does."""
    extra = ["--ckpt-format", "torch_dist"] + (["--untie-embeddings-and-output-weights"]
                                               if untie else [])
    save = str(tmp_path / "ckpt")
    _run(corpus, 2, extra + STANDALONE + ["--save", save, "--exit-interval", "2"])
    single = _run(corpus, 1, extra)
    tail = dict(single, losses=single["losses"][2:], grad_norms=single["grad_norms"][2:],
                mtp=single["mtp"][2:])
    _assert_parity(_run(corpus, 1, extra + ["--load", save]), tail)
    _assert_parity(_run(corpus, 2, extra + BESIDE_LOSS + ["--load", save]), tail)
    _assert_parity(_run(corpus, 3, extra + MIDDLE + ["--load", save]), tail)


@pytest.mark.slow
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
@pytest.mark.parametrize("layout", [STANDALONE, MIDDLE], ids=["pp2", "pp3"])
def test_standalone_torch_checkpoint_converts_to_one_process(corpus, tmp_path,  # noqa: F811
                                                             untie, layout):
    """The torch format keeps the final norm and the MTP layers in the MTP stage's file:
    converted to one rank, the run continues as the single process does."""
    from tools.checkpoint.convert import main

    extra = ["--untie-embeddings-and-output-weights"] if untie else []
    save, one = str(tmp_path / "pp2"), str(tmp_path / "pp1")
    _run(corpus, int(layout[1]), extra + layout + ["--save", save, "--exit-interval", "2",
                                                   "--ckpt-format", "torch"])
    assert main(["--model-type", "GPT", "--load-dir", save, "--save-dir", one,
                 "--target-pipeline-parallel-size", "1"]) == 0
    single = _run(corpus, 1, extra)
    tail = dict(single, losses=single["losses"][2:], grad_norms=single["grad_norms"][2:],
                mtp=single["mtp"][2:])
    _assert_parity(_run(corpus, 1, extra + ["--load", one]), tail)
