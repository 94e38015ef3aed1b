"""--ckpt-format fsdp_dtensor: each rank writes its own FSDP2 shards under Megatron-LM's keys.

A fully sharded run resumed from its own checkpoint continues bit for bit (both FSDP flags);
the folder is a plain ``torch.distributed.checkpoint`` one that torch's own reader opens, and its
tensors equal the whole tensors of the torch format; it loads under FSDP2 at another
data-parallel or tensor-parallel size, and ``--ckpt-convert-format`` under FSDP2 turns it into
a checkpoint a run without FSDP resumes; a run without FSDP refuses it in one line.

Across layouts the gradients are summed in another order, so those resumes agree with the
uninterrupted run within ``REL_TOL`` (as in ``test_torch_fsdp2_checkpoint``: ~1e-7 measured,
while a moment loaded into the wrong shard moves the loss by 1e-3).
"""

import os

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3
REL_TOL = 1e-5
FSDP2 = ["--use-torch-fsdp2"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer",
                 "--no-gradient-accumulation-fusion"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra, fmt="fsdp_dtensor", swiglu=True):
    model = ["--swiglu"] if swiglu else []
    return gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=2, global_batch=8,
                     extra=["--ckpt-format", fmt, "--untie-embeddings-and-output-weights",
                            *model, *extra])


def _losses(out):
    return [loss for _, loss in out["losses"]]


def _close(a, b):
    assert len(a) == len(b) == N, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= REL_TOL * abs(y), (a, b)


def _straight(corpus, save, extra, ranks=2, fmt="fsdp_dtensor"):
    out = run_on_ranks(run_pretrain, ranks, _flags(corpus, ["--save", save, "--save-interval",
                                                            str(N), *extra], fmt))[-1]
    assert out["iteration"] == 2 * N
    return _losses(out)


def _resume(corpus, load, extra, ranks=2, fmt="fsdp_dtensor"):
    out = run_on_ranks(run_pretrain, ranks, _flags(corpus, ["--load", load, "--ckpt-step",
                                                            str(N), *extra], fmt))[-1]
    assert [i for i, _ in out["losses"]] == list(range(N + 1, 2 * N + 1))
    return _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [
    pytest.param(FSDP2, id="torch-fsdp2"),
    pytest.param(FSDP2 + ["--bf16"], id="torch-fsdp2-bf16"),
    pytest.param(MEGATRON_FSDP, id="megatron-fsdp-optim_grads_params"),
    pytest.param(MEGATRON_FSDP + ["--data-parallel-sharding-strategy", "optim_grads"],
                 id="megatron-fsdp-optim_grads")])
