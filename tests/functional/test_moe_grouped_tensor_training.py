"""Training with Megatron-Core's grouped-linear expert layouts (--moe-use-grouped-tensor,
--moe-single-grouped-weight, --moe-single-grouped-bias) against the grouped-GEMM run with the
loop's layout, and their checkpoints in both formats.

The model is test_moe_training.py's (4 layers, hidden 32, 4 experts, top 2, aux and z losses,
fp32, dropout 0) with biases. The layouts hold the same numbers and run the same batched
matmuls, so the losses may differ from the reference run only where a sum over parameters
groups its terms differently (the gradient norm for clipping): 1e-6 relative.
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

ITERS = 6
RTOL = 1e-6
MOE = ["--num-layers", "4", "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "1e-3", "--no-bias-gelu-fusion",
       "--moe-grouped-gemm"]
SINGLE = ["--moe-use-grouped-tensor", "--moe-single-grouped-weight",
          "--moe-single-grouped-bias"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, extra=(), iters=ITERS):
    return gpt_flags(corpus, iters, micro_batch=2, global_batch=8, dropout=0.0,
                     extra=MOE + list(extra))


def _losses(result):
    return [loss for _, loss in result["losses"]]


def _close(a, b):
    assert len(a) == len(b) and all(abs(x - y) <= RTOL * abs(x) for x, y in zip(a, b)), (a, b)


@pytest.fixture(scope="module")
def reference(corpus):
    return _losses(run_on_ranks(run_pretrain, 1, _flags(corpus))[-1])


@pytest.mark.parametrize("extra", [
    pytest.param(SINGLE, id="weight-and-bias"),
    pytest.param(SINGLE[:2], id="weight", marks=pytest.mark.slow),
    pytest.param([SINGLE[0], SINGLE[2]], id="bias", marks=pytest.mark.slow),
    pytest.param(SINGLE[:1], id="grouped-tensor", marks=pytest.mark.slow)])
def test_training_equals_the_loops_layout(corpus, reference, extra):
    losses = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra))[-1])
    assert reference[-1] < reference[0] - 0.2, reference   # it learns
    _close(reference, losses)


@pytest.mark.parametrize("fmt", ["torch", pytest.param("torch_dist", marks=pytest.mark.slow)])
def test_resume_is_bit_exact(corpus, tmp_path, fmt):
    """6 iterations straight == 3, save, a new run loads and runs 3 more."""
    extra = SINGLE + ["--ckpt-format", fmt]
    straight = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra))[-1])
    save = str(tmp_path / "ckpt")
    first = run_on_ranks(run_pretrain, 1, _flags(
        corpus, extra + ["--save", save, "--exit-interval", "3"]))[-1]
    second = run_on_ranks(run_pretrain, 1, _flags(corpus, extra + ["--load", save]))[-1]
    assert _losses(first) == straight[:3]
    assert _losses(second) == straight[3:], (straight, _losses(second))


@pytest.mark.parametrize("saved,loaded", [
    pytest.param(SINGLE, [], id="single-to-loop"),
    pytest.param([], SINGLE, id="loop-to-single", marks=pytest.mark.slow),
    pytest.param(SINGLE, SINGLE[:2], id="single-to-per-gemm-bias", marks=pytest.mark.slow)])
def test_torch_dist_moves_between_layouts(corpus, tmp_path, saved, loaded):
    """A torch_dist file (model and optimizer) saved with one layout resumes in another as the
    saving layout would have continued."""
    fmt = ["--ckpt-format", "torch_dist"]
    straight = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, saved + fmt))[-1])
    save = str(tmp_path / "ckpt")
    run_on_ranks(run_pretrain, 1, _flags(corpus, saved + fmt + ["--save", save,
                                                                  "--exit-interval", "3"]))
    second = run_on_ranks(run_pretrain, 1, _flags(corpus, loaded + fmt + ["--load", save]))[-1]
    _close(straight[3:], _losses(second))


@pytest.mark.slow
@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distopt"])
def test_expert_parallel_equals_one_process(corpus, tmp_path, distopt):
    """EP 2 x DP 2 (each rank two experts: stacked [2, ...] tensors) == one process, and its
    torch_dist file (saved at iteration 3) resumes in one process."""
    extra = SINGLE + ["--ckpt-format", "torch_dist"] + (
        ["--use-distributed-optimizer"] if distopt else [])
    one = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra))[-1])
    save = str(tmp_path / "ckpt")
    two = _losses(run_on_ranks(run_pretrain, 2, _flags(
        corpus, extra + ["--expert-model-parallel-size", "2", "--save", save,
                         "--exit-interval", "3"]))[-1])
    resumed = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra + ["--load", save]))[-1])
    ep_run = two + resumed
    assert len(ep_run) == ITERS
    assert all(abs(x - y) <= 1e-4 * abs(x) for x, y in zip(one, ep_run)), (one, ep_run)


@pytest.mark.slow
def test_torch_format_at_another_ep_is_refused_in_one_line(corpus, tmp_path):
    """--ckpt-format torch re-deals the loop's per-expert tensors over another EP size, not a
    stacked one: said in one line instead of loading the wrong experts."""
    extra = SINGLE + ["--ckpt-format", "torch"]
    save = str(tmp_path / "ckpt")
    run_on_ranks(run_pretrain, 1, _flags(corpus, extra + ["--save", save,
                                                          "--exit-interval", "3"]))
    with pytest.raises(Exception, match="which --ckpt-format torch does not re-deal"):
        run_on_ranks(run_pretrain, 2, _flags(
            corpus, extra + ["--load", save, "--expert-model-parallel-size", "2"]))


@pytest.mark.slow
def test_expert_tensor_parallel_equals_one_process(corpus, tmp_path):
    """Expert TP 2 over DP 2 (each rank half of every expert's fc1 rows and fc2 columns, in
    stacked tensors) == one process; its torch_dist file (saved at iteration 3) resumes in one
    process."""
    extra = SINGLE + ["--ckpt-format", "torch_dist", "--moe-token-dispatcher-type", "alltoall"]
    one = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra))[-1])
    save = str(tmp_path / "ckpt")
    two = _losses(run_on_ranks(run_pretrain, 2, _flags(
        corpus, extra + ["--expert-tensor-parallel-size", "2", "--save", save,
                         "--exit-interval", "3"]))[-1])
    resumed = _losses(run_on_ranks(run_pretrain, 1, _flags(corpus, extra + ["--load", save]))[-1])
    etp_run = two + resumed
    assert len(etp_run) == ITERS
    assert all(abs(x - y) <= 1e-4 * abs(x) for x, y in zip(one, etp_run)), (one, etp_run)


@pytest.mark.slow
def test_converter_reads_the_layout_from_torch_dist_and_names_a_torch_file(corpus, tmp_path):
    from tools.checkpoint.convert import main

    for fmt in ("torch", "torch_dist"):
        save = str(tmp_path / fmt)
        run_on_ranks(run_pretrain, 1, _flags(corpus, SINGLE + ["--ckpt-format", fmt, "--save",
                                                               save], iters=2))
        argv = ["--model-type", "GPT", "--load-dir", save, "--save-dir", save + "_out",
                "--target-ckpt-format", "torch" if fmt == "torch_dist" else "torch_dist"]
        if fmt == "torch":
            with pytest.raises(SystemExit):
                main(argv)
            continue
        assert main(argv) == 0
        # the converted legacy file has the loop's names; a run with them resumes from it
        resumed = run_on_ranks(run_pretrain, 1, _flags(
            corpus, ["--ckpt-format", "torch", "--load", save + "_out",
                     "--use-checkpoint-opt_param-scheduler"], iters=3))[-1]
        assert len(_losses(resumed)) == 1
