"""Multi-token prediction placed with ``m`` in --pipeline-model-parallel-layout (Megatron's
DeepSeek launch style, ``...mL``): at PP 2, with and without virtual stages, the run trains as
one process does and bit for bit as the same layout without the ``m`` letters; its torch_dist
checkpoint holds Megatron-Core's keys (``mtp.layers.K...``; the decoder layers stacked in
``decoder.layers...`` in the order of the layout without ``m``), with the same values as the
one without ``m``."""

import pytest
import torch

from tests.functional.test_mtp_pipeline import _assert_parity, _run, corpus  # noqa: F401

PP2 = ["--pipeline-model-parallel-size", "2"]
SAVE = ["--untie-embeddings-and-output-weights", "--ckpt-format", "torch_dist"]


def _tensors(folder):
    """``{key: tensor}`` of every model tensor of the torch_dist checkpoint in ``folder``."""
    from megatron.checkpoint.dist import DistCheckpointReader

    reader = DistCheckpointReader(str(folder / f"iter_{4:07d}"))
    return {key: reader.read(key) for key in reader.tensor_keys()
            if not key.startswith("optimizer")}


@pytest.mark.slow
@pytest.mark.parametrize("with_m, without_m", [("Et|tttmmL", "Et|tttL"),
                                               ("Et|t|t|tmmL", "Et|t|t|tL")],
                         ids=["pp2", "pp2-vp2"])
def test_mtp_letters_in_the_layout_train_as_one_process_and_as_without_them(
        corpus, tmp_path, with_m, without_m):  # noqa: F811
    single = _run(corpus, 1, SAVE + ["--save", str(tmp_path / "single")])
    got = _run(corpus, 2, SAVE + PP2 + ["--pipeline-model-parallel-layout", with_m,
                                        "--save", str(tmp_path / "m")])
    plain = _run(corpus, 2, SAVE + PP2 + ["--pipeline-model-parallel-layout", without_m,
                                          "--save", str(tmp_path / "plain")])
    _assert_parity(got, single)
    assert got["losses"] == plain["losses"] and got["grad_norms"] == plain["grad_norms"]
    assert got["mtp"] == plain["mtp"]
    ours, reference, one = (_tensors(tmp_path / n) for n in ("m", "plain", "single"))
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.1.eh_proj.weight",
            "mtp.layers.1.enorm.weight"} <= set(ours)
    # Megatron stacks the decoder layers along a first dimension: the four 't's, no 'm'.
    assert ours["decoder.layers.mlp.linear_fc1.weight"].shape[0] == 4
    assert sorted(ours) == sorted(reference) == sorted(one)
    assert [k for k in ours if not torch.equal(ours[k], reference[k])] == []
    # Four Adam steps from the same start: the trained weights agree with one process's.
    for key in ours:
        assert torch.allclose(ours[key], one[key], rtol=1e-3, atol=1e-5), key
