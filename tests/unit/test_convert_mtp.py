"""Multi-token prediction through the converter between the two Megatron formats: Megatron-LM's
own DeepSeek-V3-style file (``mcore_dist_dsv3_mtp``: 4 layers, MoE, one MTP depth with an MoE
layer) resharded to TP 2 x PP 2 in either format (and EP 2 in torch's) and back to one rank gives every model
tensor of the file bit for bit, the MTP ones included."""

import os

import pytest
import torch

from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.test_megatron_written import fixture_dir

SOURCE = "mcore_dist_dsv3_mtp"


def _model_tensors(folder):
    (name,) = [d for d in os.listdir(folder) if d.startswith(("iter_", "release"))]
    reader = DistCheckpointReader(os.path.join(folder, name))
    return {key: reader.read(key) for key in reader.tensor_keys()
            if not key.startswith("optimizer.")}


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_mtp_file_through_tp2_pp2_ep2_comes_back_bit_for_bit(tmp_path, fmt):
    from tools.checkpoint.convert import main

    source = fixture_dir(SOURCE)
    middle, back = str(tmp_path / "middle"), str(tmp_path / "back")
    common = ["--model-type", "GPT", "--true-vocab-size", "256"]
    assert main(common + ["--load-dir", source, "--save-dir", middle,
                          "--target-tensor-parallel-size", "2",
                          "--target-pipeline-parallel-size", "2",
                          "--target-ckpt-format", fmt]
                + (["--target-expert-parallel-size", "2"] if fmt == "torch" else [])) == 0
    assert main(common + ["--load-dir", middle, "--save-dir", back,
                          "--target-tensor-parallel-size", "1",
                          "--target-pipeline-parallel-size", "1",
                          "--target-ckpt-format", "torch_dist"]) == 0
    want, got = _model_tensors(source), _model_tensors(back)
    mtp = [k for k in want if k.startswith("mtp.layers.0.")]
    assert "mtp.layers.0.eh_proj.weight" in mtp and any("experts" in k for k in mtp)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
