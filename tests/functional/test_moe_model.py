"""A mixture-of-experts GPT end to end: Megatron-Core's MoE file (``mcore_dist_moe_ep1``)
loaded through ``pretrain_gpt.py --load`` gives its recorded logits; a ``torch_dist`` file
written here for that model has exactly Megatron-Core's keys, shapes and dtypes; a file saved at
TP 2 loads at TP 1.
"""

import os
import shutil

import pytest
import torch

from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load,
                                                    fixture_dir, megatron_argv, reference)
from tests.multiprocess import run_on_ranks

MOE = "mcore_dist_moe_ep1"


def _argv(load, *extra):
    return megatron_argv(MOE) + ["--load", load, "--device", "cpu", *extra]


def test_load_of_megatrons_moe_file_gives_its_logits():
    logits, iteration, _ = run_on_ranks(_logits_after_load, 1, _argv(fixture_dir(MOE)))[0]
    assert iteration == 10
    torch.testing.assert_close(logits.float(), reference(MOE)["logits"], atol=LOGITS_ATOL,
                               rtol=0)


def _tensor_summary(iter_dir):
    from megatron.checkpoint.dist import DistCheckpointReader

    reader = DistCheckpointReader(iter_dir)
    tensors = {k: v for k, v in reader.summary().items() if not k.startswith("optimizer.")}
    extra = sorted(k for k in reader.byte_keys() if "_extra_state" in k)
    return tensors, extra


def _trained_on(tmp_path, *extra):
    """One more iteration of the fixture's model, loaded from it, saved as torch_dist."""
    from tests.functional.gpt_runs import run_pretrain

    save = str(tmp_path / "saved")
    argv = _argv(fixture_dir(MOE), "--save", save, "--train-iters", "11", "--mock-data",
                 "--no-load-optim", "--no-save-optim", "--eval-iters", "0", "--num-workers", "0",
                 *extra)
    run_on_ranks(run_pretrain, 1, argv)
    return os.path.join(save, "iter_0000011")


def test_torch_dist_written_here_has_megatrons_moe_keys_shapes_and_dtypes(tmp_path):
    want = _tensor_summary(os.path.join(fixture_dir(MOE), "iter_0000010"))
    assert _tensor_summary(_trained_on(tmp_path)) == want


def _trained_at(tmp_path, name, tp):
    from tests.functional.gpt_runs import run_pretrain

    save = str(tmp_path / name)
    argv = _argv(fixture_dir(MOE), "--save", save, "--train-iters", "11", "--mock-data",
                 "--no-load-optim", "--no-save-optim", "--eval-iters", "0", "--num-workers", "0",
                 "--tensor-model-parallel-size", str(tp),
                 *(["--sequence-parallel"] if tp > 1 else []))
    run_on_ranks(run_pretrain, tp, argv)
    shutil.copy(os.path.join(fixture_dir(MOE), "reference.pt"), save)
    return save


@pytest.mark.slow
def test_torch_dist_saved_at_tp2_loads_at_tp1(tmp_path):
    """One step from Megatron's file at TP 2 (sequence parallel) and at TP 1: the TP 2 file,
    loaded at TP 1, gives the logits of the TP 1 file (the same step under another layout)."""
    at_tp2, at_tp1 = _trained_at(tmp_path, "tp2", 2), _trained_at(tmp_path, "tp1", 1)
    got = run_on_ranks(_logits_after_load, 1, _argv(at_tp2))[0]
    want = run_on_ranks(_logits_after_load, 1, _argv(at_tp1))[0]
    assert got[1] == want[1] == 11
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=0)
    assert not torch.equal(want[0], reference(MOE)["logits"])   # the step changed the model


def test_parameter_count_and_flops_of_an_moe_model_by_hand():
    """The fixture's model: the start-up count equals the model's parameters, and the FLOPs
    count 2 routed experts of each MoE layer (hand count below)."""
    import argparse
    import types

    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.memory_accounting import num_parameters_on_rank
    from megatron.model import GPTModel
    from megatron.training.log import num_floating_point_operations

    args = validate_args(parse_args(argv=megatron_argv(MOE) + ["--moe-layer-freq", "([1,0]*2)"]))
    args.padded_vocab_size = 256
    configs = build_configs(args)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                   virtual_pp_size=None, virtual_pp_rank=None)
    model = GPTModel(configs.model, pstate, moe_config=configs.moe)
    have = sum(p.numel() for p in model.parameters())
    h, f, E, L, V, P = 64, 256, 4, 4, 256, 64
    attention = 2 * 2 * h + 3 * h * h + h * h           # two LayerNorms, QKV, dense (no bias)
    dense = attention + 2 * h * f
    moe = attention + E * h + E * 2 * h * f             # router, 4 experts
    want = V * h + P * h + 2 * dense + 2 * moe + 2 * h  # embeddings, layers, final norm
    assert have == want == num_parameters_on_rank(configs.model, moe=configs.moe)
    s, b = 32, 1
    # Forward FLOPs of one token (2 per multiply-add): QKV + dense, attention scores + values.
    per_layer = 2 * (3 * h * h + h * h) + 2 * (2 * s * h)
    expert = 2 * (2 * h * f)                            # fc1 + fc2 of one MLP
    mlp = 2 * expert + 2 * (2 * expert)                 # 2 dense layers; 2 MoE layers, top-2
    logits = 2 * h * V
    hand = 3 * b * s * (L * per_layer + mlp + logits)     # x 3: forward + backward
    assert num_floating_point_operations(args, b) == pytest.approx(hand, rel=1e-12)