def test_resume_is_bit_exact(corpus, tmp_path, fsdp):
    save = str(tmp_path / "ckpt")
    straight = _straight(corpus, save, fsdp)
    iter_dir = os.path.join(save, f"iter_{N:07d}")
    assert sorted(f for f in os.listdir(iter_dir) if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    assert not os.path.exists(os.path.join(iter_dir, "metadata.json"))
    assert _resume(corpus, save, fsdp) == straight[N:]


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """A DP=2 FSDP2 run (SwiGLU, untied output layer) saving fsdp_dtensor at iteration N, its
    losses, and the same checkpoint converted under FSDP2 to the torch format."""
    root = tmp_path_factory.mktemp("saved")
    save, torch_dir = str(root / "fsdp_dtensor"), str(root / "torch")
    straight = _straight(corpus, save, FSDP2)
    run_on_ranks(run_pretrain, 2, _flags(corpus, FSDP2 + [
        "--load", save, "--ckpt-step", str(N), "--ckpt-convert-format", "torch",
        "--ckpt-convert-save", torch_dir]))
    return save, torch_dir, straight


def _dcp_entries(iter_dir, tmp_path):
    """The folder as torch's own DCP reader sees it (our own file: its unpickling is fine)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp_path / "flat.pt")
    dcp_to_torch_save(iter_dir, out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_keys_and_values_are_megatron_fsdp_dtensor_layout(saved, tmp_path):
    save, torch_dir, _ = saved
    flat = _dcp_entries(os.path.join(save, f"iter_{N:07d}"), tmp_path)
    whole = torch.load(os.path.join(torch_dir, f"iter_{N:07d}", "mp_rank_00",
                                    "model_optim_rng.pt"), weights_only=False)["model"]
    lm = whole["language_model"]
    layer = lm["encoder"]
    ffn = layer["layers.0.mlp.dense_h_to_4h.weight"].shape[0] // 2
    pairs = {
        "embedding.word_embeddings.weight": lm["embedding"]["word_embeddings"]["weight"],
        "decoder.layers.1.self_attention.linear_qkv.weight":
            layer["layers.1.self_attention.query_key_value.weight"],
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight":
            layer["layers.1.input_layernorm.weight"],
        "decoder.layers.0.mlp.linear_fc1.weight_w": layer["layers.0.mlp.dense_h_to_4h.weight"][:ffn],
        "decoder.layers.0.mlp.linear_fc1.weight_v": layer["layers.0.mlp.dense_h_to_4h.weight"][ffn:],
        "decoder.layers.0.mlp.linear_fc2.weight": layer["layers.0.mlp.dense_4h_to_h.weight"],
        "decoder.final_layernorm.weight": layer["final_layernorm.weight"],
        "output_layer.weight": lm["output_layer"]["weight"],
    }
    for key, expected in pairs.items():
        assert torch.equal(flat[f"model.module.{key}"], expected), key
    state = "optimizer.state.module.module.module."
    meta = "optimizer.param_to_group_meta.module.module.module."
    model_keys = [k[len("model.module."):] for k in flat if k.startswith("model.module.")]
    for key in model_keys:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert f"{state}{key}.{field}" in flat, (key, field)
        assert flat[f"{state}{key}.exp_avg"].shape == flat[f"model.module.{key}"].shape
        assert f"{meta}{key}.lr" in flat and f"{meta}{key}.weight_decay" in flat
    assert flat["iteration"] == N and flat["checkpoint_version"] == 3.0
    assert flat["args"].ckpt_format == "fsdp_dtensor"
    assert any(k.startswith("rng_state.(0, 0).1.") for k in flat)   # both DP ranks' states
    assert "opt_param_scheduler.num_steps" in flat


@pytest.mark.slow
@pytest.mark.parametrize("ranks, extra", [
    pytest.param(1, [], id="dp1"),
    pytest.param(2, ["--tensor-model-parallel-size", "2"], id="tp2-dp1")])
def test_loads_under_fsdp2_at_another_layout(corpus, saved, ranks, extra):
    save, _, straight = saved
    _close(_resume(corpus, save, FSDP2 + extra, ranks=ranks), straight[N:])


@pytest.mark.slow
def test_converted_under_fsdp2_it_resumes_without_fsdp(corpus, saved):
    _, torch_dir, straight = saved
    _close(_resume(corpus, torch_dir, [], fmt="torch"), straight[N:])


@pytest.mark.slow
def test_a_run_without_fsdp_refuses_it_in_one_line(corpus, saved):
    save, _, _ = saved
    with pytest.raises(AssertionError) as err:
        _resume(corpus, save, [], fmt="torch")
    line = [s for s in str(err.value).splitlines() if "fsdp_dtensor holds" in s]
    assert line and "--ckpt-convert-format torch_dist" in line[0]


@pytest.mark.slow
def test_a_checkpoint_without_fsdp_continues_as_fsdp_dtensor(corpus, tmp_path):
    """The reverse: torch_dist saved without FSDP, resumed under FSDP2 writing fsdp_dtensor,
    and that checkpoint resumed again: the losses are the uninterrupted run's."""
    first = str(tmp_path / "torch_dist")
    out = run_on_ranks(run_pretrain, 2, _flags(corpus, ["--save", first, "--save-interval", "2"],
                                               "torch_dist"))[-1]
    straight = _losses(out)
    second = str(tmp_path / "fsdp_dtensor")
    out = run_on_ranks(run_pretrain, 2, _flags(corpus, FSDP2 + [
        "--load", first, "--ckpt-step", "2", "--save", second, "--save-interval", str(N)]))[-1]
    assert out["iteration"] == 2 * N
    _close(_resume(corpus, second, FSDP2), straight[N:])


def _copy_without(src_root, dst_root, dropped):
    """The checkpoint ``src_root`` rewritten (whole tensors, one writer) without key
    ``dropped``."""
    from megatron.checkpoint.dist import DistCheckpointReader, ObjectShard, TensorShard
    from megatron.checkpoint.dist.writer import save_shards

    name = f"iter_{N:07d}"
    reader = DistCheckpointReader(os.path.join(src_root, name))
    items = [TensorShard(k, reader.read(k), reader.shape(k), (0,) * len(reader.shape(k)))
             for k in reader.tensor_keys() if k != dropped]
    items += [ObjectShard(k, reader.read_object(k), listed=False) for k in reader.byte_keys()]
    save_shards(os.path.join(dst_root, name), items, backend=False)
    with open(os.path.join(dst_root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(N))
    return dst_root


@pytest.mark.slow
def test_a_missing_tensor_stops_the_load_unless_not_strict(corpus, saved, tmp_path, capfd):
    save, _, straight = saved
    dropped = "model.module.decoder.layers.1.self_attention.linear_proj.weight"
    partial = _copy_without(save, str(tmp_path / "partial"), dropped)
    with pytest.raises(AssertionError, match=f"has no '{dropped}'"):
        _resume(corpus, partial, FSDP2)
    capfd.readouterr()
    losses = _resume(corpus, partial, FSDP2 + ["--no-strict-fsdp-dtensor-load"])
    assert f"keep their current values (--no-strict-fsdp-dtensor-load): {dropped}" in \
        capfd.readouterr().out
    assert losses != straight[N:]   # that weight restarted from its initial value
    # A rewritten folder with every key loads as the original (a check of the rewrite).
    whole = _copy_without(save, str(tmp_path / "whole"), None)
    assert _resume(corpus, whole, FSDP2) == straight[N:]


@pytest.mark.slow
def test_hybrid_sharding_writes_one_replica_and_resumes(corpus, tmp_path):
    """HSDP (two replicas of DP 2 at DP 4): only replica 0 writes the shards (the tiling check
    of the metadata would refuse a second copy); bit exact at the same layout, and it loads
    under plain FSDP2 at DP 2."""
    hsdp = MEGATRON_FSDP + ["--num-distributed-optimizer-instances", "2"]
    save = str(tmp_path / "ckpt")
    straight = _straight(corpus, save, hsdp, ranks=4)
    assert _resume(corpus, save, hsdp, ranks=4) == straight[N:]
    _close(_resume(corpus, save, FSDP2, ranks=2), straight[N:])


# -- tools/checkpoint/convert.py reads the format ----------------------------------------------

def _stream(load_dir, step=None):
    from megatron.convert.dist_io import find_dist_checkpoint, load_dist
    from megatron.convert.megatron_io import load_megatron

    if find_dist_checkpoint(load_dir, step) is not None:
        return list(load_dist(load_dir, step))
    return list(load_megatron(load_dir, step))


@pytest.mark.slow
def test_converter_reads_the_weights_the_fsdp2_run_converts(saved):
    """The converter's stream of the fsdp_dtensor folder equals its stream of the torch
    checkpoint the FSDP2 run itself wrote with --ckpt-convert-format (SwiGLU halves joined)."""
    save, torch_dir, _ = saved
    got, want = _stream(save, N), _stream(torch_dir, N)
    assert [(p.kind, p.index) for p in got] == [(p.kind, p.index) for p in want]
    assert got[0].meta.swiglu and got[0].meta.num_layers == want[0].meta.num_layers
    for a, b in zip(got[1:], want[1:]):
        assert sorted(a.tensors) == sorted(b.tensors), a.kind
        for name in a.tensors:
            assert torch.equal(a.tensors[name], b.tensors[name]), (a.kind, a.index, name)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_converted_at_tp2_trains_as_the_fsdp_dtensor_loaded_under_fsdp2(corpus, saved,
                                                                        tmp_path, fmt):
    """Converted to TP=2 by tools/checkpoint/convert.py, the checkpoint fine-tunes (fresh
    optimizer) as the fsdp_dtensor folder loaded under FSDP2 does."""
    from tools.checkpoint.convert import main

    save, _, _ = saved
    target = str(tmp_path / fmt)
    assert main(["--model-type", "GPT", "--load-dir", save, "--save-dir", target,
                 "--ckpt-step", str(N), "--target-tensor-parallel-size", "2", "--target-ckpt-format", fmt]) == 0
    want = run_on_ranks(run_pretrain, 2, _flags(corpus, FSDP2 + [
        "--load", save, "--ckpt-step", str(N), "--finetune"]))
    got = run_on_ranks(run_pretrain, 2, _flags(corpus, [
        "--load", target, "--tensor-model-parallel-size", "2", "--finetune"], fmt=fmt))
    a, b = _losses(got[-1]), _losses(want[-1])
    assert len(a) == len(b) == 2 * N
    for x, y in zip(a, b):
        assert abs(x - y) <= REL_TOL * abs(y), (a, b)


LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm",
         "--disable-bias-linear"]


@pytest.mark.slow
def test_converted_to_hugging_face_as_the_fsdp2_runs_own_conversion(corpus, tmp_path):
    """--saver hf writes the same Hugging Face (Llama) weights from an fsdp_dtensor folder as
    from the torch checkpoint the FSDP2 run itself wrote of it (--ckpt-convert-format)."""
    from safetensors.torch import load_file

    from tools.checkpoint.convert import main

    save, torch_dir = str(tmp_path / "fsdp_dtensor"), str(tmp_path / "torch")
    _straight(corpus, save, FSDP2 + LLAMA)
    run_on_ranks(run_pretrain, 2, _flags(corpus, FSDP2 + LLAMA + [
        "--load", save, "--ckpt-step", str(N), "--ckpt-convert-format", "torch",
        "--ckpt-convert-save", torch_dir]))
    weights = []
    for src, name in ((save, "from_fsdp"), (torch_dir, "from_torch")):
        out = str(tmp_path / name)
        assert main(["--model-type", "GPT", "--load-dir", src, "--save-dir", out,
                     "--ckpt-step", str(N), "--saver", "hf", "--allow-no-tokenizer"]) == 0
        files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
        weights.append({k: t for f in files for k, t in load_file(os.path.join(out, f)).items()})
    assert weights[0].keys() == weights[1].keys()
    assert any("gate_proj" in key for key in weights[0])
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
