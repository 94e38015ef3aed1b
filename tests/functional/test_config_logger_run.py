"""--config-logger-dir in a tiny 2-rank GPT run (TP=2 on gloo): each rank writes Megatron's
files under its own rank string, the JSON holds the command line's model shape, the losses are
bit-identical to the run without the flag, and a directory that cannot be written stops the run
before training in one line."""

import json
import os

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow  # spawned processes

ITERS = 3


def _run(argv):
    """pretrain() in this rank's process, leaving no process groups behind for the next."""
    from megatron.core import parallel_state

    try:
        return run_pretrain(argv)["losses"]
    finally:
        parallel_state.destroy_model_parallel()


def _runs(argv, log_dir, bad_dir):
    """The plain run, the logged run and the refused one; what each rank saw."""
    from megatron.core.config import ConfigError

    plain = _run(argv)
    logged = _run(argv + ["--config-logger-dir", log_dir])
    try:
        _run(argv + ["--config-logger-dir", bad_dir])
        refused = None
    except ConfigError as err:
        refused = str(err)
    return {"plain": plain, "logged": logged, "refused": refused}


def test_two_ranks_write_megatrons_files_and_train_the_same(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "corpus" / "count_document"))
    argv = gpt_flags(corpus, ITERS, tp=2, dropout=0.0)
    log_dir = tmp_path / "logs"                                    # created by the run
    (tmp_path / "file").write_text("")
    bad_dir = str(tmp_path / "file" / "logs")
    ranks = run_on_ranks(_runs, 2, argv, str(log_dir), bad_dir, timeout=280)

    for rank in ranks:
        assert rank["logged"] == rank["plain"] and len(rank["plain"]) == ITERS
        assert rank["refused"].startswith(f"--config-logger-dir {bad_dir} is not writable")
    names = sorted(os.listdir(log_dir))
    # One forward per micro-batch (global batch 4 / micro-batch 2 = 2 per step): the training
    # iterations, then the final evaluation's --eval-iters 2 steps on the valid and test sets.
    forwards = 2 * ITERS + 2 * 2 * 2
    for tp_rank in (0, 1):
        ranks_str = f"{tp_rank}_0_0_0_0"
        assert f"GPTModel.rank_{ranks_str}.iter0.json" in names
        assert f"GPTModel.rank_{ranks_str}.iter1.json" not in names
        assert f"GPTModel_init_ckpt.rank_{ranks_str}.iter0.pth" in names
        with open(log_dir / f"DistributedDataParallel.rank_{ranks_str}.iter0.json") as f:
            wrapper = json.load(f)
        assert "overlap_grad_reduce" in wrapper["ddp_config"]
        assert wrapper["config"]["hidden_size"] == 32 and wrapper["disable_bucketing"] is False
        assert "word_embeddings" in json.dumps(wrapper["module"])
        logits = [n for n in names if n.startswith(f"input_and_logits.rank_{ranks_str}.")]
        assert sorted(logits) == sorted(f"input_and_logits.rank_{ranks_str}.iter{n}.pth"
                                        for n in range(forwards))
        with open(log_dir / f"GPTModel.rank_{ranks_str}.iter0.json") as f:
            config = json.load(f)["config"]
        assert (config["num_layers"], config["hidden_size"], config["num_attention_heads"],
                config["seq_length"]) == (2, 32, 4, 16)
    assert len(names) == 2 * (3 + forwards)
