"""Training runs with ``--mtp-use-repeated-layer`` and ``--mtp-detach-heads``: the main model of
a detached run follows the run whose MTP loss weighs nothing; PP 2 and DP 2 with the
distributed optimizer train as one process does; the same seed gives the same losses; a resumed
run repeats the losses of the run that never stopped, bit for bit."""

import pytest

from tests.functional.test_mtp_pipeline import ITERS, _assert_parity, _run, corpus  # noqa: F401

OPTIONS = ["--mtp-use-repeated-layer", "--mtp-detach-heads",
           "--untie-embeddings-and-output-weights"]


@pytest.mark.slow
def test_detached_heads_leave_the_main_model_where_a_weightless_mtp_loss_does(corpus):
    """The main model's gradients under --mtp-detach-heads are those of the main loss alone,
    and its clipping norm leaves the MTP layers out: so its lm loss follows, step for step, the
    run whose MTP loss is scaled by 0 (where the MTP layers' gradients are zero)."""
    detached = _run(corpus, 1, ["--mtp-detach-heads"])
    weightless = _run(corpus, 1, ["--mtp-loss-scaling-factor", "0"])
    attached = _run(corpus, 1)
    assert [l for _, l in detached["losses"]] == pytest.approx(
        [l for _, l in weightless["losses"]], rel=1e-6)
    assert detached["grad_norms"] == pytest.approx(weightless["grad_norms"], rel=1e-6)
    assert [l for _, l in detached["losses"]][1:] != pytest.approx(
        [l for _, l in attached["losses"]][1:], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, layout", [(2, ["--pipeline-model-parallel-size", "2"]),
                                           (2, ["--use-distributed-optimizer"])],
                         ids=["pp2", "dp2-distributed-optimizer"])
def test_repeated_detached_mtp_gives_the_single_process_losses(corpus, ranks, layout):
    """A small --clip-grad clips both gradient groups, each by its own norm, every step."""
    options = OPTIONS + ["--clip-grad", "0.02"]
    single = _run(corpus, 1, options)
    again = _run(corpus, 1, options)
    assert again["losses"] == single["losses"] and again["mtp"] == single["mtp"]
    _assert_parity(_run(corpus, ranks, options + layout), single)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resumed_repeated_detached_run_repeats_the_losses_bit_for_bit(corpus, tmp_path, fmt,
                                                                      capsys):
    extra = OPTIONS + ["--pipeline-model-parallel-size", "2", "--ckpt-format", fmt]
    straight = _run(corpus, 2, extra)
    save = str(tmp_path / "ckpt")
    first = _run(corpus, 2, extra + ["--save", save, "--exit-interval", "2"])
    assert first["iteration"] == 2
    resumed = _run(corpus, 2, extra + ["--load", save])
    assert resumed["iteration"] == ITERS
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["grad_norms"] == straight["grad_norms"][2:]
    assert resumed["mtp"] == straight["mtp"][2:]
    if fmt == "torch":     # the one shared layer has no converter target: refused in one line
        from tools.checkpoint.convert import main

        with pytest.raises(SystemExit) as stop:
            main(["--model-type", "GPT", "--load-dir", save, "--save-dir",
                  str(tmp_path / "out"), "--target-pipeline-parallel-size", "1"])
        assert stop.value.code == 1
        assert "--mtp-use-repeated-layer: one MTP layer" in capsys.readouterr().err
