"""Multi-token prediction under fully sharded data parallelism (``--use-torch-fsdp2`` and
``--use-megatron-fsdp``'s sharding strategies), as Megatron-LM's DeepSeek-V3 Megatron-FSDP
script trains it.

Under FSDP2 the MTP depths' transformer layers are units of their own; their norms and
projection go with the root. The MTP block runs after the main stack and calls units that have
already run: the untied embedding (for the shifted tokens) and the output layer (once per
depth), and with ``--mtp-use-repeated-layer`` one depth's layer K times. Each call gathers
the unit again; its gradients accumulate over the calls and are reduce-scattered once per
micro-batch group. So a DP 2 run must give the losses, the logged per-depth ``mtp_K loss``
values and the gradient norms of one process and of two ranks with the grad-buffer wrapper.

Tolerance: ``test_torch_fsdp2``'s. The layouts sum the same terms in another order and torch's
AdamW steps on the shards, so fp32 values move by a few ulps per step; ``RTOL = 1e-5`` is far
below what a dropped MTP loss, an output-layer gradient reduced for one call only or an
unaveraged gradient does (the MTP loss is 0.3 of the main one here; the gradient norm, which
Adam would otherwise hide, is compared too).
"""

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.functional.test_mtp_pipeline import MTP, run_recording_mtp_losses
from tests.multiprocess import run_on_ranks

ITERS = 4
N = 2   # iterations before the checkpoint in the resume tests
RTOL = 1e-5
UNTIE = ["--untie-embeddings-and-output-weights"]
TORCH_FSDP2 = ["--use-torch-fsdp2"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer",
                 "--no-gradient-accumulation-fusion", "--data-parallel-sharding-strategy"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--no-bias-gelu-fusion"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, ranks, extra=(), iters=ITERS):
    """The last rank's losses, gradient norms and logged ``mtp_K loss`` values."""
    argv = gpt_flags(corpus, iters, micro_batch=2, global_batch=8, dropout=0.0,
                     extra=MTP + list(extra))
    return run_on_ranks(run_recording_mtp_losses, ranks, argv)[-1]


def _numbers(result):
    """Every compared number of a run, in order: losses, gradient norms, MTP losses."""
    mtp = [step[key] for step in result["mtp"] for key in sorted(step)]
    return [loss for _, loss in result["losses"]] + list(result["grad_norms"]) + mtp


def _close(got, want):
    a, b = _numbers(got), _numbers(want)
    assert len(a) == len(b) == ITERS * 4, (a, b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=RTOL), (a, b)


@pytest.fixture(scope="module")
def references(corpus):
    """``{tied: (one process, DP 2 with the grad-buffer wrapper)}``, computed once each."""
    cache = {}

    def get(untie):
        if untie not in cache:
            extra = UNTIE if untie else []
            cache[untie] = (_run(corpus, 1, extra), _run(corpus, 2, extra))
        return cache[untie]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("untie, fsdp", [
    (False, TORCH_FSDP2),
    (True, TORCH_FSDP2),
    (True, TORCH_FSDP2 + ["--torch-fsdp2-no-reshard-after-forward"]),
    (True, MEGATRON_FSDP + ["optim_grads_params"]),
    (True, MEGATRON_FSDP + ["optim_grads"]),
    (False, MEGATRON_FSDP + ["optim_grads_params"]),
], ids=["torch-fsdp2-tied", "torch-fsdp2-untied", "torch-fsdp2-untied-no-reshard",
        "megatron-fsdp-optim_grads_params", "megatron-fsdp-optim_grads",
        "megatron-fsdp-optim_grads_params-tied"])
def test_mtp_under_fsdp_matches_one_process_and_ddp(corpus, references, untie, fsdp):
    single, ddp = references(untie)
    got = _run(corpus, 2, (UNTIE if untie else []) + fsdp)
    _close(got, single)
    _close(got, ddp)
    losses = [loss for _, loss in single["losses"]]
    assert losses[-1] < losses[0]                     # it learns
    assert min(single["grad_norms"]) > 1.0            # clipping acts at every step
    assert single["mtp"][0]["mtp_2 loss"] != single["mtp"][0]["mtp_1 loss"]


@pytest.mark.slow
def test_repeated_layer_and_context_parallelism_under_fsdp2(corpus):
    """One depth's module applied twice (its transformer layer, an FSDP2 unit, runs twice per
    micro-batch), and CP 2: the shifted tokens cross the chunks of the two FSDP ranks."""
    extra = UNTIE + ["--mtp-use-repeated-layer"]
    single = _run(corpus, 1, extra)
    _close(_run(corpus, 2, extra + TORCH_FSDP2), single)
    _close(_run(corpus, 2, UNTIE + TORCH_FSDP2 + ["--context-parallel-size", "2"]),
           _run(corpus, 1, UNTIE))


@pytest.mark.slow
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_mtp_under_fsdp2_at_pp2_dp2_matches_one_process(corpus, references, untie):
    """The MTP depths on the last stage with its copy of the word-embedding table (in that
    stage's root unit), whose gradient shard is summed with the first stage's."""
    extra = (UNTIE if untie else []) + TORCH_FSDP2 + ["--pipeline-model-parallel-size", "2"]
    _close(_run(corpus, 4, extra), references(untie)[0])


@pytest.mark.slow
def test_mtp_built_on_the_meta_device_under_fsdp2(corpus, references):
    """--init-model-with-meta-device fills the MTP layers' shards as the rest's."""
    _close(_run(corpus, 2, UNTIE + TORCH_FSDP2 + ["--init-model-with-meta-device"]),
           references(True)[0])


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [TORCH_FSDP2, MEGATRON_FSDP + ["optim_grads_params"]],
                         ids=["torch-fsdp2", "megatron-fsdp"])
