"""DeepSeek-V3-style torch_dist checkpoints both ways with Megatron-Core itself (slow: the
``megatron-core`` release from PyPI in its own virtual environment, under torchrun on the CPU;
see ``test_megatron_core.py`` for the environment).

The model (``ARCH``, the same for both sides): RMSNorm, SwiGLU, rope, untied output, no
biases; layer 1 dense and layers 2-3 MoE (``--moe-layer-freq [0,1,1]``, so Megatron-Core stores
per-layer keys) with DeepSeek-V3's router (sigmoid scores, an expert bias that training moves,
8 experts in 4 groups with the best 2 groups kept, top-2, probabilities scaled by 2.5), a shared
expert, and one multi-token prediction layer built from Megatron-Core's MTP block spec.

* Megatron-Core initialises it, trains a few SGD steps (its own expert-bias update after each,
  so the biases are no longer zero) and saves torch_dist; this project loads the file and gives
  Megatron-Core's logits, MTP loss and expert biases on the same tokens.
* This project trains the same architecture a few steps and saves torch_dist; Megatron-Core
  loads the file and gives the logits, MTP loss and expert biases this project computes from it.

The reference in both directions is Megatron-Core's own forward (``megatron_core_dsv3_harness``),
in a process where this project is not importable. Megatron-Core 0.16.1 needs one shim on a
machine without TransformerEngine, described in the harness (``_no_transformer_engine_names``).
"""

import json
import pathlib
import subprocess

import pytest
import torch

from tests.functional.gpt_runs import run_pretrain
from tests.interop.test_megatron_core import _env, mcore_python  # noqa: F401 (fixture)
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow

HARNESS = pathlib.Path(__file__).with_name("megatron_core_dsv3_harness.py")
ARCH = {"num_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
        "kv_channels": 16, "num_experts": 8, "moe_ffn_hidden_size": 32,
        "moe_layer_freq": [0, 1, 1], "topk": 2, "bias_update_rate": 0.1, "num_groups": 4,
        "group_topk": 2, "topk_scaling_factor": 2.5, "shared_expert_size": 32,
        "mtp_loss_scaling_factor": 0.1, "seq_length": 16, "vocab_size": 200,
        "padded_vocab_size": 256, "seed": 7, "train_steps": 3, "lr": 0.05}
# The same with multi-latent attention (a low-rank query, q/kv norms, plain rope).
MLA_ARCH = dict(ARCH, mla=True, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                qk_pos_emb_head_dim=8, v_head_dim=16)
# The same with this project's experts in Megatron-Core's single grouped weight layout
# (--moe-single-grouped-weight: one [local experts, out, in] tensor per projection); Megatron-Core
# runs its loop over experts, whose torch_dist keys are the same.
GROUPED_ARCH = dict(ARCH, single_grouped_weight=True)
# fp32 on both sides; the sums run in different orders (fused QKV vs. separate, experts
# gathered differently), so agreement is to rounding, not bit for bit.
ATOL = 1e-4


