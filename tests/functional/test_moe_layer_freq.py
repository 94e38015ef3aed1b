"""A tiny MoE GPT whose dense and MoE layers alternate (``--moe-layer-freq 2``: layers 0 and 2
of 4 are MoE) in ``--ckpt-format torch_dist``: the file has Megatron-Core's per-layer keys
(``decoder.layers.<g>.*``, no layer axis; FORMATS.md section 8 and
:mod:`megatron.checkpoint.dist.keys`), resumes bit for bit, and loads at another layout
continuing the single-process run's losses (1e-4 relative, as test_moe_checkpoint.py).
"""

import os

import pytest
import torch

from megatron.checkpoint.dist.reader import DistCheckpointReader
from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import _check_parity, _flags, _losses, corpus  # noqa: F401
from tests.multiprocess import run_on_ranks

N = 3   # iterations before the save; 3 more after it
FREQ = ["--moe-layer-freq", "2", "--ckpt-format", "torch_dist"]
H, FFN, E = 32, 128, 4


def _run(corpus, world, extra=(), pp=1):
    return run_on_ranks(run_pretrain, world, _flags(corpus, pp=pp, extra=FREQ + list(extra)))[-1]


@pytest.fixture(scope="module")
def straight(corpus):
    return _run(corpus, 1)


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """``saved(world, *flags)``: (folder, result) of a run that saved at iteration N."""
    made = {}

    def get(world, *flags, pp=1):
        if (world, flags, pp) not in made:
            save = str(tmp_path_factory.mktemp("freq2") / "save")
            first = _run(corpus, world, ["--save", save, "--exit-interval", str(N)] + list(flags),
                         pp=pp)
            made[world, flags, pp] = save, first
        return made[world, flags, pp]
    return get


def test_file_has_megatron_cores_per_layer_keys(saved):
    save, _ = saved(1)
    reader = DistCheckpointReader(os.path.join(save, f"iter_{N:07d}"))
    model = {k: list(reader.shape(k)) for k in reader.tensor_keys()
             if not k.startswith("optimizer.")}
    layer_keys = [k for k in model if k.startswith("decoder.layers.")]
    assert layer_keys and all(k.split(".")[2].isdigit() for k in layer_keys), layer_keys
    assert {int(k.split(".")[2]) for k in layer_keys} == {0, 1, 2, 3}
    for g in range(4):
        assert model[f"decoder.layers.{g}.self_attention.linear_qkv.weight"] == [3 * H, H]
        assert model[f"decoder.layers.{g}.self_attention.linear_qkv.layer_norm_weight"] == [H]
        assert model[f"decoder.layers.{g}.mlp.linear_fc1.layer_norm_weight"] == [H]
    for g in (0, 2):   # MoE layers
        assert model[f"decoder.layers.{g}.mlp.router.weight"] == [E, H]
        assert model[f"decoder.layers.{g}.mlp.experts.experts.linear_fc1.weight"] == [E, FFN, H]
        assert model[f"decoder.layers.{g}.mlp.experts.experts.linear_fc2.weight"] == [E, H, FFN]
        assert f"decoder.layers.{g}.mlp.linear_fc1.weight" not in model
    for g in (1, 3):   # dense layers
        assert model[f"decoder.layers.{g}.mlp.linear_fc1.weight"] == [FFN, H]
        assert model[f"decoder.layers.{g}.mlp.linear_fc2.weight"] == [H, FFN]
        assert f"decoder.layers.{g}.mlp.router.weight" not in model
    assert list(reader.shape("optimizer.state.exp_avg.decoder.layers.1.mlp.linear_fc1."
                             "weight")) == [FFN, H]
    assert list(reader.shape("optimizer.state.exp_avg_sq.decoder.layers.2.mlp.experts.experts."
                             "linear_fc1.weight")) == [E, FFN, H]
    objects = set(reader.byte_keys())
    assert "decoder.layers.1.mlp.linear_fc2._extra_state/shard_0_1" in objects
    assert "decoder.layers.0.mlp.experts.experts.linear_fc1._extra_state/shard_3_4" in objects
    assert not any(k.startswith("decoder.layers.mlp") for k in objects)


def test_resume_is_bit_exact(corpus, straight, saved):
    save, first = saved(1)
    second = _run(corpus, 1, ["--load", save])
    assert _losses(first) == _losses(straight)[:N]
    assert _losses(second) == _losses(straight)[N:], (straight, second)


