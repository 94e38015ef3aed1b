"""``tools/checkpoint/convert.py`` with mixture-of-experts models (expert-parallel size 1).

Reference: Megatron-Core's own MoE file (tests/data/megatron_written/mcore_dist_moe_ep1, 4
layers of 4 experts, top-2). A torch_dist checkpoint stores whole tensors, so a trip through the
legacy format at TP 2 and back must give every tensor of Megatron's file bit for bit; the legacy
file at TP 2 must give the file's recorded logits through this project's model.
"""

import os
import shutil

import pytest
import torch

from megatron.training import checkpointing
from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load,
                                                    fixture_dir, megatron_argv, reference)
from tests.multiprocess import run_on_ranks
from tools.checkpoint.convert import main

MOE = "mcore_dist_moe_ep1"
RUN_STATE_ENTRIES = {"rng_state/shard_0.0_1.1", "rerun_state_machine_state/shard_0_1"}


def _convert(src, dst, *flags):
    assert main(["--model-type", "GPT", "--load-dir", src, "--save-dir", dst] + list(flags)) == 0
    return dst


def _iter_dir(root):
    iteration, release = checkpointing.read_tracker(root)
    return os.path.join(root, checkpointing.checkpoint_dir_name(iteration, release))


def _model_keys(reader):
    return {k: v for k, v in reader.summary().items() if not k.startswith("optimizer.")}


def test_moe_file_round_trips_through_legacy_tp2_bit_for_bit(tmp_path):
    legacy = _convert(fixture_dir(MOE), str(tmp_path / "tp2"), "--target-ckpt-format", "torch",
                      "--target-tensor-parallel-size", "2")
    back = _convert(legacy, str(tmp_path / "dist"), "--target-ckpt-format", "torch_dist",
                    "--target-tensor-parallel-size", "1")
    ours, theirs = DistCheckpointReader(_iter_dir(back)), DistCheckpointReader(_iter_dir(
        fixture_dir(MOE)))
    assert _model_keys(ours) == _model_keys(theirs)
    extra = {k for k in theirs.byte_keys() if "_extra_state" in k}
    assert {k for k in ours.byte_keys() if "_extra_state" in k} == extra
    for key in _model_keys(theirs):
        assert torch.equal(ours.read(key), theirs.read(key)), key
    args = ours.common_state()["args"]
    assert (args.num_experts, args.moe_router_topk, args.expert_tensor_parallel_size) == (4, 2, 1)


@pytest.mark.slow
def test_moe_file_converted_to_tp2_gives_megatrons_logits(tmp_path):
    out = _convert(fixture_dir(MOE), str(tmp_path / "tp2"), "--target-ckpt-format", "torch",
                   "--target-tensor-parallel-size", "2")
    shutil.copy(os.path.join(fixture_dir(MOE), "reference.pt"), out)
    argv = megatron_argv(MOE) + ["--load", out, "--device", "cpu"]
    argv[argv.index("--tensor-model-parallel-size") + 1] = "2"
    argv.append("--sequence-parallel")   # MoE at TP > 1 needs it, as in Megatron
    for logits, iteration, _ in run_on_ranks(_logits_after_load, 2, argv):
        assert iteration == 10
        torch.testing.assert_close(logits.float(), reference(MOE)["logits"], atol=LOGITS_ATOL,
                                   rtol=0)


def test_saved_moe_layer_pattern_is_carried_in_megatrons_form():
    """An int stays an int; a list (Megatron's args hold a list, ours a tuple, an old file may
    hold the flag's string) becomes a list of 0/1; a malformed one is refused naming it."""
    import argparse

    from megatron.convert import megatron_io
    from megatron.convert.schema import ConversionError

    def freq(value, layers=4):
        args = argparse.Namespace(num_experts=4, moe_layer_freq=value, num_layers=layers)
        return megatron_io._moe_fields(args, "file")["moe_layer_freq"]

    assert freq(2) == 2 and freq(None) == 1
    assert freq((1, 0, 1, 1)) == [1, 0, 1, 1]
    assert freq("([0]+[1]*3)") == [0, 1, 1, 1]
    with pytest.raises(ConversionError, match=r"file: --moe-layer-freq \[1, 0\]: expected one"):
        freq([1, 0])


