"""--iterations-to-skip and --start-eval-at-iter in real runs.

A skipped iteration reads its batch and drops it: the next iteration trains on the data the
uninterrupted run would have read there (recorded token by token), no optimizer or LR step is
taken, the samples count as consumed and skipped, and a resume from a checkpoint saved after a
skip goes on exactly as the run that never stopped.
"""

import os

import pytest

from tests.functional.gpt_runs import gpt_flags
from tests.functional.test_training_options import (EVAL_VALUE, _log_lines, _pretrain_probed,
                                                     corpus)
from tests.multiprocess import run_on_ranks

__all__ = ["corpus"]  # the shared corpus fixture
pytestmark = pytest.mark.slow  # one spawned process, five short runs


def _run_recording(scenarios):
    """Each scenario through ``_pretrain_probed``, with the first token of every training
    micro-batch pretrain_gpt reads (evaluation batches are left out)."""
    import pretrain_gpt

    real = pretrain_gpt.get_batch
    results = {}
    for name, run in scenarios:
        tokens = []

        def get_batch(data_iterator, stage=None):
            out = real(data_iterator, stage)
            import torch
            if torch.is_grad_enabled():
                tokens.append(out[0][:, 0].tolist())
            return out

        pretrain_gpt.get_batch = get_batch
        try:
            results[name] = _pretrain_probed(**run)
        finally:
            pretrain_gpt.get_batch = real
        results[name]["tokens"] = tokens
    return results


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("skip"))
    save = os.path.join(root, "ckpt")
    base = gpt_flags(corpus, 6, dropout=0.0, extra=["--eval-interval", "2"])
    skip = base + ["--iterations-to-skip", "2", "4"]
    scenarios = [
        ("plain", {"argv": base}),
        ("start_eval", {"argv": base + ["--start-eval-at-iter", "3"]}),
        ("skip", {"argv": skip}),
        ("skip_stopped", {"argv": skip + ["--save", save, "--exit-interval", "3"]}),
        ("skip_resumed", {"argv": skip + ["--save", save, "--load", save]}),
    ]
    return run_on_ranks(_run_recording, 1, scenarios, timeout=240)[0]


def _evaluated_at(stdout):
    """Where evaluation ran in the loop (the final validation and test lines left out)."""
    return [m[1] for m in EVAL_VALUE.finditer(stdout) if m[1].startswith("iteration")]


def test_start_eval_at_iter(runs):
    """Evaluation every 2 iterations: at 2, 4, 6 (and the final one) without the flag, from
    iteration 3 on with it; training is the same either way."""
    assert _evaluated_at(runs["plain"]["stdout"]) == [
        "iteration 2", "iteration 4", "iteration 6"]
    assert _evaluated_at(runs["start_eval"]["stdout"]) == [
        "iteration 4", "iteration 6"]
    assert runs["start_eval"]["losses"] == runs["plain"]["losses"]


def test_skipped_iterations_drop_their_batch(runs):
    """Iterations 2 and 4 are skipped (micro batch 2, global batch 4: two micro-batches each):
    their micro-batches are read (the recorded reads of the run that never skipped are all
    there) but not trained on; the LR steps only for iterations run."""
    plain, skip = runs["plain"], runs["skip"]
    by_iteration = [plain["tokens"][2 * i:2 * i + 2] for i in range(6)]
    assert skip["tokens"] == [t for i, pair in enumerate(by_iteration) if i + 1 not in (2, 4)
                              for t in pair]
    lines = _log_lines(skip["stdout"])
    assert [int(m[1]) for m in lines] == [1, 3, 5, 6]
    assert [int(m[3]) for m in lines] == [4, 12, 20, 24]
    plain_lr = [float(m[4]) for m in _log_lines(plain["stdout"])]
    assert [float(m[4]) for m in lines] == plain_lr[:4]  # 1, 2, 3, 4 scheduler steps
    assert [i for i, _ in skip["losses"]] == [1, 3, 5, 6]
    assert skip["losses"][0] == plain["losses"][0]
    assert skip["iteration"] == 6 and skip["consumed"] == 24
    assert "skipped iteration 2 (--iterations-to-skip): 4 samples" in skip["stdout"]
    # Evaluation at 2 and 4 is skipped with the iteration, as in Megatron.
    assert _evaluated_at(skip["stdout"]) == ["iteration 6"]


def test_resume_after_a_skip(runs):
    skip, stopped, resumed = runs["skip"], runs["skip_stopped"], runs["skip_resumed"]
    assert stopped["iteration"] == 3 and stopped["consumed"] == 12
    assert resumed["start"]["iteration"] == 3 and resumed["start"]["consumed"] == 12
    assert resumed["start"]["scheduler_steps"] == 8
    assert resumed["losses"] == skip["losses"][2:]
    assert resumed["tokens"] == skip["tokens"][4:]
