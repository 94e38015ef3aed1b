"""--use-torch-fsdp2 with --fp16 (the loss scaler's state), pipeline parallelism (each stage's
shards) and experts (sharded over the expert-data-parallel group): a run resumed from its own
checkpoint, in either format, continues bit for bit from the run that never stopped."""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
MOE = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "0.01", "--no-bias-gelu-fusion", "--expert-model-parallel-size",
       "2"]
LAYOUTS = {
    "fp16": (2, ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "2"]),
    "pp2": (4, ["--pipeline-model-parallel-size", "2"]),
    "moe-ep2-dp4": (4, MOE),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _losses(corpus, ranks, fmt, extra):
    flags = gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=2, global_batch=8,
                      extra=["--use-torch-fsdp2", "--ckpt-format", fmt, *extra])
    out = run_on_ranks(run_pretrain, ranks, flags)[-1]
    return out["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fsdp2_resume_is_bit_exact(corpus, tmp_path, layout, fmt):
    ranks, extra = LAYOUTS[layout]
    save = str(tmp_path / "ckpt")
    straight = _losses(corpus, ranks, fmt, [*extra, "--save", save, "--save-interval", str(N)])
    resumed = _losses(corpus, ranks, fmt, [*extra, "--load", save, "--ckpt-step", str(N)])
    assert [i for i, _ in resumed] == list(range(N + 1, 2 * N + 1))
    assert resumed == straight[N:]
