"""--yaml-cfg trains exactly as its command line: a tiny GPT run from a YAML file in Megatron's
layout gives bit-identical losses to the same run from flags."""

import os

from tests.functional.gpt_runs import VOCAB_SIZE, gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 3

# The configuration of gpt_flags(..., dropout=0.0), with the data path read from $YAML_DATA.
CONFIG = f"""
language_model:
  num_layers: 2
  hidden_size: 32
  num_attention_heads: 4
  hidden_dropout: 0.0
  attention_dropout: 0.0
model_parallel:
  tensor_model_parallel_size: 1
seq_length: 16
max_position_embeddings: 16
micro_batch_size: 2
global_batch_size: 4
lr: 5.0e-3
min_lr: 1.0e-4
lr_decay_style: cosine
lr_warmup_iters: 1
train_iters: {ITERS}
weight_decay: 0.1
clip_grad: 1.0
log_interval: 1
eval_interval: 1000
eval_iters: 2
tokenizer_type: NullTokenizer
vocab_size: {VOCAB_SIZE}
split: 90,8,2
num_workers: 0
device: cpu
seed: 1234
data_path: ${{YAML_DATA}}
"""


def _both(corpus, config):
    from megatron.core import parallel_state

    os.environ["YAML_DATA"] = corpus
    flags = run_pretrain(gpt_flags(corpus, ITERS, dropout=0.0))
    parallel_state.destroy_model_parallel()
    from_yaml = run_pretrain(["--yaml-cfg", config])
    return flags["losses"], from_yaml["losses"]


def test_yaml_run_gives_the_command_lines_losses(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "corpus" / "count_document"))
    config = tmp_path / "gpt.yaml"
    config.write_text(CONFIG)
    flags, from_yaml = run_on_ranks(_both, 1, corpus, str(config), timeout=240)[0]
    assert len(flags) == ITERS
    assert from_yaml == flags  # bit for bit
