"""Folders that transformers itself wrote (a tiny random model saved with ``save_pretrained``, as
a user's download would be), through ``tools/checkpoint/convert.py`` into a Megatron checkpoint,
then run the way a Megatron user runs one: ``--use-checkpoint-args`` and the tokenizer flags
only, nothing about the model's shape. The logits equal transformers' (float32, 1e-4 as the
issue asks), and converted back the folder's tensors come back bit for bit.

This is the user's path end to end: the arguments the converter records must describe the whole
model (sizes, rotary scaling, experts and their routing, the shared expert's gate), and
``--use-checkpoint-args`` must take them without dropping the run's own tokenizer flags.
"""

import glob
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


CASES = {
    "llama31": (_llama31, transformers.LlamaForCausalLM),
    "qwen3_moe": (_qwen3_moe, transformers.Qwen3MoeForCausalLM),
    "qwen2_moe": (_qwen2_moe, transformers.Qwen2MoeForCausalLM),
}


def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.parametrize("case", CASES)
def test_transformers_folder_runs_with_use_checkpoint_args(tmp_path, case):
    make_config, architecture = CASES[case]
    torch.manual_seed(3)
    model = architecture(make_config()).eval()
    with torch.no_grad():   # away from the initialisation's ones and zeros
        for name, param in model.named_parameters():
            param.copy_(torch.rand_like(param) + 0.5 if "norm" in name
                        else torch.randn_like(param) * 0.2)
    folder, ckpt = str(tmp_path / "hf"), str(tmp_path / "megatron")
    model.save_pretrained(folder)
    assert convert(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron",
                    "--load-dir", folder, "--save-dir", ckpt]) == 0

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(tokens).logits
    torch.save({"tokens": tokens, "position_ids": torch.arange(SEQ).expand(2, SEQ)},
               os.path.join(ckpt, "reference.pt"))
    argv = ["--use-checkpoint-args", "--load", ckpt, "--device", "cpu",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--micro-batch-size", "1", "--seq-length", str(SEQ)]
    logits, _, _ = run_on_ranks(_logits_after_load, 1, argv)[0]
    torch.testing.assert_close(logits[..., :VOCAB].float(), want, atol=1e-4, rtol=0)

    back = str(tmp_path / "hf_again")
    assert convert(["--model-type", "GPT", "--loader", "megatron", "--saver", "hf",
                    "--load-dir", ckpt, "--save-dir", back, "--allow-no-tokenizer",
                    "--true-vocab-size", str(VOCAB)]) == 0
    first, again = _tensors(folder), _tensors(back)
    assert first.keys() == again.keys()
    for name, tensor in first.items():
        assert torch.equal(again[name], tensor), name
