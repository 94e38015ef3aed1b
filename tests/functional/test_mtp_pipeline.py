"""Multi-token prediction under pipeline parallelism: the MTP layers run on the last stage
(with a copy of the input embedding there, kept in step with the first stage's), so PP 2, with
and without virtual stages, trains as one process does; a torch_dist checkpoint written at PP 2
loads at PP 1 and back; a resumed PP 2 run repeats the losses of the run that never stopped."""

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.functional.test_torch_fsdp2 import run_recording_grad_norms
from tests.multiprocess import run_on_ranks

ITERS = 4
MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3",
       "--position-embedding-type", "rope", "--num-layers", "4"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def run_recording_mtp_losses(argv):
    """``run_recording_grad_norms`` on this rank, also returning each step's logged
    ``mtp_K loss`` values (empty off the last stage)."""
    from megatron.training import moe_logging

    logged, original = [], moe_logging.mtp_loss_values

    def recording(*args, **kwargs):
        values = original(*args, **kwargs)
        logged.append(values)
        return values

    moe_logging.mtp_loss_values = recording
    try:
        return dict(run_recording_grad_norms(argv), mtp=logged)
    finally:
        moe_logging.mtp_loss_values = original


def _run(corpus, ranks, extra=(), iters=ITERS):
    """Losses, gradient norms and the logged ``mtp_K loss`` values of the last rank."""
    argv = gpt_flags(corpus, iters, micro_batch=2, global_batch=8, dropout=0.0,
                     extra=MTP + list(extra))
    return run_on_ranks(run_recording_mtp_losses, ranks, argv)[-1]


def _assert_parity(got, want):
    """Tolerances: losses within 1e-4, gradient norms within 1e-3 (relative): the same sums
    reduced in another order across stages."""
    losses = [loss for _, loss in got["losses"]]
    reference = [loss for _, loss in want["losses"]]
    assert len(losses) == len(reference) > 0
    for a, b in zip(losses, reference):
        assert abs(a - b) <= 1e-4 * abs(b), (losses, reference)
    for a, b in zip(got["grad_norms"], want["grad_norms"]):
        assert abs(a - b) <= 1e-3 * abs(b), (got["grad_norms"], want["grad_norms"])
    assert len(got["mtp"]) == len(want["mtp"]) == len(reference)
    for a, b in zip(got["mtp"], want["mtp"]):
        assert sorted(a) == sorted(b) == ["mtp_1 loss", "mtp_2 loss"], (a, b)
        for key in b:
            assert abs(a[key] - b[key]) <= 1e-4 * abs(b[key]), (got["mtp"], want["mtp"])


@pytest.mark.slow
@pytest.mark.parametrize("untie, optimizer", [(False, []), (True, []),
                                              (True, ["--use-distributed-optimizer"])],
                         ids=["tied", "untied", "untied-distributed-optimizer"])
def test_mtp_at_pp2_gives_the_single_process_losses_and_grad_norms(corpus, untie, optimizer):
    extra = (["--untie-embeddings-and-output-weights"] if untie else []) + optimizer
    single = _run(corpus, 1, extra)
    piped = _run(corpus, 2, extra + ["--pipeline-model-parallel-size", "2"])
    _assert_parity(piped, single)


@pytest.mark.slow
def test_mtp_at_pp2_with_virtual_stages_gives_the_single_process_losses(corpus):
    """Two virtual stages per rank: the MTP layers run in the last rank's last chunk."""
    single = _run(corpus, 1)
    piped = _run(corpus, 2, ["--pipeline-model-parallel-size", "2",
                             "--num-layers-per-virtual-pipeline-stage", "1"])
    _assert_parity(piped, single)