def our_argv(arch: dict) -> list:
    """This project's flags for ``arch``."""
    mla = []
    if arch.get("mla"):
        mla = ["--multi-latent-attention", "--qk-layernorm"] + [
            f"--{name.replace('_', '-')}={arch[name]}" for name in (
                "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                "v_head_dim")]
    if arch.get("single_grouped_weight"):
        mla = mla + ["--moe-grouped-gemm", "--moe-use-grouped-tensor",
                     "--moe-single-grouped-weight"]
    return mla + [
        "--num-layers", str(arch["num_layers"]), "--hidden-size", str(arch["hidden_size"]),
        "--num-attention-heads", str(arch["num_attention_heads"]),
        "--ffn-hidden-size", str(arch["ffn_hidden_size"]),
        "--kv-channels", str(arch["kv_channels"]),
        "--seq-length", str(arch["seq_length"]),
        "--max-position-embeddings", str(arch["seq_length"]),
        "--micro-batch-size", "2", "--global-batch-size", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(arch["vocab_size"]),
        "--make-vocab-size-divisible-by", "128", "--tensor-model-parallel-size", "1",
        "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--norm-epsilon", "1e-5",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--num-experts", str(arch["num_experts"]),
        "--moe-ffn-hidden-size", str(arch["moe_ffn_hidden_size"]),
        "--moe-layer-freq", json.dumps(arch["moe_layer_freq"]).replace(" ", ""),
        "--moe-router-topk", str(arch["topk"]), "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate", str(arch["bias_update_rate"]),
        "--moe-router-num-groups", str(arch["num_groups"]),
        "--moe-router-group-topk", str(arch["group_topk"]),
        "--moe-router-topk-scaling-factor", str(arch["topk_scaling_factor"]),
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-3",
        "--moe-shared-expert-intermediate-size", str(arch["shared_expert_size"]),
        "--moe-token-dispatcher-type", "allgather",
        "--mtp-num-layers", "1", "--mtp-loss-scaling-factor",
        str(arch["mtp_loss_scaling_factor"]),
        "--ckpt-format", "torch_dist", "--seed", str(arch["seed"]), "--device", "cpu"]


def _inputs(path) -> str:
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, ARCH["vocab_size"], (2, ARCH["seq_length"] + 1), generator=g)
    torch.save({"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(),
                "position_ids": torch.arange(ARCH["seq_length"]).repeat(2, 1)}, path)
    return str(path)


def _megatron_core(python, mode: str, inputs: str, ckpt, out, arch: dict = ARCH) -> dict:
    """Run the harness from a folder outside the checkout (only Megatron-Core's ``megatron``
    package is importable there); returns what it wrote."""
    cwd = pathlib.Path(out).parent
    arch_file = cwd / "arch.json"
    arch_file.write_text(json.dumps(arch))
    torchrun = pathlib.Path(python).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "1", str(HARNESS), mode,
           str(arch_file), inputs, str(ckpt), str(out)]
    result = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out, weights_only=True)


def _outputs_after_load(argv, inputs: str) -> dict:
    """Rank body: load ``--load`` as the inference tools do; the main head's logits (eval),
    the per-depth MTP losses (a training-mode forward with labels, no step) and the expert
    biases, keyed as the harness keys them."""
    import pretrain_gpt
    from megatron.inference import initialize_for_inference, load_model_for_inference
    from megatron.training import global_vars

    ref = torch.load(inputs, weights_only=True)
    try:
        args, pstate, _ = initialize_for_inference(argv=argv)
        chunks, iteration = load_model_for_inference(pretrain_gpt.model_provider, args, pstate)
        model = chunks[0]
        with torch.no_grad():
            logits = model(ref["tokens"], ref["position_ids"], None)
        model.train()
        model(ref["tokens"], ref["position_ids"], None, labels=ref["labels"])
        mtp_loss = model.mtp_tracker.values.float()
        biases = {_mcore_router_name(name): buf.detach().clone()
                  for name, buf in model.named_buffers() if name.endswith(".expert_bias")}
        return {"logits": logits.float(), "mtp_loss": mtp_loss, "expert_bias": biases,
                "iteration": iteration}
    finally:
        global_vars.unset_global_variables()


def _mcore_router_name(name: str) -> str:
    """``language_model.encoder.layers.N.mlp.router.expert_bias`` -> ``decoder.layers.N.mlp.
    router``; the MTP layer's router keeps its ``mtp.layers.K.transformer_layer`` prefix."""
    name = name[:-len(".expert_bias")]
    return name.replace("language_model.encoder.", "decoder.")


