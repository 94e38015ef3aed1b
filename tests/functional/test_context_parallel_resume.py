"""Checkpoints do not depend on the context-parallel size: a CP = 2 run resumes at CP = 1 and the
reverse, continuing the losses of a run that never stopped.

The losses after the resume match within the parity tolerance of
``test_context_parallel_parity`` (the two sizes round differently), not bit for bit.
"""

import os

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3
ATOL = 2e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, cp, extra=()):
    flags = gpt_flags(corpus, 2 * N, micro_batch=2, global_batch=8, dropout=0.0,
                      extra=["--context-parallel-size", str(cp), *extra])
    return run_on_ranks(run_pretrain, cp, flags)[-1]


def _losses(result):
    return [loss for _, loss in result["losses"]]


@pytest.fixture(scope="module")
def straight(corpus):
    return _losses(_run(corpus, 1))


def _resume(corpus, tmp_path, straight, save_cp, load_cp, fmt):
    save = str(tmp_path / f"ckpt-{save_cp}-{load_cp}-{fmt}")
    fmt_flags = ["--ckpt-format", fmt]
    first = _run(corpus, save_cp, ["--save", save, "--exit-interval", str(N), *fmt_flags])
    assert first["iteration"] == N
    if fmt == "torch":  # one file per (tp, pp) rank: cp rank 1 writes nothing
        assert os.listdir(os.path.join(save, f"iter_{N:07d}")) == ["mp_rank_00"]
    second = _run(corpus, load_cp, ["--load", save, *fmt_flags])
    assert [i for i, _ in second["losses"]] == list(range(N + 1, 2 * N + 1))
    for a, b in zip(straight, _losses(first) + _losses(second)):
        assert abs(a - b) <= ATOL, (straight, _losses(first), _losses(second))


@pytest.mark.parametrize("save_cp,load_cp", [(2, 1), (1, 2)])
def test_resume_across_context_parallel_sizes(corpus, tmp_path, straight, save_cp, load_cp):
    _resume(corpus, tmp_path, straight, save_cp, load_cp, "torch")


@pytest.mark.slow
@pytest.mark.parametrize("save_cp,load_cp", [(2, 1), (1, 2)])
def test_resume_across_context_parallel_sizes_torch_dist(corpus, tmp_path, straight, save_cp,
                                                         load_cp):
    _resume(corpus, tmp_path, straight, save_cp, load_cp, "torch_dist")
