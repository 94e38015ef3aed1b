"""Checkpoints under --use-torch-fsdp2, in both formats: a run resumed from its own checkpoint
continues bit for bit, and checkpoints move between runs with and without FSDP2.

A checkpoint holds whole tensors (the wrapper and the optimizer gather their shards to save and
keep their own shard on load), so a run without FSDP2 reads it as its own and the other way
round. Across the two the optimizer differs (torch's AdamW steps on the shards, the fused kernel
on whole tensors) and the gradients are summed in another order, so those resumes agree with the
uninterrupted run within ``REL_TOL`` (as in ``test_distrib_optimizer_resume``: ~1e-7 measured,
while a moment loaded into the wrong shard moves the loss by 1e-3).

With --bf16 a checkpoint holds bf16 weights and the fp32 main weights beside the optimizer
state, as a bf16 run without FSDP2 writes it. Across the two, the weight gradients differ by
bf16 rounding (without FSDP2 they are accumulated in fp32 by the fused kernel, FSDP2 computes
them in bf16 and reduces in fp32): ~1e-5 on the losses, so ``BF16_REL_TOL = 1e-4``. That
tolerance would not see the fp32 main weights left out of a resume (resuming from the bf16
weights alone moved the losses by 4e-5); the bit-exact FSDP2 resume does.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
REL_TOL = 1e-5
BF16_REL_TOL = 1e-4
FSDP = ["--use-torch-fsdp2"]
CASES = [pytest.param("torch", [], id="torch-fp32"),
         pytest.param("torch_dist", [], id="torch_dist-fp32"),
         pytest.param("torch", ["--bf16"], id="torch-bf16"),
         pytest.param("torch_dist", ["--bf16"], id="torch_dist-bf16")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, fmt, extra=()):
    return gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=2, global_batch=8,
                     extra=["--ckpt-format", fmt, "--untie-embeddings-and-output-weights",
                            *extra])


def _losses(out):
    return [loss for _, loss in out["losses"]]


def _close(a, b, precision=()):
    tol = BF16_REL_TOL if "--bf16" in precision else REL_TOL
    assert len(a) == len(b) == N, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= tol * abs(y), (a, b)


def _straight(corpus, fmt, tmp, extra, ranks=2):
    """2N iterations at DP=2, saving at iteration N on the way."""
    save = str(tmp / f"ckpt_{fmt}")
    out = run_on_ranks(run_pretrain, ranks, _flags(corpus, fmt, ["--save", save,
                                                                 "--save-interval", str(N),
                                                                 *extra]))[-1]
    assert out["iteration"] == 2 * N
    return _losses(out), save


def _resume(corpus, fmt, save, extra, ranks=2):
    out = run_on_ranks(run_pretrain, ranks, _flags(corpus, fmt, ["--load", save, "--ckpt-step",
                                                                 str(N), *extra]))[-1]
    assert [i for i, _ in out["losses"]] == list(range(N + 1, 2 * N + 1))
    return _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, precision", CASES)
def test_fsdp2_resume_is_bit_exact_and_loads_without_fsdp2(corpus, tmp_path, fmt, precision):
    straight, save = _straight(corpus, fmt, tmp_path, FSDP + precision)
    assert _resume(corpus, fmt, save, FSDP + precision) == straight[N:]
    _close(_resume(corpus, fmt, save, precision), straight[N:], precision)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, precision", CASES)
def test_a_checkpoint_without_fsdp2_loads_with_it(corpus, tmp_path, fmt, precision):
    straight, save = _straight(corpus, fmt, tmp_path, precision)
    _close(_resume(corpus, fmt, save, FSDP + precision), straight[N:], precision)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_tp2_fsdp2_checkpoint_resumes_and_loads_at_another_layout(corpus, tmp_path, fmt):
    """TP=2 x DP=2 under FSDP2: each TP rank's file (or shard) holds its whole slice; the
    resume is bit exact, and torch_dist loads it without FSDP2 at TP=1 x DP=2."""
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    # --async-save: the shards are gathered on the main thread, then written in the background.
    straight, save = _straight(corpus, fmt, tmp_path, FSDP + tp2 + ["--async-save"], ranks=4)
    assert _resume(corpus, fmt, save, FSDP + tp2, ranks=4) == straight[N:]
    if fmt == "torch_dist":
        _close(_resume(corpus, fmt, save, []), straight[N:])
