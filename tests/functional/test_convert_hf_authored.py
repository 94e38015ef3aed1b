"""Folders that transformers itself wrote (a tiny random model of each family the converter
knows from today's models, saved with ``save_pretrained``, as a user's download would be),
through ``tools/checkpoint/convert.py`` into a Megatron checkpoint, then run the way a Megatron
user runs one: ``--use-checkpoint-args`` and the tokenizer flags only, nothing about the model's
shape (one process from the torch format; for three families also TP 2 with sequence
parallelism from torch_dist). The logits equal transformers' (float32, 1e-4 as the issue asks),
and converted back the folder's tensors come back bit for bit.

This is the user's path end to end: the arguments the converter records must describe the whole
model (sizes, rotary scaling, experts and their routing, the shared expert's gate), and
``--use-checkpoint-args`` must take them without dropping the run's own tokenizer flags.
"""

import glob
import json
import os

import pytest
import torch

from tests.functional.test_megatron_written import _logits_after_load
from tests.multiprocess import run_on_ranks
from tools.checkpoint.convert import main as convert

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16


def _llama31():
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192))


def _qwen3_moe():
    # transformers 5 writes the expert count as num_local_experts, not num_experts.
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        max_position_embeddings=64, tie_word_embeddings=False)


def _qwen2_moe():
    # A shared expert with its sigmoid gate (--moe-shared-expert-gate), softmax before top-k.
    return transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, norm_topk_prob=False,
        max_position_embeddings=64, tie_word_embeddings=True)


def _qwen3_yarn():
    return transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=4.0,
                             original_max_position_embeddings=8, beta_fast=32.0,
                             beta_slow=1.0))


def _mistral():
    return transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
        max_position_embeddings=64, tie_word_embeddings=False)


def _mixtral():
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)


def _deepseek_v3():
    # A dense first layer, grouped sigmoid routing, shared experts, q low-rank projection.
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
        q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)


def _gpt_oss():
    # Sinks, alternating sliding / full layers, clamped GLU experts with biases, YaRN.
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
        tie_word_embeddings=False)


CASES = {
    "llama31": (_llama31, transformers.LlamaForCausalLM),
    "qwen3_moe": (_qwen3_moe, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (_qwen2_moe, transformers.Qwen2MoeForCausalLM),
    "qwen3_yarn": (_qwen3_yarn, transformers.Qwen3ForCausalLM),
    "mistral": (_mistral, transformers.MistralForCausalLM),
    "mixtral": (_mixtral, transformers.MixtralForCausalLM),
    "deepseek_v3": (_deepseek_v3, transformers.DeepseekV3ForCausalLM),
    "gpt_oss": (_gpt_oss, transformers.GptOssForCausalLM),
}


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("case", CASES)
def test_transformers_folder_runs_with_use_checkpoint_args(tmp_path, case):
    _convert_run_and_back(tmp_path, case)


@pytest.mark.parametrize("case", ["deepseek_v3", "gpt_oss", "qwen3_yarn"])
def test_the_same_at_tp2_with_sequence_parallel_from_torch_dist(tmp_path, case):
    _convert_run_and_back(tmp_path, case, tp=2)


def _convert_run_and_back(tmp_path, case, tp=1, saver=("--saver", "megatron")):
    """Convert (at ``tp``: torch_dist, run with sequence parallelism; ``saver``: the saver's
    flags), run, convert back."""
    make_config, architecture = CASES[case]
    torch.manual_seed(3)
    model = architecture(make_config()).eval()
    with torch.no_grad():   # away from the initialisation's ones and zeros
        for name, param in model.named_parameters():
            param.copy_(torch.rand_like(param) + 0.5 if "norm" in name
                        else torch.randn_like(param) * 0.2)
        for name, buffer in model.named_buffers():   # DeepSeek-V3's expert-score biases
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.2)
    folder, ckpt = str(tmp_path / "hf"), str(tmp_path / "megatron")
    model.save_pretrained(folder)
    layout = [] if tp == 1 else ["--target-tensor-parallel-size", str(tp),
                                 "--target-ckpt-format", "torch_dist"]
    assert convert(["--model-type", "GPT", "--loader", "hf", *saver,
                    "--load-dir", folder, "--save-dir", ckpt] + layout) == 0

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(tokens).logits
    torch.save({"tokens": tokens, "position_ids": torch.arange(SEQ).expand(2, SEQ)},
               os.path.join(ckpt, "reference.pt"))
    argv = ["--use-checkpoint-args", "--load", ckpt, "--device", "cpu",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--micro-batch-size", "1", "--seq-length", str(SEQ)]
    if tp > 1:
        argv += ["--tensor-model-parallel-size", str(tp), "--sequence-parallel",
                 "--ckpt-format", "torch_dist"]
    logits, _, _ = run_on_ranks(_logits_after_load, tp, argv)[0]
    torch.testing.assert_close(logits[..., :VOCAB].float(), want, atol=1e-4, rtol=0)

    back = str(tmp_path / "hf_again")
    assert convert(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                    "--load-dir", ckpt, "--save-dir", back, "--allow-no-tokenizer",
                    "--true-vocab-size", str(VOCAB)]) == 0
    first, again = _tensors(folder), _tensors(back)
    assert first.keys() == again.keys()
    for name, tensor in first.items():
        assert torch.equal(again[name], tensor), name


