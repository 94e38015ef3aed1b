"""Megatron flags that work here, in a real pretrain_gpt run on one CPU rank: --log-progress's
progress.txt, --save-retain-interval's pruning, and --no-mmap-bin-files and
--transformer-impl transformer_engine training the same numbers as without them."""

import os

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 5


def test_progress_log_retention_and_same_losses(tmp_path):
    corpus = write_counting_corpus(str(tmp_path / "corpus" / "count_document"))
    save = str(tmp_path / "ckpt")
    extra = ["--save", save, "--save-interval", "1", "--save-retain-interval", "2",
             "--log-progress", "--no-mmap-bin-files", "--transformer-impl",
             "transformer_engine", "--logging-level", "20"]
    with_flags = run_on_ranks(run_pretrain, 1, gpt_flags(corpus, ITERS, extra=extra))[0]
    plain = run_on_ranks(run_pretrain, 1, gpt_flags(corpus, ITERS))[0]
    assert with_flags["losses"] == plain["losses"]

    lines = open(os.path.join(save, "progress.txt")).read().splitlines()
    assert lines[0].endswith("\tStarting job")
    saved = [line for line in lines if "\tSaved checkpoint\t" in line]
    assert [line.split("Iteration: ")[1].split("\t")[0] for line in saved] == [
        str(i) for i in range(1, ITERS + 1)]
    assert saved[-1].endswith(f"Tokens (in billions): {ITERS * 4 * 16 / 1e9:.2f}")
    # Saved every iteration; kept: the multiples of 2 and the latest.
    kept = sorted(n for n in os.listdir(save) if n.startswith("iter_"))
    assert kept == ["iter_0000002", "iter_0000004", "iter_0000005"]
