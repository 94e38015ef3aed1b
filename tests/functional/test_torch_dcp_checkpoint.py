"""--ckpt-format torch_dcp: Megatron-LM's torch-format state dict written by
torch.distributed.checkpoint from a fully sharded (FSDP2) run, every rank its own shards.

The expected key list below is derived from Megatron-LM's ``generate_state_dict`` (``args``,
``checkpoint_version``, ``iteration``, ``model``, ``optimizer``, ``opt_param_scheduler``,
``rerun_state_machine``, ``rng_state``, plus ``num_floating_point_operations_so_far``), with
``model`` the FSDP2 GPT model's own state dict (Megatron-Core names, a SwiGLU fc1 whole) and
``optimizer`` the torch optimizer's ``state_dict()`` (moments keyed by parameter number),
flattened as DCP flattens nested dicts and lists.

Across data-parallel sizes the gradients are summed in another order, so that resume agrees
within ``REL_TOL`` (as the fsdp_dtensor tests); the same size resumes bit for bit.
"""

import os

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3
REL_TOL = 1e-5
FSDP2 = ["--use-torch-fsdp2"]
LAYERS = 2     # gpt_flags' model


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra, fmt="torch_dcp"):
    return gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=2, global_batch=8,
                     extra=["--ckpt-format", fmt, "--untie-embeddings-and-output-weights",
                            "--swiglu", *extra])


def _losses(out):
    return [loss for _, loss in out["losses"]]


def _resume(corpus, load, extra, ranks=2, fmt="torch_dcp"):
    out = run_on_ranks(run_pretrain, ranks, _flags(corpus, ["--load", load, "--ckpt-step",
                                                            str(N), *extra], fmt))[-1]
    assert [i for i, _ in out["losses"]] == list(range(N + 1, 2 * N + 1))
    return _losses(out)


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """A DP=2 FSDP2 run saving torch_dcp at iteration N, and its losses."""
    save = str(tmp_path_factory.mktemp("saved") / "torch_dcp")
    out = run_on_ranks(run_pretrain, 2, _flags(corpus, FSDP2 + [
        "--save", save, "--save-interval", str(N)]))[-1]
    assert out["iteration"] == 2 * N
    return save, _losses(out)


def _iter_dir(save):
    return os.path.join(save, f"iter_{N:07d}")


def _metadata_keys(iter_dir):
    """The keys of the folder's DCP metadata, as torch's own reader lists them."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(iter_dir).read_metadata().state_dict_metadata)


def _expected_model_keys():
    per_layer = ["self_attention.linear_qkv.layer_norm_weight",
                 "self_attention.linear_qkv.layer_norm_bias",
                 "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                 "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
                 "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias",
                 "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
                 "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"]
    keys = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
            "decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
            "output_layer.weight"}
    keys |= {f"decoder.layers.{i}.{k}" for i in range(LAYERS) for k in per_layer}
    return {f"model.{k}" for k in keys}


@pytest.mark.slow
def test_resume_is_bit_exact(corpus, saved):
    save, straight = saved
    files = sorted(f for f in os.listdir(_iter_dir(save)) if f.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]
    assert not os.path.exists(os.path.join(_iter_dir(save), "metadata.json"))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(2 * N)   # the last save
    assert _resume(corpus, save, FSDP2) == straight[N:]


@pytest.mark.slow
def test_metadata_lists_megatrons_keys(saved):
    keys = _metadata_keys(_iter_dir(saved[0]))
    model = _expected_model_keys()
    assert {k for k in keys if k.startswith("model.")} == model
    params = len(model)
    for i in range(params):
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert f"optimizer.state.{i}.{field}" in keys, (i, field)
    assert f"optimizer.state.{params}.exp_avg" not in keys
    for field in ("params", "lr", "weight_decay", "betas", "eps"):
        assert f"optimizer.param_groups.0.{field}" in keys, field
    for key in ("args", "checkpoint_version", "iteration", "num_floating_point_operations_so_far",
                "opt_param_scheduler.max_lr", "opt_param_scheduler.num_steps",
                "rerun_state_machine.mode", "rerun_state_machine.sharded.state",
                "rerun_state_machine.sharded.current_iteration",
                "rng_state.0.random_rng_state", "rng_state.0.np_rng_state",
                "rng_state.0.torch_rng_state", "rng_state.0.cuda_rng_state"):
        assert key in keys, key
    assert any(k.startswith("rng_state.0.rng_tracker_states.") for k in keys)
    assert not any(k.startswith("rng_state.1.") for k in keys)   # one state without
    assert not any(".module." in k for k in keys)                # --data-parallel-random-init


@pytest.mark.slow
def test_loads_at_another_data_parallel_size_with_equal_weights(corpus, saved, tmp_path):
    """Loaded at DP 1 and converted to the torch format, the weights are the folder's whole
    tensors read back by torch's own DCP reader; the resume at DP 1 continues the run."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    save, straight = saved
    converted = str(tmp_path / "torch")
    run_on_ranks(run_pretrain, 1, _flags(corpus, FSDP2 + [
        "--load", save, "--ckpt-step", str(N), "--ckpt-convert-format", "torch",
        "--ckpt-convert-save", converted]))
    flat = str(tmp_path / "flat.pt")
    dcp_to_torch_save(_iter_dir(save), flat)
    stored = torch.load(flat, weights_only=False)   # flat: DCP's names
    whole = torch.load(os.path.join(converted, f"iter_{N:07d}", "mp_rank_00",
                                    "model_optim_rng.pt"), weights_only=False)["model"]
    lm = whole["language_model"]
    encoder = lm["encoder"]
    pairs = {"embedding.word_embeddings.weight": lm["embedding"]["word_embeddings"]["weight"],
             "decoder.layers.1.self_attention.linear_qkv.weight":
                 encoder["layers.1.self_attention.query_key_value.weight"],
             "decoder.layers.0.mlp.linear_fc1.weight":
                 encoder["layers.0.mlp.dense_h_to_4h.weight"],
             "decoder.final_layernorm.weight": encoder["final_layernorm.weight"],
             "output_layer.weight": lm["output_layer"]["weight"]}
    for key, value in pairs.items():
        assert torch.equal(stored[f"model.{key}"], value), key
    resumed = _resume(corpus, save, FSDP2, ranks=1)
    for x, y in zip(resumed, straight[N:]):
        assert abs(x - y) <= REL_TOL * abs(y), (resumed, straight)