@pytest.mark.parametrize("case, impl", [("mixtral", "transformer_engine"), ("qwen2_moe", "local"),
                                        ("deepseek_v3", "transformer_engine"),
                                        ("gpt_oss", "local")])
def test_the_same_through_megatron_core_keys(tmp_path, case, impl):
    """``--saver core``: Megatron-Core's state dict in --ckpt-format torch files (experts, the
    shared expert's gate, MLA, sinks and biases under its keys), read back by --load."""
    _convert_run_and_back(tmp_path, case, saver=("--saver", "core", "--saver-transformer-impl",
                                                 impl))
    state = torch.load(glob.glob(str(tmp_path / "megatron" / "*" / "mp_rank_00" /
                                     "model_optim_rng.pt"))[0], weights_only=False)
    assert any(k.startswith("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.")
               for k in state["model"])
    assert not any(k.startswith("language_model") for k in state["model"])


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_router_aux_loss_coef_is_the_checkpoints_aux_loss_coeff_and_comes_back(tmp_path, case):
    """transformers' ``router_aux_loss_coef`` (a value none of its defaults has) is recorded as
    ``--moe-aux-loss-coeff`` of ``--moe-router-load-balancing-type aux_loss``, which
    ``--use-checkpoint-args`` takes, and converted back (from Megatron, or straight from the
    folder) config.json says the same. DeepSeek-V3 balances without an auxiliary loss: its
    config has no such key, and nothing is recorded."""
    from megatron.checkpoint.load import load_args_from_checkpoint
    from megatron.checkpoint.safe_unpickle import torch_load
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args

    make_config, architecture = CASES[case]
    config, coeff = make_config(), 0.037
    if case == "deepseek_v3":
        assert not hasattr(config, "router_aux_loss_coef")
    else:
        config.router_aux_loss_coef = coeff
    folder, ckpt = str(tmp_path / "hf"), str(tmp_path / "megatron")
    architecture(config).save_pretrained(folder)
    assert convert(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron",
                    "--load-dir", folder, "--save-dir", ckpt]) == 0

    iteration, release = checkpointing.read_tracker(ckpt)
    saved = torch_load(checkpointing.checkpoint_file(ckpt, iteration, 0, 0, 1, release))["args"]
    run = load_args_from_checkpoint(parse_args(argv=["--load", ckpt, "--use-checkpoint-args",
                                                     "--moe-aux-loss-coeff", "0.5"]))
    if case == "deepseek_v3":
        assert not hasattr(saved, "moe_aux_loss_coeff")
        assert run.moe_aux_loss_coeff == [0.5]             # the run's own flag stays
    else:
        assert (saved.moe_router_load_balancing_type, saved.moe_aux_loss_coeff) == (
            "aux_loss", coeff)
        assert (run.moe_router_load_balancing_type, run.moe_aux_loss_coeff) == ("aux_loss", coeff)

    for loader, source in (("megatron", ckpt), ("hf", folder)):
        back = str(tmp_path / f"hf_from_{loader}")
        extra = ["--true-vocab-size", str(VOCAB)] if loader == "megatron" else []
        assert convert(["--model-type", "GPT", "--loader", loader, "--saver", "hf",
                        "--load-dir", source, "--save-dir", back,
                        "--allow-no-tokenizer"] + extra) == 0
        with open(os.path.join(back, "config.json")) as f:
            written = json.load(f)
        assert written.get("router_aux_loss_coef") == (None if case == "deepseek_v3"
                                                       else coeff), loader