@pytest.mark.parametrize("flags,pp", [(("--expert-model-parallel-size", "2"), 1),
                                      pytest.param((), 2, marks=pytest.mark.slow),
                                      pytest.param(("--use-distributed-optimizer",
                                                    "--expert-model-parallel-size", "2"), 1,
                                                   marks=pytest.mark.slow)],
                         ids=["ep2", "pp2", "distopt-ep2"])
def test_saved_at_another_layout_loads_in_one_process(corpus, straight, saved, flags, pp):
    save, first = saved(2, *flags, pp=pp)
    second = _run(corpus, 1, ["--load", save])
    _check_parity(straight, {"losses": first["losses"] + second["losses"]})


def test_loading_with_freq_1_names_the_layout(corpus, saved):
    """The saved args stop the load first, naming the layers with experts on both sides (a
    file without args would stop at its per-layer keys: see the unit tests)."""
    save, _ = saved(1)
    flags = [f for f in _flags(corpus, extra=["--ckpt-format", "torch_dist", "--load", save])]
    with pytest.raises(Exception, match=r"the model shape differs from the flags: "
                       r"--moe-layer-freq \(checkpoint '1010', flags '1111'\)"):
        run_on_ranks(run_pretrain, 1, flags)


def test_saved_weights_are_the_trained_models(saved):
    """The EP 2 save holds the same per-layer tensors as the single-process one (the runs
    agree to the float reordering of 3 steps)."""
    one = DistCheckpointReader(os.path.join(saved(1)[0], f"iter_{N:07d}"))
    two = DistCheckpointReader(os.path.join(saved(2, "--expert-model-parallel-size", "2")[0],
                                            f"iter_{N:07d}"))
    assert one.summary() == two.summary()
    for key in one.tensor_keys():
        assert torch.allclose(one.read(key), two.read(key), rtol=1e-4, atol=1e-6), key


def _convert(src, dst, *flags):
    from tools.checkpoint.convert import main

    assert main(["--model-type", "GPT", "--load-dir", src, "--save-dir", dst] + list(flags)) == 0
    return dst


def test_converter_round_trip_through_torch_is_bit_identical(saved, tmp_path):
    """torch_dist -> torch at TP 2 x EP 2 -> torch_dist at TP 1: every saved tensor (weights
    and Adam moments, per-layer keys) comes back bit for bit; the torch files hold dense MLPs
    at layers 1 and 3 and the target's args keep --moe-layer-freq 2."""
    from megatron.training import checkpointing

    src = saved(1)[0]
    mid = _convert(src, str(tmp_path / "mid"), "--target-tensor-parallel-size", "2",
                   "--target-expert-parallel-size", "2", "--target-ckpt-format", "torch")
    iter_dir = os.path.join(mid, f"iter_{N:07d}")
    assert checkpointing.saved_sizes(iter_dir) == (2, 1, 2)
    state = checkpointing.load_state_file(os.path.join(iter_dir, "mp_rank_01_001",
                                                       "model_optim_rng.pt"))
    assert state["args"].moe_layer_freq == 2
    encoder = state["model"]["language_model"]["encoder"]
    assert tuple(encoder["layers.1.mlp.dense_h_to_4h.weight"].shape) == (FFN // 2, H)
    assert "layers.1.mlp.router.weight" not in encoder
    assert tuple(encoder["layers.2.mlp.experts.local_experts.1.linear_fc1.weight"].shape) == (
        FFN // 2, H)
    back = _convert(mid, str(tmp_path / "back"), "--target-tensor-parallel-size", "1",
                    "--target-expert-parallel-size", "1", "--target-ckpt-format", "torch_dist")
    want = DistCheckpointReader(os.path.join(src, f"iter_{N:07d}"))
    got = DistCheckpointReader(os.path.join(back, f"iter_{N:07d}"))
    model_keys = [k for k in want.tensor_keys() if not k.startswith("optimizer.state.fp32")]
    assert sorted(model_keys) == sorted(got.tensor_keys())
    for key in model_keys:
        assert torch.equal(want.read(key), got.read(key)), key
    # The converter drops the RNG and rerun-machine state (see megatron/convert/dist_io.py).
    dropped = ("rng_state/", "rerun_state_machine_state/")
    assert sorted(k for k in want.byte_keys() if not k.startswith(dropped)) == \
        sorted(got.byte_keys())
