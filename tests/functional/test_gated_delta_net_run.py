"""pretrain_gpt with gated delta net layers (--experimental-attention-variant gdn,
--linear-attention-freq mixing linear and standard attention): the loss falls, the same seed
gives the same losses, a run resumed from a torch checkpoint continues bit for bit, and TP 2
(with sequence parallelism) follows the single-process losses."""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 4
GDN = ("--num-layers 3 --experimental-attention-variant gdn --linear-attention-freq [1,0,1] "
       "--linear-num-key-heads 2 --linear-num-value-heads 4 --linear-key-head-dim 8 "
       "--linear-value-head-dim 8 --linear-conv-kernel-dim 4 --swiglu --normalization RMSNorm "
       "--disable-bias-linear").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _losses(corpus, ranks=1, extra=(), iters=2 * N):
    argv = gpt_flags(corpus, iters, dropout=0.0, lr=1e-2, extra=GDN + list(extra))
    return [loss for _, loss in run_on_ranks(run_pretrain, ranks, argv)[-1]["losses"]]


@pytest.mark.slow
def test_gdn_run_learns_repeats_and_resumes(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    first = _losses(corpus, extra=["--save", save, "--save-interval", str(N),
                                   "--ckpt-format", "torch"])
    assert first[-1] < first[0] - 0.5
    assert _losses(corpus) == first
    resumed = _losses(corpus, extra=["--load", save, "--ckpt-step", str(N),
                                     "--ckpt-format", "torch"])
    assert resumed == first[N:]


@pytest.mark.slow
def test_gdn_tp2_follows_single_process(corpus):
    single = _losses(corpus, iters=N)
    split = _losses(corpus, ranks=2, iters=N,
                    extra=["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    # float32 sums in another order over a few steps
    assert split == pytest.approx(single, rel=1e-4)


def test_gdn_refusals_name_the_flag(corpus, monkeypatch):
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.validation import ArgumentsError
    for extra, match in ((["--experimental-attention-variant", "gdn2"], "gdn2: not built yet"),
                         (["--context-parallel-size", "2"], "gdn with --context-parallel-size"),
                         (["--reset-attention-mask"], "gdn with --reset-attention-mask"),
                         (["--ckpt-format", "torch_dist", "--save", "x"], "torch_dist")):
        world = "2" if "--context-parallel-size" in extra else "1"
        monkeypatch.setenv("WORLD_SIZE", world)
        args = parse_args(argv=gpt_flags(corpus, 2, extra=GDN + extra))
        with pytest.raises(ArgumentsError, match=match):
            validate_args(args)


@pytest.mark.slow
def test_gdn_pp2_follows_single_process(corpus):
    four = ["--num-layers", "4", "--linear-attention-freq", "2"]   # linear, full, linear, full
    single = _losses(corpus, iters=N, extra=four)
    split = _losses(corpus, ranks=2, iters=N,
                    extra=four + ["--pipeline-model-parallel-size", "2"])
    assert split == pytest.approx(single, rel=1e-5)