@pytest.mark.slow
def test_mixtral_folder_converted_to_megatron_gives_transformers_logits(tmp_path):
    """A Mixtral folder (exported from a tiny model here), converted to a TP 1 checkpoint and
    loaded by ``pretrain_gpt``'s model from the flags alone, gives transformers' logits."""
    transformers = pytest.importorskip("transformers")
    from tests.unit.test_convert_hf import SEQ, VOCAB, export
    from tests.unit.test_convert_hf_mixtral import build_moe_model, moe_meta

    cfg, model = build_moe_model(seed=11)
    folder = export(tmp_path, model, moe_meta(cfg))
    out = _convert(folder, str(tmp_path / "megatron"), "--loader", "hf",
                   "--target-tensor-parallel-size", "1")
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    hf = transformers.MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(tokens).logits
    torch.save({"tokens": tokens, "position_ids": torch.arange(SEQ).expand(2, SEQ)},
               os.path.join(out, "reference.pt"))
    argv = ["--load", out, "--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
            "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
            "--position-embedding-type", "rope", "--rotary-base", "500",
            "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
            "--ffn-hidden-size", "24", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "24", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), "--micro-batch-size", "2", "--hidden-dropout", "0",
            "--attention-dropout", "0"]
    logits, _, _ = run_on_ranks(_logits_after_load, 1, argv)[0]
    torch.testing.assert_close(logits[..., :VOCAB].float(), want, atol=1e-5, rtol=0)


def _drop_flag(argv, flag, takes_value=True):
    at = argv.index(flag)
    return argv[:at] + argv[at + 1 + int(takes_value):]


@pytest.mark.slow
@pytest.mark.parametrize("gate", [False, True])
def test_shared_expert_model_round_trips_through_legacy_tp2_bit_for_bit(tmp_path, gate):
    """A model with a shared expert, trained three steps here from scratch and saved as torch_dist,
    comes back from the legacy format at TP 2 with every tensor and extra-state entry."""
    from tests.functional.gpt_runs import run_pretrain

    save = str(tmp_path / "trained")
    argv = megatron_argv(MOE) + ["--device", "cpu", "--save", save,
                                 "--mock-data", "--eval-iters", "0", "--num-workers", "0",
                                 "--no-save-optim", "--moe-shared-expert-intermediate-size",
                                 "32"] + (["--moe-shared-expert-gate"] if gate else [])
    argv = _drop_flag(_drop_flag(argv, "--save-interval"), "--train-iters")
    argv += ["--save-interval", "3", "--train-iters", "3"]
    run_on_ranks(run_pretrain, 1, argv)
    legacy = _convert(save, str(tmp_path / "tp2"), "--target-ckpt-format", "torch",
                      "--target-tensor-parallel-size", "2", "--true-vocab-size", "200")
    back = _convert(legacy, str(tmp_path / "dist"), "--target-ckpt-format", "torch_dist",
                    "--target-tensor-parallel-size", "1", "--true-vocab-size", "200")
    ours, theirs = DistCheckpointReader(_iter_dir(back)), DistCheckpointReader(_iter_dir(save))
    assert "decoder.layers.mlp.shared_experts.linear_fc1.weight" in _model_keys(theirs)
    assert ("decoder.layers.mlp.shared_experts.gate_weight" in _model_keys(theirs)) == gate
    assert _model_keys(ours) == _model_keys(theirs)
    extra = {k for k in theirs.byte_keys() if "_extra_state" in k}
    assert {k for k in ours.byte_keys() if "_extra_state" in k} == extra
    for key in _model_keys(theirs):
        assert torch.equal(ours.read(key), theirs.read(key)), key
