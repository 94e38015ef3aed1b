"""Qwen3 and Qwen2 folders with rescaled rotaries through ``tools/checkpoint/convert.py``, and
training runs with those flags under several layouts.

- A Qwen3 folder with YaRN (and a Qwen2 one with Llama 3.1 scaling), converted to a Megatron
  checkpoint at TP 2 (whose saved args must hold --qk-layernorm and the rotary flags) and
  loaded by ``pretrain_gpt``'s model from the flags, gives transformers' logits (float32, 1e-5 as in tests/unit/test_convert_hf); converted back to a folder, every
  tensor and the rotary parameters come back unchanged.
- Training with YaRN + --qk-layernorm + --add-qkv-bias, and with --use-rope-scaling, gives
  the single-process losses under TP 2 (sequence parallel) and CP 2 (tolerance as in
  tests/functional/test_parity).
"""

import json
import os

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.functional.test_megatron_written import _logits_after_load
from tests.multiprocess import run_on_ranks
from tools.checkpoint.convert import main

transformers = pytest.importorskip("transformers")


def _convert(src, dst, *flags):
    assert main(["--model-type", "GPT", "--load-dir", src, "--save-dir", dst] + list(flags)) == 0
    return dst


MODEL_FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--group-query-attention", "--num-query-groups", "2", "--normalization",
               "RMSNorm", "--swiglu", "--disable-bias-linear", "--ffn-hidden-size", "48",
               "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "2",
               "--hidden-dropout", "0", "--attention-dropout", "0", "--device", "cpu"]
CASES = {
    "qwen3_yarn": ("YARN", dict(qk_layernorm=True), "Qwen3ForCausalLM",
                   ["--qk-layernorm", "--position-embedding-type", "yarn", "--rotary-base",
                    "10000", "--rotary-scaling-factor", "4",
                    "--yarn-original-max-position-embeddings", "64", "--yarn-beta-fast", "4",
                    "--yarn-beta-slow", "0.25", "--no-yarn-correction-range-round-to-int"]),
    "qwen2_llama3": ("LLAMA3", dict(add_qkv_bias=True), "Qwen2ForCausalLM",
                     ["--add-qkv-bias", "--position-embedding-type", "rope", "--rotary-base",
                      "500000", "--use-rope-scaling", "--rope-scaling-factor", "8"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_folder_to_megatron_tp2_gives_transformers_logits_and_back(tmp_path, case):
    from safetensors.torch import load_file

    from megatron.convert.megatron_io import load_megatron
    from tests.unit import test_convert_hf_rope as rope
    from tests.unit.test_convert_hf import SEQ, VOCAB, build_model, export

    preset, extra, architecture, flags = CASES[case]
    cfg, model = build_model(seed=31, **dict(getattr(rope, preset), **extra))
    meta = rope._meta(cfg)
    folder = export(tmp_path, model, meta)
    out = _convert(folder, str(tmp_path / "megatron"), "--loader", "hf",
                   "--target-tensor-parallel-size", "2")
    saved = next(load_megatron(out, true_vocab_size=VOCAB)).meta
    assert (saved.qk_layernorm, saved.add_qkv_bias) == (meta.qk_layernorm, meta.add_qkv_bias)
    assert saved.position_embedding_type == meta.position_embedding_type
    assert saved.rope_scaling_fields == meta.rope_scaling_fields
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    hf = getattr(transformers, architecture).from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        want = hf.eval()(tokens).logits
    torch.save({"tokens": tokens, "position_ids": torch.arange(SEQ).expand(2, SEQ)},
               os.path.join(out, "reference.pt"))
    argv = MODEL_FLAGS + flags + ["--load", out, "--tensor-model-parallel-size", "2",
                                  "--seq-length", str(SEQ),
                                  "--max-position-embeddings", str(SEQ),
                                  "--vocab-size", str(VOCAB - 1)]
    logits, _, _ = run_on_ranks(_logits_after_load, 2, argv)[0]
    torch.testing.assert_close(logits[..., :VOCAB].float(), want, atol=1e-5, rtol=0)

    back = _convert(out, str(tmp_path / "hf_again"), "--saver", "hf", "--true-vocab-size",
                    str(VOCAB), "--allow-no-tokenizer")
    configs = [json.load(open(os.path.join(f, "config.json"))) for f in (folder, back)]
    assert configs[0]["rope_parameters"] == configs[1]["rope_parameters"]
    assert configs[0]["model_type"] == configs[1]["model_type"]
    first, again = (load_file(os.path.join(f, "model.safetensors")) for f in (folder, back))
    assert first.keys() == again.keys()
    for name, tensor in first.items():
        assert torch.equal(again[name], tensor), name


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


YARN_FLAGS = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
              "--yarn-original-max-position-embeddings", "8", "--yarn-beta-fast", "4",
              "--yarn-beta-slow", "0.5", "--mscale", "0.8", "--mscale-all-dim", "0.3",
              "--qk-layernorm", "--normalization", "RMSNorm", "--swiglu",
              "--disable-bias-linear", "--add-qkv-bias"]
LLAMA3_FLAGS = ["--position-embedding-type", "rope", "--use-rope-scaling",
                "--rope-scaling-factor", "4", "--rotary-base", "500000",
                "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear"]


def _losses(corpus, flags, tp=1, cp=1):
    extra = list(flags) + ["--context-parallel-size", str(cp)]
    if tp > 1:
        extra.append("--sequence-parallel")
    argv = gpt_flags(corpus, 6, tp=tp, micro_batch=2, global_batch=4, dropout=0.0, extra=extra)
    return [loss for _, loss in run_on_ranks(run_pretrain, tp * cp, argv)[-1]["losses"]]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [YARN_FLAGS, LLAMA3_FLAGS], ids=["yarn_qk", "llama3"])
def test_rescaled_rotary_training_matches_under_tp_and_cp(corpus, flags):
    single = _losses(corpus, flags)
    assert single[-1] < single[0]
    for layout in (dict(tp=2), dict(cp=2)):
        got = _losses(corpus, flags, **layout)
        assert got == pytest.approx(single, rel=1e-5), layout
