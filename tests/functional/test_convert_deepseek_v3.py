"""A DeepSeek-V3 folder converted to a TP=2 Megatron checkpoint and loaded by the inference
tools' own path (flags as a DeepSeek-V3 run gives them, rope read as YaRN at factor 1 as the
training does for MLA) gives transformers' logits."""

import os

import pytest
import torch

from tests.functional.test_megatron_written import _logits_after_load
from tests.multiprocess import run_on_ranks
from tests.unit.test_convert_hf_deepseek_v3 import SEQ, VOCAB, hf_folder
from tools.checkpoint.convert import main

pytest.importorskip("transformers")

FLAGS = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
         "--ffn-hidden-size", "48", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
         "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--position-embedding-type", "rope", "--multi-latent-attention", "--qk-layernorm",
         "--q-lora-rank", "12", "--kv-lora-rank", "16", "--qk-head-dim", "8",
         "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--num-experts", "8",
         "--moe-router-topk", "4", "--moe-ffn-hidden-size", "16", "--moe-layer-freq",
         "[0,1,1]", "--moe-router-score-function", "sigmoid",
         "--moe-router-enable-expert-bias", "--moe-router-num-groups", "4",
         "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
         "--moe-shared-expert-intermediate-size", "32", "--tokenizer-type", "NullTokenizer",
         "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--sequence-parallel", "--device", "cpu"]


@pytest.mark.slow
def test_deepseek_v3_folder_through_tp2_gives_transformers_logits_in_the_inference_tools(
        tmp_path):
    folder, theirs = hf_folder(tmp_path)
    out = str(tmp_path / "megatron")
    assert main(["--model-type", "GPT", "--loader", "hf", "--load-dir", folder, "--save-dir",
                 out, "--target-tensor-parallel-size", "2"]) == 0
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(tokens).logits
    torch.save({"tokens": tokens, "position_ids": torch.arange(SEQ).expand(2, SEQ)},
               os.path.join(out, "reference.pt"))
    argv = FLAGS + ["--load", out, "--tensor-model-parallel-size", "2", "--seq-length",
                    str(SEQ), "--max-position-embeddings", "64", "--vocab-size", str(VOCAB - 1)]
    logits, _, _ = run_on_ranks(_logits_after_load, 2, argv)[0]
    torch.testing.assert_close(logits[..., :VOCAB].float(), want, atol=1e-5, rtol=1e-5)
