"""Resuming from a torch-format checkpoint laid out as Megatron-LM writes it with the distributed
optimizer: ``model_optim_rng.pt`` holding only the param groups, the tensors in
``distrib_optim.pt`` beside it.

The Megatron-style folder is made from this project's own checkpoint (itself in that layout):
the same values, rewritten by the naive writer of the unit tests (not by the project's code),
with a sentinel in the gaps between parameters. Resuming from it must continue exactly like
resuming from the project's own checkpoint, at the data-parallel size that saved it and at
another one.
"""

import os
import shutil

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks
from tests.functional.test_distrib_optim_save import _model_tree, naive_state
from tests.unit.test_distrib_optim_file import megatron_order, naive_file

N = 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra=()):
    return gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=2, global_batch=4,
                     extra=["--use-distributed-optimizer", *extra])


def _losses(dp, argv):
    return [loss for _, loss in run_on_ranks(run_pretrain, dp, argv)[-1]["losses"]]


def megatronize(own_dir, target_dir, iteration):
    """Copy ``own_dir`` with each rank's ``distrib_optim.pt`` rewritten by the naive writer
    (a sentinel between parameters where the project writes zeros), from the values the naive
    reader finds in the project's file."""
    shutil.copytree(own_dir, target_dir)
    rank_dir = os.path.join(target_dir, f"iter_{iteration:07d}", "mp_rank_00")
    state = torch.load(os.path.join(rank_dir, "model_optim_rng.pt"), weights_only=False)
    assert "param_state" not in state["optimizer"]
    values = naive_state(rank_dir, _model_tree(state), 2)
    torch.save(naive_file({n: values[n] for n in megatron_order()}, dp=2),
               os.path.join(rank_dir, "distrib_optim.pt"))


@pytest.mark.slow
def test_resume_from_megatron_layout_equals_own(corpus, tmp_path):
    own = str(tmp_path / "own")
    run_on_ranks(run_pretrain, 2, _flags(corpus, ["--save", own, "--save-interval", str(N),
                                                  "--ckpt-format", "torch"]))
    theirs = str(tmp_path / "megatron")
    megatronize(own, theirs, N)
    assert os.path.exists(os.path.join(own, f"iter_{N:07d}", "mp_rank_00", "distrib_optim.pt"))
    for dp in (2, 1):
        from_own = _losses(dp, _flags(corpus, ["--load", own, "--ckpt-step", str(N)]))
        from_theirs = _losses(dp, _flags(corpus, ["--load", theirs, "--ckpt-step", str(N)]))
        assert len(from_own) == N
        assert from_theirs == from_own, dp
