"""Training with the MoE variants (``--moe-latent-size``, GLU-interleaved experts and shared
expert, ``--mlp-chunks-for-training``, ``--moe-enable-routing-replay`` present but unused): the
model learns, EP 2 gives the one-process losses, and a resumed run (PP 2, either checkpoint
format) continues bit for bit. A torch_dist save at TP 2 holds the interleaved fc1 tensors in
Megatron-Core's order for that TP size, and loads at TP 1. The model and tolerances are test_moe_training.py's.
"""

import os

import pytest
import torch

from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.gpt_runs import run_pretrain
from tests.functional.test_moe_training import (_check_parity, _flags, _losses,  # noqa: F401
                                                _train_logged, corpus)
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow
VARIANTS = ("--swiglu", "--disable-bias-linear", "--moe-latent-size", "16",
            "--moe-mlp-glu-interleave-size", "4", "--moe-shared-expert-intermediate-size", "32",
            "--moe-shared-expert-glu-interleave-size", "8", "--moe-enable-routing-replay")


def test_ep2_matches_one_process(corpus, tmp_path):
    base = _train_logged(corpus, str(tmp_path / "one"), extra=VARIANTS)
    out = _train_logged(corpus, str(tmp_path / "ep2"), 1, 1, 2, extra=VARIANTS + (
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"))
    _check_parity(base, out)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_bit_exact(corpus, tmp_path, fmt):
    """6 iterations straight == 3, save, new processes load and run 3 more (PP 2)."""
    n, kw = 3, dict(pp=2, iters=6)
    flags = list(VARIANTS) + ["--mlp-chunks-for-training", "2", "--ckpt-format", fmt]
    straight = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw, extra=flags))[-1]
    save = str(tmp_path / "ckpt")
    first = run_on_ranks(run_pretrain, 2, _flags(
        corpus, **kw, extra=flags + ["--save", save, "--exit-interval", str(n)]))[-1]
    second = run_on_ranks(run_pretrain, 2, _flags(corpus, **kw,
                                                  extra=flags + ["--load", save]))[-1]
    assert _losses(first) == _losses(straight)[:n]
    assert _losses(second) == _losses(straight)[n:], (straight, second)


def _megatron_order(whole, tp, axis):
    """Megatron-Core's stored order of an interleaved fc1 saved at TP ``tp``: each rank's
    contiguous run of the whole interleaved rows cut in two halves, all first halves before
    all second halves."""
    local = whole.chunk(tp, dim=axis)
    return torch.cat([t.chunk(2, dim=axis)[0] for t in local]
                     + [t.chunk(2, dim=axis)[1] for t in local], dim=axis)


def test_tp2_torch_dist_is_megatron_cores_order_and_loads_at_tp1(corpus, tmp_path):
    """One step at TP 2 and at TP 1 (the same model): the TP 2 file holds the interleaved fc1
    tensors in Megatron-Core's TP 2 order of the TP 1 file's whole weight; TP 1 resumes from
    either file with the same loss (with the distributed optimizer at DP 2 too, which reads
    its bands of the moments)."""
    flags = list(VARIANTS) + ["--ckpt-format", "torch_dist", "--exit-interval", "1"]
    saves = {}
    for tp in (1, 2):
        saves[tp] = str(tmp_path / f"tp{tp}")
        run_on_ranks(run_pretrain, tp, _flags(corpus, tp=tp, iters=2, extra=flags + [
            "--save", saves[tp], "--save-interval", "1"]))
    one, two = (DistCheckpointReader(os.path.join(saves[tp], "iter_0000001"))
                for tp in (1, 2))
    args = two.common_state()["args"]
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    for key, tp in (("decoder.layers.mlp.experts.experts.linear_fc1.weight", etp),
                    ("decoder.layers.mlp.shared_experts.linear_fc1.weight", 2)):
        whole, stored = one.read(key), two.read(key)
        axis = whole.dim() - 2
        assert torch.allclose(stored, _megatron_order(whole, tp, axis), rtol=0, atol=1e-5), key
        assert not torch.allclose(stored, whole, rtol=0, atol=1e-2), key
    for ranks, extra in ((1, []), (2, ["--use-distributed-optimizer"])):   # DP 1, DP 2
        resumed = [run_on_ranks(run_pretrain, ranks, _flags(corpus, iters=2, extra=list(
            VARIANTS) + extra + ["--ckpt-format", "torch_dist", "--load", saves[tp]]))[-1]
            for tp in (1, 2)]
        assert [i for i, _ in resumed[1]["losses"]] == [2]
        # rows read in the stored order instead move these by about 3e-4
        assert abs(_losses(resumed[0])[0] - _losses(resumed[1])[0]) <= 1e-5, (ranks, resumed)
        valid = [r["valid"]["lm loss"] for r in resumed]
        assert abs(valid[0] - valid[1]) <= 1e-5, (ranks, resumed)
