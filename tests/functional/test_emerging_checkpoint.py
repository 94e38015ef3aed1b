"""``--optimizer soap`` and ``adaptive_muon`` with ``--ckpt-format torch_dist``.

References: the run that never stopped (dropout off: a resume at the same layout repeats the
same arithmetic, so its losses must be identical; one at another TP size sums in another
order, within ``LOSS_ATOL``), the same weight-space state at two TP sizes after one step,
and the keys and global shapes Megatron-Core's optimizer-state
mapping gives a parameter-shaped state (``optimizer.state.<state name>.<model key>``, the
weight's global shape: :mod:`megatron.checkpoint.emerging_state` says what the square factors
add).
"""

import os

import pytest

from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

N = 3  # iterations before the checkpoint, and after it
# SwiGLU: fc1's global rows are [gate | value], not the TP pieces in rank order.
MODEL = ["--num-query-groups", "2", "--swiglu", "--untie-embeddings-and-output-weights",
         "--ckpt-format", "torch_dist", "--lr-decay-style", "constant"]
# A TP=2 run sums its partial products in another order than one process. Adaptive Muon's
# losses then differ by about 1e-5 within a few steps; SOAP's by up to 1e-1 (the eigenvectors
# inside the first factors' null spaces are arbitrary, and Adam's per-coordinate scaling in
# them amplifies any rounding), so its bound only says the moved state is not lost: a load
# without it lands about 6e-2 away. The exact move is tests/unit/test_emerging_state.py's.
LOSS_ATOL = {"adaptive_muon": 1e-4, "soap": 2e-3}
MATRICES = ("decoder.layers.self_attention.linear_qkv.weight",
            "decoder.layers.self_attention.linear_proj.weight",
            "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
            # 2-D and not marked an embedding: Megatron-Core's Muon rule steps it as a matrix
            "embedding.position_embeddings.weight")
ADAMW = ("embedding.word_embeddings.weight", "output_layer.weight",
         "decoder.final_layernorm.weight",
         "decoder.layers.mlp.linear_fc1.layer_norm_weight")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _run(corpus, optimizer, extra, ranks=1):
    argv = gpt_flags(corpus, 2 * N, dropout=0.0, micro_batch=1,
                     extra=["--optimizer", optimizer, *MODEL, *extra])
    return run_on_ranks(run_pretrain, ranks, argv)[-1]


def _losses(out, first=1):
    assert [i for i, _ in out["losses"]] == list(range(first, 2 * N + 1))
    return [loss for _, loss in out["losses"]]


def _expected_shapes(reader, optimizer):
    """Global shapes by key: the weight's own (its model key's) for each parameter-shaped
    state, as Megatron-Core's mapping gives it; the whole factors' for SOAP's square ones,
    stacked on the weight's layer axis."""
    out = {}
    fields = ("exp_avg", "exp_avg_sq") if optimizer == "soap" else ("momentum_buffer",
                                                                    "moment2_buffer")
    for key in MATRICES:
        shape = tuple(reader.shape(key))
        for field in fields:
            out[f"optimizer.state.{field}.{key}"] = shape
        if optimizer == "soap":
            *layers, rows, cols = shape
            for field, n in (("L", rows), ("Q_L", rows), ("R", cols), ("Q_R", cols)):
                out[f"optimizer.state.{field}.{key}"] = (*layers, n, n)
    for key in ADAMW:
        for field in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer.state.{field}.{key}"] = tuple(reader.shape(key))
    return out


def _check_file(save, optimizer, main_copies=False):
    reader = DistCheckpointReader(os.path.join(save, f"iter_{N:07d}"))
    saved = {k: tuple(reader.shape(k)) for k in reader.tensor_keys()
             if k.startswith("optimizer.")}
    expected = _expected_shapes(reader, optimizer)
    if main_copies:  # a bf16 model's fp32 main weights, Megatron-Core's fp32_param
        expected.update({f"optimizer.state.fp32_param.{key}": tuple(reader.shape(key))
                         for key in MATRICES + ADAMW})
    for key, shape in expected.items():
        assert saved.get(key) == shape, (key, saved.get(key), shape)
    # Nothing else under optimizer.state: no momentum for SOAP, no factors for adaptive Muon,
    # no matrix state of the AdamW part's parameters.
    extra = {k for k in saved if k not in expected and "bias" not in k
             and "layer_norm" not in k and "layernorm" not in k}
    assert not extra, extra
    step = reader.common_state()["optimizer"]["state"]["common_step"]
    assert int(step) == N


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,extra", [("soap", []), ("adaptive_muon", []),
                                             ("soap", ["--bf16"])])
