"""Training runs with ``--mtp-hsm`` through pretrain_gpt: the same seed gives the same losses
bit for bit, the mixing moves the second depth's loss (the first depth is unmixed, so its
first logged loss stays) and so the training; a run resumed from its checkpoint (which holds
the mixing stream's state) repeats the losses of the run that never stopped, bit for bit."""

import pytest

from tests.functional.test_mtp_pipeline import ITERS, _run, corpus  # noqa: F401

HSM = ["--mtp-hsm"]


def test_mixing_runs_repeat_themselves_and_differ_from_unmixed_runs(corpus):
    mixed = _run(corpus, 1, HSM)
    again = _run(corpus, 1, HSM)
    plain = _run(corpus, 1)
    assert again["losses"] == mixed["losses"] and again["mtp"] == mixed["mtp"]
    assert again["grad_norms"] == mixed["grad_norms"]
    assert mixed["losses"][0] == plain["losses"][0]          # before any mixed update
    assert mixed["mtp"][0]["mtp_1 loss"] == plain["mtp"][0]["mtp_1 loss"]
    assert mixed["mtp"][0]["mtp_2 loss"] != plain["mtp"][0]["mtp_2 loss"]
    assert mixed["losses"][1:] != plain["losses"][1:]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resumed_mixing_run_repeats_the_losses_bit_for_bit(corpus, tmp_path, fmt):
    extra = HSM + ["--ckpt-format", fmt]
    straight = _run(corpus, 1, extra)
    save = str(tmp_path / "ckpt")
    first = _run(corpus, 1, extra + ["--save", save, "--exit-interval", "2"])
    assert first["iteration"] == 2
    resumed = _run(corpus, 1, extra + ["--load", save])
    assert resumed["iteration"] == ITERS
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["grad_norms"] == straight["grad_norms"][2:]
    assert resumed["mtp"] == straight["mtp"][2:]
