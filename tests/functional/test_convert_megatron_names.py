"""``tools/checkpoint/convert.py`` under Megatron-LM's own plugin names and loader flags: the
commands of Megatron's conversion scripts and documentation run as they are.

References: transformers' forward of the folder converted (float32), and Megatron's recorded
logits of its ``legacy_tp1`` fixture. ``tests/interop/test_megatron_core.py`` loads a
``--saver core`` output into Megatron-Core itself.
"""

import json
import os

import pytest
import torch

from megatron.convert.schema import ConversionError
from tests.functional.test_mcore_torch_format import _write
from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load, fixture_dir,
                                                    megatron_argv, reference)
from tests.multiprocess import run_on_ranks
from tools.checkpoint import convert as tool

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16


def convert(*argv) -> str:
    return tool.convert(tool.build_parser().parse_args(["--model-type", "GPT", *argv]))


def _rank_file(folder, rank=0):
    return os.path.join(folder, sorted(d for d in os.listdir(folder) if d.startswith(
        ("iter_", "release")))[0], f"mp_rank_{rank:02d}", "model_optim_rng.pt")


def _llama_folder(tmp_path) -> str:
    """A transformers Llama-3.1 folder with a tokenizer of its own, as a download is."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=8192))
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.rand_like(param) + 0.5 if "norm" in name
                        else torch.randn_like(param) * 0.2)
    folder = str(tmp_path / "hf")
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["<|end_of_text|>"] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|end_of_text|>").save_pretrained(folder)
    return folder, model


def test_megatrons_llama_command_converts_and_runs(tmp_path):
    """Megatron's documented Llama-3 conversion (``--loader llama_mistral --saver core``) on a
    transformers folder at TP 2: Megatron-Core's keys, the tokenizer recorded, and the model
    run from the files with --use-checkpoint-args gives transformers' logits."""
    folder, model = _llama_folder(tmp_path)
    out = str(tmp_path / "mcore")
    summary = convert("--loader", "llama_mistral", "--saver", "core", "--checkpoint-type", "hf",
                      "--model-size", "llama3", "--load-dir", folder, "--save-dir", out,
                      "--tokenizer-model", folder, "--target-tensor-parallel-size", "2",
                      "--loader-transformer-impl", "transformer_engine")
    assert "(torch, Megatron-Core transformer_engine keys)" in summary
    state = torch.load(_rank_file(out, 1), weights_only=False)
    model_keys = set(state["model"])
    assert {"decoder.layers.1.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.1.mlp.linear_fc1.layer_norm_weight", "output_layer.weight",
            "decoder.layers.1.self_attention.core_attention._extra_state"} <= model_keys
    assert not any(k.startswith("language_model") for k in model_keys)
    assert state["args"].tokenizer_type == "HuggingFaceTokenizer"
    assert state["args"].tokenizer_model == os.path.join(folder, "tokenizer.json")
    assert state["args"].transformer_impl == "transformer_engine"

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(tokens).logits
    torch.save({"tokens": tokens, "position_ids": torch.arange(SEQ).expand(2, SEQ)},
               os.path.join(out, "reference.pt"))
    argv = ["--use-checkpoint-args", "--load", out, "--device", "cpu", "--micro-batch-size",
            "1", "--tensor-model-parallel-size", "2"]
    for logits, _, fields in run_on_ranks(_logits_after_load, 2, argv):
        assert fields["ids"] == (VOCAB, VOCAB - 1)       # the recorded tokenizer was built
        torch.testing.assert_close(logits[..., :VOCAB].float(), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("impl", ["transformer_engine", "local"])
def test_the_core_saver_round_trips_megatrons_model(tmp_path, impl):
    out = str(tmp_path / "core")
    convert("--loader", "legacy", "--saver", "core", "--saver-transformer-impl", impl,
            "--load-dir", fixture_dir("legacy_tp1"), "--save-dir", out)
    state = torch.load(_rank_file(out), weights_only=False)
    norm = ("decoder.layers.0.input_layernorm.weight" if impl == "local"
            else "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")
    assert norm in state["model"] and "output_layer._extra_state" in state["model"]
    extra = state["model"]["decoder.layers.0.mlp.linear_fc2._extra_state"]
    assert extra is None if impl == "local" else extra.dtype == torch.uint8
    torch.save(reference("legacy_tp1"), os.path.join(out, "reference.pt"))
    argv = megatron_argv("legacy_tp1") + ["--load", out, "--device", "cpu"]
    logits, iteration, _ = run_on_ranks(_logits_after_load, 1, argv)[0]
    assert iteration == 10
    torch.testing.assert_close(logits.float(), reference("legacy_tp1")["logits"],
                               atol=LOGITS_ATOL, rtol=0)


def test_the_core_loader_reads_a_megatron_core_torch_save(tmp_path):
    """A Megatron-Core model's --ckpt-format torch files (TP 2, local layers, an Adam state)
    to the legacy keys at TP 1: Megatron's logits; the Adam state is dropped, saying why."""
    source = _write(tmp_path / "source", 2, "local",
                    {"optimizer": {"state": {}, "param_groups": []}})
    out = str(tmp_path / "legacy")
    summary = convert("--loader", "core", "--saver", "legacy", "--load-dir", source,
                      "--save-dir", out, "--target-tensor-parallel-size", "1")
    assert "in Megatron-Core's module order, which is not mapped" in summary
    torch.save(reference("legacy_tp1"), os.path.join(out, "reference.pt"))
    argv = megatron_argv("legacy_tp1") + ["--load", out, "--device", "cpu"]
    logits, _, _ = run_on_ranks(_logits_after_load, 1, argv)[0]
    torch.testing.assert_close(logits.float(), reference("legacy_tp1")["logits"],
                               atol=LOGITS_ATOL, rtol=0)


def test_vocab_file_gives_the_true_vocabulary(tmp_path):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({f"t{i}": i for i in range(150)}))
    summary = convert("--loader", "mcore", "--saver", "mcore", "--load-dir",
                      fixture_dir("legacy_tp1"), "--save-dir", str(tmp_path / "out"),
                      "--vocab-file", str(vocab))
    assert "vocabulary 150," in summary
    text = tmp_path / "vocab.txt"
    text.write_text("".join(f"t{i}\n" for i in range(120)))
    summary = convert("--load-dir", fixture_dir("legacy_tp1"), "--save-dir",
                      str(tmp_path / "out2"), "--vocab-file", str(text))
    assert "vocabulary 120," in summary