def _copy(save, dst):
    import shutil

    shutil.copytree(save, dst)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "truncated", "garbled"])
def test_a_damaged_shard_file_is_named(corpus, saved, tmp_path, damage):
    save = _copy(saved[0], str(tmp_path / "ckpt"))
    victim = os.path.join(_iter_dir(save), "__1_0.distcp")
    if damage == "missing":
        os.remove(victim)
    else:
        size = os.path.getsize(victim)
        with open(victim, "r+b") as f:
            if damage == "truncated":
                f.truncate(size // 2)
            else:
                f.write(b"\xff" * size)
    with pytest.raises(AssertionError) as err:
        _resume(corpus, save, FSDP2)
    lines = [line for line in str(err.value).splitlines() if victim in line]
    assert lines, str(err.value)[-2000:]
    assert "CheckpointError" in lines[0], lines[0]


@pytest.mark.slow
def test_converter_reads_the_weights(saved, tmp_path, corpus):
    """tools/checkpoint/convert.py's stream of the torch_dcp folder equals its stream of the
    torch checkpoint the FSDP2 run itself writes with --ckpt-convert-format."""
    from megatron.convert.dist_io import load_dist
    from megatron.convert.megatron_io import load_megatron

    save, _ = saved
    converted = str(tmp_path / "torch")
    run_on_ranks(run_pretrain, 2, _flags(corpus, FSDP2 + [
        "--load", save, "--ckpt-step", str(N), "--ckpt-convert-format", "torch",
        "--ckpt-convert-save", converted]))
    got, want = list(load_dist(save, N)), list(load_megatron(converted, N))
    assert [(p.kind, p.index) for p in got] == [(p.kind, p.index) for p in want]
    assert got[0].meta.swiglu and got[0].meta.num_layers == want[0].meta.num_layers
    for a, b in zip(got[1:], want[1:]):
        assert sorted(a.tensors) == sorted(b.tensors), a.kind
        for name in a.tensors:
            assert torch.equal(a.tensors[name], b.tensors[name]), (a.kind, a.index, name)


@pytest.mark.slow
def test_bf16_resume_is_bit_exact_with_the_mixed_precision_layout(corpus, tmp_path):
    """With --bf16 the optimizer entry takes Megatron's mixed-precision layout (the torch
    optimizer's dict under ``optimizer.optimizer``, the fp32 weights under
    ``optimizer.fp32_from_fp16_params``, the model's tensors in bf16) and the resume is exact."""
    save = str(tmp_path / "ckpt")
    extra = FSDP2 + ["--bf16"]
    out = run_on_ranks(run_pretrain, 2, _flags(corpus, extra + [
        "--save", save, "--save-interval", str(N)]))[-1]
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(_iter_dir(save)).read_metadata().state_dict_metadata
    assert "optimizer.optimizer.state.0.exp_avg" in meta
    assert "optimizer.fp32_from_fp16_params.0.0" in meta
    assert meta["model.output_layer.weight"].properties.dtype == torch.bfloat16
    assert _resume(corpus, save, extra) == _losses(out)[N:]
