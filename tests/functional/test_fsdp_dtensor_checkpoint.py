"""--ckpt-format fsdp_dtensor: each rank writes its own FSDP2 shards under Megatron-LM's keys.

A fully sharded run resumed from its own checkpoint continues bit for bit (both FSDP flags);
the folder is a plain ``torch.distributed.checkpoint`` one that torch's own reader opens, and its
tensors equal the whole tensors of the torch format; it loads under FSDP2 at another
data-parallel or tensor-parallel size, and ``--ckpt-convert-format`` under FSDP2 turns it into
a checkpoint a run without FSDP resumes; a run without FSDP refuses it in one line.

Across layouts the gradients are summed in another order, so those resumes agree with the
uninterrupted run within ``REL_TOL`` (as in ``test_torch_fsdp2_checkpoint``: ~1e-7 measured,
while a moment loaded into the wrong shard moves the loss by 1e-3).
"""

import os

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3
REL_TOL = 1e-5
FSDP2 = ["--use-torch-fsdp2"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer",
                 "--no-gradient-accumulation-fusion"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra, fmt="fsdp_dtensor", swiglu=True):
    model = ["--swiglu"] if swiglu else []
    return gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=2, global_batch=8,
                     extra=["--ckpt-format", fmt, "--untie-embeddings-and-output-weights",
                            *model, *extra])


def _losses(out):
    return [loss for _, loss in out["losses"]]


def _close(a, b):
    assert len(a) == len(b) == N, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= REL_TOL * abs(y), (a, b)


def _straight(corpus, save, extra, ranks=2, fmt="fsdp_dtensor"):
    out = run_on_ranks(run_pretrain, ranks, _flags(corpus, ["--save", save, "--save-interval",
                                                            str(N), *extra], fmt))[-1]
    assert out["iteration"] == 2 * N
    return _losses(out)


def _resume(corpus, load, extra, ranks=2, fmt="fsdp_dtensor"):
    out = run_on_ranks(run_pretrain, ranks, _flags(corpus, ["--load", load, "--ckpt-step",
                                                            str(N), *extra], fmt))[-1]
    assert [i for i, _ in out["losses"]] == list(range(N + 1, 2 * N + 1))
    return _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [
    pytest.param(FSDP2, id="torch-fsdp2"),
    pytest.param(FSDP2 + ["--bf16"], id="torch-fsdp2-bf16"),
    pytest.param(MEGATRON_FSDP, id="megatron-fsdp-optim_grads_params"),
    pytest.param(MEGATRON_FSDP + ["--data-parallel-sharding-strategy", "optim_grads"],
                 id="megatron-fsdp-optim_grads")])
def test_resume_is_bit_exact(corpus, tmp_path, fsdp):
    save = str(tmp_path / "ckpt")
    straight = _straight(corpus, save, fsdp)
    iter_dir = os.path.join(save, f"iter_{N:07d}")
    assert sorted(f for f in os.listdir(iter_dir) if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]
    assert not os.path.exists(os.path.join(iter_dir, "metadata.json"))
    assert _resume(corpus, save, fsdp) == straight[N:]
