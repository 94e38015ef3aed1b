"""Multi-token prediction placed with ``m`` in --pipeline-model-parallel-layout (Megatron's
DeepSeek launch style, ``...mL``): at PP 2, with and without virtual stages, the run trains as
one process does; its torch_dist checkpoint holds Megatron-Core's keys (``mtp.layers.K...``;
the decoder layers stacked in ``decoder.layers...`` in the order of the ``t`` letters) with one
process's values. The same layout without the ``m`` letters is refused, as Megatron refuses
it."""

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
def test_mtp_letters_in_the_layout_train_as_one_process(corpus, tmp_path, with_m, without_m):  # noqa: F811
    single = _run(corpus, 1, SAVE + ["--save", str(tmp_path / "single")])
    got = _run(corpus, 2, SAVE + PP2 + ["--pipeline-model-parallel-layout", with_m,
                                        "--save", str(tmp_path / "m")])
    _assert_parity(got, single)
    ours, one = (_tensors(tmp_path / n) for n in ("m", "single"))
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.1.eh_proj.weight",
            "mtp.layers.1.enorm.weight"} <= set(ours)
    # Megatron stacks the decoder layers along a first dimension: the four 't's, no 'm'.
    assert ours["decoder.layers.mlp.linear_fc1.weight"].shape[0] == 4
    assert sorted(ours) == sorted(one)
    # Four Adam steps from the same start: the trained weights agree with one process's.
    for key in ours:
        assert torch.allclose(ours[key], one[key], rtol=1e-3, atol=1e-5), key
    with pytest.raises(AssertionError, match=r"number of MTP layers \('m', 0\) must match "
                                             r"--mtp-num-layers \(2\)"):
        _run(corpus, 2, SAVE + PP2 + ["--pipeline-model-parallel-layout", without_m])