REFUSED = [
    (["--loader", "llama_mistral", "--checkpoint-type", "meta"], "Meta's original"),
    (["--loader", "llama_mistral", "--model-size", "mistral"],
     "--model-size mistral is a mistral model, but"),
    (["--loader", "hf", "--vocab-file", "v.json"], "--vocab-file applies to --loader megatron"),
    (["--loader", "core", "--bf16"], "--bf16 applies to a Hugging Face folder"),
    (["--loader", "hf", "--bf16", "--target-params-dtype", "fp32"],
     "--bf16 and --target-params-dtype fp32 disagree"),
    (["--loader", "hf", "--saver", "legacy", "--saver-transformer-impl", "local"],
     "--saver-transformer-impl applies only to --saver core"),
    (["--loader", "hf", "--tokenizer-model", "missing.model"], "no such file or folder"),
    (["--loader", "llama3"], "invalid choice: 'llama3'"),
]


@pytest.mark.parametrize("flags, message", REFUSED)
def test_megatron_flags_that_cannot_apply_are_refused_by_name(tmp_path, flags, message):
    folder, _ = _llama_folder(tmp_path)
    with pytest.raises(ConversionError) as err:
        convert(*flags, "--load-dir", folder, "--save-dir", str(tmp_path / "out"))
    assert message in str(err.value)
    assert not os.path.exists(tmp_path / "out")