def test_same_seed_same_numbers(corpus, fsdp):
    first = _run(corpus, 2, UNTIE + fsdp)
    assert _run(corpus, 2, UNTIE + fsdp) == first


@pytest.mark.slow
@pytest.mark.parametrize("fsdp, fmt", [
    (TORCH_FSDP2, "torch_dist"),
    (TORCH_FSDP2, "fsdp_dtensor"),
    (MEGATRON_FSDP + ["optim_grads_params"], "fsdp_dtensor"),
    (MEGATRON_FSDP + ["optim_grads"], "torch_dist"),
], ids=["torch-fsdp2-torch_dist", "torch-fsdp2-fsdp_dtensor",
        "megatron-fsdp-fsdp_dtensor", "megatron-fsdp-optim_grads-torch_dist"])
def test_resume_is_bit_exact(corpus, tmp_path, fsdp, fmt):
    """The MTP layers' shards and their optimizer state go through the checkpoint: the
    resumed run repeats the straight run's losses, norms and MTP losses bit for bit."""
    extra = UNTIE + fsdp + ["--ckpt-format", fmt]
    straight = _run(corpus, 2, extra)
    save = str(tmp_path / "ckpt")
    first = _run(corpus, 2, extra + ["--save", save, "--exit-interval", str(N)])
    assert first["iteration"] == N
    resumed = _run(corpus, 2, extra + ["--load", save])
    assert resumed["iteration"] == ITERS
    assert resumed["losses"] == straight["losses"][N:]
    assert resumed["grad_norms"] == straight["grad_norms"][N:]
    assert resumed["mtp"] == straight["mtp"][N:]


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [TORCH_FSDP2, MEGATRON_FSDP + ["optim_grads_params"]],
                         ids=["torch-fsdp2", "megatron-fsdp"])
def test_moe_mtp_layer_under_fsdp_at_ep2_matches_one_process(corpus, fsdp):
    """Every layer MoE, so the MTP depths' layers are too (Megatron-Core gives them the last
    decoder layer's kind): their experts are FSDP2 units over the expert-data-parallel group."""
    single = _run(corpus, 1, UNTIE + MOE)
    got = _run(corpus, 2, UNTIE + MOE + fsdp + ["--expert-model-parallel-size", "2"])
    _close(got, single)


@pytest.mark.slow
def test_moe_resume_is_bit_exact(corpus, tmp_path):
    extra = UNTIE + MOE + TORCH_FSDP2 + ["--expert-model-parallel-size", "2",
                                         "--ckpt-format", "torch_dist"]
    straight = _run(corpus, 2, extra)
    save = str(tmp_path / "ckpt")
    _run(corpus, 2, extra + ["--save", save, "--exit-interval", str(N)])
    resumed = _run(corpus, 2, extra + ["--load", save])
    assert resumed["losses"] == straight["losses"][N:]
    assert resumed["mtp"] == straight["mtp"][N:]