def _assert_same(ours: dict, theirs: dict) -> None:
    assert ours["logits"].shape == theirs["logits"].shape == (2, ARCH["seq_length"], 256)
    torch.testing.assert_close(ours["logits"], theirs["logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours["mtp_loss"], theirs["mtp_loss"].float(), atol=ATOL, rtol=0)
    assert ours["expert_bias"].keys() == theirs["expert_bias"].keys() == {
        "decoder.layers.1.mlp.router", "decoder.layers.2.mlp.router",
        "mtp.layers.0.transformer_layer.mlp.router"}
    for name, bias in theirs["expert_bias"].items():
        assert torch.equal(ours["expert_bias"][name], bias), name
        # moved by training: a multiple of the rate, not all zero
        steps = bias / ARCH["bias_update_rate"]
        torch.testing.assert_close(steps, steps.round(), atol=1e-5, rtol=0)
        assert bool((steps != 0).any()), name


@pytest.mark.parametrize("arch", [ARCH, MLA_ARCH, GROUPED_ARCH],
                         ids=["attention", "mla", "single-grouped-weight"])
def test_a_dsv3_checkpoint_megatron_core_trains_and_saves_loads_here(mcore_python, tmp_path,
                                                                     arch):
    """With MLA, Megatron-Core's core attention is the harness's stand-in (see
    ``StandInCoreAttention``): everything else of its MLA (projections, norms, rope, the
    split into heads) is its own."""
    inputs = _inputs(tmp_path / "inputs.pt")
    saved = tmp_path / "saved_by_megatron_core"
    theirs = _megatron_core(mcore_python, "save", inputs, saved, tmp_path / "mcore.pt", arch)
    argv = our_argv(arch) + ["--load", str(saved)]
    ours = run_on_ranks(_outputs_after_load, 1, argv, inputs)[0]
    assert ours["iteration"] == ARCH["train_steps"]
    _assert_same(ours, theirs)


@pytest.mark.parametrize("arch", [ARCH, MLA_ARCH, GROUPED_ARCH],
                         ids=["attention", "mla", "single-grouped-weight"])
def test_a_dsv3_checkpoint_trained_here_loads_in_megatron_core(mcore_python, tmp_path, arch):
    """Also the file's keys: every tensor key and global shape, and every byte entry, are
    those of Megatron-Core's own ``sharded_state_dict`` of the model. With MLA, Megatron-Core
    runs its local spec (core attention stood in for, as above) under the norm names of its
    TransformerEngine spec, which this project writes (``TE_MLA_NORM_NAMES`` in the harness):
    the local spec alone names ``q_layernorm``, ``kv_layernorm`` and ``pre_mlp_layernorm``
    as modules and so cannot read a file of the TransformerEngine spec."""
    from megatron.checkpoint.dist import DistCheckpointReader

    inputs = _inputs(tmp_path / "inputs.pt")
    saved = tmp_path / "saved_here"
    steps = str(arch["train_steps"])
    run_on_ranks(run_pretrain, 1, our_argv(arch) + [
        "--train-iters", steps, "--save", str(saved), "--save-interval", steps,
        "--mock-data", "--eval-iters", "0", "--num-workers", "0", "--lr", "1e-2",
        "--no-save-optim"])
    ours = run_on_ranks(_outputs_after_load, 1, our_argv(arch) + ["--load", str(saved)],
                        inputs)[0]
    cwd = tmp_path / "mcore"
    cwd.mkdir()
    iter_dir = saved / f"iter_{arch['train_steps']:07d}"
    theirs = _megatron_core(mcore_python, "load", inputs, iter_dir, cwd / "mcore.pt", arch)
    _assert_same(ours, theirs)
    reader = DistCheckpointReader(str(iter_dir))
    sharded = dict(theirs["sharded"])
    objects = set(sharded.pop("objects"))
    assert {k: tuple(reader.shape(k)) for k in reader.tensor_keys()} == sharded
    run_state = {"common_state/shard_0_1", "rerun_state_machine_state/shard_0_1",
                 "rng_state/shard_0.0_1.1"}
    assert set(reader.byte_keys()) == objects | run_state