def test_resumes_bit_for_bit_and_writes_megatron_core_keys(corpus, tmp_path, optimizer, extra):
    save = str(tmp_path / "ckpt")
    straight = _losses(_run(corpus, optimizer, extra + ["--save", save, "--save-interval",
                                                        str(N)]))
    _check_file(save, optimizer, main_copies=bool(extra))
    load = extra + ["--load", save, "--ckpt-step", str(N)]
    assert _losses(_run(corpus, optimizer, load), first=N + 1) == straight[N:]
    fresh = _losses(_run(corpus, optimizer, load + ["--no-load-optim"]), first=N + 1)
    assert fresh[1] != straight[N + 1]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["soap", "adaptive_muon"])
def test_tp2_resumes_bit_for_bit_and_loads_at_tp1(corpus, tmp_path, optimizer):
    save = str(tmp_path / "tp2")
    tp2 = ["--tensor-model-parallel-size", "2"]
    straight = _losses(_run(corpus, optimizer, tp2 + ["--save", save, "--save-interval",
                                                      str(N)], ranks=2))
    _check_file(save, optimizer)
    load = ["--load", save, "--ckpt-step", str(N)]
    assert _losses(_run(corpus, optimizer, tp2 + load, ranks=2), first=N + 1) == straight[N:]
    one = _losses(_run(corpus, optimizer, load), first=N + 1)
    for i, (a, b) in enumerate(zip(one, straight[N:])):
        assert abs(a - b) <= LOSS_ATOL[optimizer], (i, one, straight[N:])
    fresh = _losses(_run(corpus, optimizer, load + ["--no-load-optim"]), first=N + 1)
    assert abs(fresh[1] - straight[N + 1]) > 10 * LOSS_ATOL[optimizer]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["soap", "adaptive_muon"])
def test_layer_wise_deal_resumes_bit_for_bit_at_dp2(corpus, tmp_path, optimizer):
    save = str(tmp_path / "dealt")
    deal = ["--use-distributed-optimizer"]
    straight = _losses(_run(corpus, optimizer, deal + ["--save", save, "--save-interval",
                                                       str(N)], ranks=2))
    _check_file(save, optimizer)
    load = ["--load", save, "--ckpt-step", str(N)]
    assert _losses(_run(corpus, optimizer, deal + load, ranks=2), first=N + 1) == straight[N:]


def _matrix_state(save, key, fields):
    reader = DistCheckpointReader(os.path.join(save, "iter_0000001"))
    return {f: reader.read(f"optimizer.state.{f}.{key}").double() for f in fields}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["soap", "adaptive_muon"])
def test_file_does_not_depend_on_the_tensor_parallel_size(corpus, tmp_path, optimizer):
    """After one step every weight-space quantity is the same at TP 1 and TP 2 up to rounding:
    SOAP's factors and its momentum brought back from the eigenbasis (Q_L exp_avg Q_R^T;
    the eigenbases themselves are arbitrary inside the first factors' null spaces),
    adaptive Muon's momentum and second moment. SwiGLU's fc1 is where the TP pieces in rank
    order are not the global rows."""
    files = {}
    for tp in (1, 2):
        files[tp] = str(tmp_path / f"tp{tp}")
        argv = gpt_flags(corpus, 2, dropout=0.0, micro_batch=1, extra=[
            "--optimizer", optimizer, *MODEL, "--tensor-model-parallel-size", str(tp),
            "--muon-fp32-matmul-prec", "high", "--save", files[tp], "--save-interval", "1"])
        run_on_ranks(run_pretrain, tp, argv)
    fields = ("L", "R", "Q_L", "Q_R", "exp_avg") if optimizer == "soap" else (
        "momentum_buffer", "moment2_buffer")
    for key in MATRICES:
        one, two = (_matrix_state(files[tp], key, fields) for tp in (1, 2))
        if optimizer == "soap":
            for state in (one, two):
                state["momentum"] = state["Q_L"] @ state["exp_avg"] @ state["Q_R"].mT
            fields_compared = ("L", "R", "momentum")
        else:
            fields_compared = fields
        for field in fields_compared:
            a, b = one[field], two[field]
            scale = a.abs().max().item()
            assert scale > 0 and (a - b).abs().max().item() <= 1e-4 * scale, (key, field)
