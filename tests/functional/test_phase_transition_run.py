"""--phase-transition-iterations end to end: a run stops and saves at the transition; restarted
from that checkpoint with another --data-path it reads the new blend from its sample 0 (or,
resumed inside the phase, from where the phase stands), and phase 1 trains exactly like a plain
run of that phase's length."""

import os

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.multiprocess import run_on_ranks

GBS = 4  # gpt_flags' global batch
CONSTANT_LR = ["--lr-decay-style", "constant", "--lr-warmup-iters", "0"]


def _recording_provider(log):
    import torch

    import pretrain_gpt

    class Recording(torch.utils.data.Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, idx):
            log["read"].append(int(idx))
            return self.inner[idx]

    def provider(num_samples):
        log["asked"] = list(num_samples)
        train, valid, test = pretrain_gpt.train_valid_test_datasets_provider(num_samples)
        return Recording(train), valid, test

    return provider


def _run(argv):
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.training import global_vars, training

    log = {"read": []}
    try:
        state = training.pretrain(_recording_provider(log), pretrain_gpt.model_provider, None,
                                  pretrain_gpt.forward_step, argv=argv)
        return {"losses": [loss for _, loss in state.train_loss_history],
                "iteration": state.iteration, "consumed": state.consumed_train_samples,
                "asked": log["asked"][0], "read": log["read"]}
    finally:
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()


def _scenarios(a, b, root):
    phase = ["--phase-transition-iterations", "3"]
    save = os.path.join(root, "ckpt")
    out = {}
    out["plain"] = _run(gpt_flags(a, 3, dropout=0.0, extra=CONSTANT_LR))
    out["phase1"] = _run(gpt_flags(a, 6, dropout=0.0, extra=CONSTANT_LR + phase + [
        "--save", save, "--save-interval", "100"]))
    out["phase2"] = _run(gpt_flags(b, 6, dropout=0.0, extra=CONSTANT_LR + phase + [
        "--load", save, "--save", os.path.join(root, "ckpt2"), "--save-interval", "100",
        "--exit-interval", "4"]))
    out["phase2_resumed"] = _run(gpt_flags(b, 6, dropout=0.0, extra=CONSTANT_LR + phase + [
        "--load", os.path.join(root, "ckpt2")]))
    out["files"] = sorted(os.listdir(save))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("phases"))
    a = write_counting_corpus(os.path.join(root, "a_document"), num_docs=120, seed=1)
    b = write_counting_corpus(os.path.join(root, "b_document"), num_docs=120, seed=2)
    return run_on_ranks(_scenarios, 1, a, b, root, timeout=300)[0]


@pytest.mark.slow
def test_phase_one_stops_at_the_transition_like_a_plain_run_of_its_length(runs):
    plain, first = runs["plain"], runs["phase1"]
    assert first["iteration"] == 3 and "iter_0000003" in runs["files"]
    assert first["asked"] == plain["asked"] == 3 * GBS
    assert first["read"] == plain["read"] == list(range(3 * GBS))
    assert first["losses"] == plain["losses"]


@pytest.mark.slow
def test_the_next_phase_reads_its_blend_from_its_first_sample(runs):
    second, resumed = runs["phase2"], runs["phase2_resumed"]
    assert second["asked"] == 3 * GBS           # iterations 4..6 of the new data
    assert second["iteration"] == 4 and second["read"] == list(range(GBS))
    assert second["consumed"] == 4 * GBS           # the run's count stays global
    assert resumed["asked"] == 3 * GBS
    assert resumed["iteration"] == 6 and resumed["read"] == list(range(GBS, 3 * GBS))