PP2 = ["--pipeline-model-parallel-size", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resumed_pp2_run_repeats_the_losses_bit_for_bit(corpus, tmp_path, fmt):
    extra = PP2 + ["--untie-embeddings-and-output-weights", "--ckpt-format", fmt]
    straight = _run(corpus, 2, extra)
    save = str(tmp_path / "ckpt")
    first = _run(corpus, 2, extra + ["--save", save, "--exit-interval", "2"])
    assert first["iteration"] == 2
    resumed = _run(corpus, 2, extra + ["--load", save])
    assert resumed["iteration"] == ITERS
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["grad_norms"] == straight["grad_norms"][2:]
    assert resumed["mtp"] == straight["mtp"][2:]


@pytest.mark.slow
@pytest.mark.parametrize("saved_at, loaded_at", [(2, 1), (1, 2)], ids=["pp2_to_pp1",
                                                                        "pp1_to_pp2"])
def test_torch_dist_checkpoint_moves_between_pp2_and_pp1(corpus, tmp_path, saved_at,
                                                         loaded_at):
    """Written at one pipeline size (Megatron-Core's ``mtp.layers.K`` keys, on the last stage)
    and resumed at the other, the run continues as the single process does: the MTP layers,
    the last stage's copy of the embedding and the optimizer state all land."""
    extra = ["--untie-embeddings-and-output-weights", "--ckpt-format", "torch_dist"]
    single = _run(corpus, 1, extra)
    save = str(tmp_path / "ckpt")

    def layout(pp):
        return ["--pipeline-model-parallel-size", str(pp)] if pp > 1 else []

    _run(corpus, saved_at, extra + layout(saved_at) + ["--save", save, "--exit-interval", "2"])
    from megatron.checkpoint.dist import DistCheckpointReader

    reader = DistCheckpointReader(str(tmp_path / "ckpt" / "iter_0000002"))
    assert reader.read("mtp.layers.1.eh_proj.weight").shape == (32, 64)
    resumed = _run(corpus, loaded_at, extra + layout(loaded_at) + ["--load", save])
    tail = dict(single, losses=single["losses"][2:], grad_norms=single["grad_norms"][2:],
                mtp=single["mtp"][2:])
    _assert_parity(dict(resumed), tail)


def _rank_models(folder):
    """``{file path under the iteration folder: flattened model dict}`` of a torch checkpoint."""
    import os

    from megatron.checkpoint.safe_unpickle import torch_load
    from megatron.model.module import flatten_state_dict

    (name,) = [d for d in os.listdir(folder) if d.startswith("iter_")]
    out = {}
    for rank in sorted(os.listdir(os.path.join(folder, name))):
        state = torch_load(os.path.join(folder, name, rank, "model_optim_rng.pt"))
        out[rank] = flatten_state_dict(state["model"])
    return out


@pytest.mark.slow
def test_converted_pp2_torch_checkpoint_with_mtp_comes_back_and_resumes_at_pp1(corpus, tmp_path):
    """A PP 2 torch checkpoint (the last stage's MTP layers and its copy of the untied input
    embedding) converted to one rank and back is the same file content, key for key and bit for
    bit; the one-rank conversion resumes as the single process does."""
    import torch

    from tools.checkpoint.convert import main

    extra = ["--untie-embeddings-and-output-weights"]
    single = _run(corpus, 1, extra)
    save, one, back = (str(tmp_path / n) for n in ("pp2", "pp1", "back"))
    _run(corpus, 2, extra + PP2 + ["--save", save, "--exit-interval", "2",
                                   "--ckpt-format", "torch"])
    for src, dst, pp in ((save, one, "1"), (one, back, "2")):
        assert main(["--model-type", "GPT", "--load-dir", src, "--save-dir", dst,
                     "--target-pipeline-parallel-size", pp]) == 0
    want, got = _rank_models(save), _rank_models(back)
    assert sorted(want) == sorted(got)
    for rank in want:
        assert sorted(want[rank]) == sorted(got[rank]), rank
        assert [k for k in want[rank] if not torch.equal(want[rank][k], got[rank][k])] == []
    last = want[sorted(want)[-1]]
    assert "word_embeddings_for_head.weight" in last and "mtp.layers.1.eh_proj.weight" in last
    resumed = _run(corpus, 1, extra + ["--load", one])
    tail = dict(single, losses=single["losses"][2:], grad_norms=single["grad_norms"][2:],
                mtp=single["mtp"][2:])
    _assert_parity(resumed, tail)
