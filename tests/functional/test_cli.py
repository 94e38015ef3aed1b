"""``python pretrain_gpt.py`` as users run it: alone, under torchrun, and with mistaken flags.

Every case is a real subprocess from the repository root with this interpreter. A user's mistake
must end with a non-zero exit and one line on stderr naming the flag or file, never a traceback.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERATION = re.compile(r" iteration +(\d+)/ +3 \| .*\| lm loss: ([-+.\dE]+) \|")
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _env():
    """This environment without any torchrun variables (the test may itself run under one)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd):
    return subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _flags(corpus, *extra):
    return gpt_flags(corpus, 3, dropout=0.0, extra=list(extra))


def _losses(stdout):
    found = [ITERATION.search(line) for line in stdout.splitlines()]
    return [(int(m[1]), float(m[2])) for m in found if m]


@pytest.fixture(scope="module")
def single_rank(corpus):
    return _run([sys.executable, "pretrain_gpt.py"] + _flags(corpus))


def test_single_rank_without_torchrun(single_rank):
    proc = single_rank
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "world size 1 = tensor-model-parallel 1 x pipeline-model-parallel 1 x " \
           "data-parallel 1" in proc.stdout
    assert [i for i, _ in _losses(proc.stdout)] == [1, 2, 3]
    assert "validation loss at the end of training for val data" in proc.stdout


def test_torchrun_two_ranks_tensor_parallel(corpus, single_rank):
    """torchrun --standalone --nproc_per_node 2 with TP=2 trains the same model: its losses equal
    the single-rank run's (dropout off) to fp32 reduction-order noise."""
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", "2", "pretrain_gpt.py"]
                + _flags(corpus, "--tensor-model-parallel-size", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "world size 2 = tensor-model-parallel 2 x pipeline-model-parallel 1 x " \
           "data-parallel 1" in proc.stdout
    tp2, tp1 = _losses(proc.stdout), _losses(single_rank.stdout)
    assert [i for i, _ in tp2] == [1, 2, 3]  # printed once, by the last rank
    for (_, a), (_, b) in zip(tp1, tp2):
        assert abs(a - b) < 1e-4 * abs(a), (tp1, tp2)


def _error_cases(corpus, tmp_path):
    missing_prefix = str(tmp_path / "no_such" / "corpus_text_document")
    vocab = str(tmp_path / "missing_vocab.json")
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n")
    gpt2 = [f if f != "NullTokenizer" else "GPT2BPETokenizer" for f in _flags(corpus)]
    heads3 = list(_flags(corpus))
    heads3[heads3.index("--num-attention-heads") + 1] = "3"
    data_at = _flags(corpus).index("--data-path") + 1
    no_data = _flags(corpus)
    no_data[data_at] = missing_prefix
    no_tokenizer = list(_flags(corpus))
    at = no_tokenizer.index("--tokenizer-type")
    del no_tokenizer[at:at + 2]
    return {
        "missing data prefix": (no_data, ["--data-path", missing_prefix]),
        "missing vocab file": (gpt2 + ["--vocab-file", vocab, "--merge-file", str(merges)],
                               ["--vocab-file", vocab]),
        "unknown flag": (_flags(corpus, "--bogus-flag", "3"),
                         ["unrecognized arguments: --bogus-flag 3"]),
        "impossible size": (heads3, ["--hidden-size (32)", "--num-attention-heads (3)"]),
        "no vocab file flag": (gpt2, ["--vocab-file is required", "GPT2BPETokenizer"]),
        "no tokenizer type": (no_tokenizer, ["no --tokenizer-type given", "NullTokenizer"]),
    }


@pytest.mark.parametrize("case", ["missing data prefix", "missing vocab file", "unknown flag",
                                  "impossible size", "no vocab file flag", "no tokenizer type"])
def test_user_mistake_is_one_line_without_traceback(corpus, tmp_path, case):
    flags, must_name = _error_cases(corpus, tmp_path)[case]
    proc = _run([sys.executable, "pretrain_gpt.py"] + flags)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("pretrain_gpt.py: error: "), lines
    for text in must_name:
        assert text in lines[0], (text, lines[0])
