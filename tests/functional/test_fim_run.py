"""pretrain_gpt.py with --fim-data end to end: a TikTokenizer naming the FIM special tokens
trains on permuted samples; --fim-rate 0 trains bit for bit as the run without --fim-data; a
tokenizer without the tokens stops the run with one line naming the flag."""

import math
import os
import subprocess
import sys

import pytest

from megatron.tokenizer.tiktoken_tokenizer import TikTokenizer
from tests.functional.gpt_runs import run_pretrain
from tests.multiprocess import run_on_ranks
from tests.unit.test_fim_dataset import SPECIALS, TEXTS
from tests.unit.test_gpt_dataset import write_dataset
from tests.unit.test_tokenizer import gpt2_ranks, tiktoken_vocab  # noqa: F401  (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_SPECIAL = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiktoken_vocab):  # noqa: F811
    path, tokens = tiktoken_vocab
    vocab_size = NUM_SPECIAL + len(tokens)
    tok = TikTokenizer(path, "v2", vocab_size=vocab_size, num_special_tokens=NUM_SPECIAL,
                       special_tokens=SPECIALS)
    prefix = str(tmp_path_factory.mktemp("fim_run") / "code")
    write_dataset(prefix, [tok.tokenize(t) + [tok.eod] for t in TEXTS * 20])
    return path, vocab_size, prefix


def flags(setup, extra=(), specials=SPECIALS):
    path, vocab_size, prefix = setup
    return f"""
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --lr 5e-3
    --train-iters 4 --log-interval 1 --eval-interval 1000 --eval-iters 1 --split 90,8,2
    --num-workers 0 --device cpu --seed 1234 --hidden-dropout 0.0 --attention-dropout 0.0
    --tokenizer-type TikTokenizer --tokenizer-model {path} --tiktoken-pattern v2
    --vocab-size {vocab_size} --tiktoken-num-special-tokens {NUM_SPECIAL}
    """.split() + ["--tokenizer-special-tokens", *specials, "--data-path", prefix, *extra]


def _losses(out):
    return [loss for _, loss in out["losses"]]


FIM = ["--fim-data", "--fim-eod-token", "</s>", "--fim-split-sample", "<file_sep>",
       "--fim-fragment-rate", "0.5"]


@pytest.mark.slow
def test_fim_trains_and_rate_zero_is_the_plain_run(setup):
    plain = _losses(run_on_ranks(run_pretrain, 1, flags(setup))[0])
    zero = _losses(run_on_ranks(run_pretrain, 1, flags(setup, FIM + ["--fim-rate", "0"]))[0])
    fim = _losses(run_on_ranks(run_pretrain, 1, flags(setup, FIM + ["--fim-rate", "1"]))[0])
    assert zero == plain
    assert len(fim) == 4 and all(math.isfinite(x) for x in fim)
    assert fim != plain                       # the permuted samples are what it trained on


@pytest.mark.slow
def test_a_tokenizer_without_fim_tokens_stops_the_run_in_one_line(setup, tmp_path):
    argv = flags(setup, ["--fim-data", "--fim-eod-token", "</s>"],
                 specials=["<unk>", "<s>", "</s>"])
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--fim-prefix-token '<fim_prefix>' is not a token of the TikToken tokenizer" \
        in errors[0]
