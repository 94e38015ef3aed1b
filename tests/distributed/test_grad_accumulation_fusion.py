"""--gradient-accumulation-fusion: weight gradients added straight into ``main_grad``.

The reference is plain autograd in float64 on the unsplit layers in one process: after several
micro-batches, each rank's ``main_grad`` (fused or not) must equal its slice of the summed
float64 gradient, and the fused path must really have been taken (no ``.grad`` left, the layer's
accumulation function called once per weight and micro-batch).
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.core.tensor_parallel import layers
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

H, FFN, S, B, MICRO = 6, 8, 5, 3, 3


def _full_weights():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(FFN, H, generator=g, dtype=torch.float64),
            torch.randn(H, FFN, generator=g, dtype=torch.float64))


def _inputs(micro: int):
    g = torch.Generator().manual_seed(100 + micro)
    return torch.randn(S, B, H, generator=g, dtype=torch.float64)


def _reference_grads():
    """Summed float64 gradients of the unsplit column -> tanh -> row MLP."""
    w1, w2 = (w.clone().requires_grad_(True) for w in _full_weights())
    for micro in range(MICRO):
        x = _inputs(micro)
        out = torch.tanh(x @ w1.t()) @ w2.t()
        (out ** 2).sum().backward()
    return w1.grad, w2.grad


class _MLP(torch.nn.Module):
    def __init__(self, tp_group, dtype):
        super().__init__()
        noop = lambda w: None  # noqa: E731 - weights are copied in below
        self.fc1 = tensor_parallel.ColumnParallelLinear(H, FFN, init_method=noop,
                                                        tp_group=tp_group, bias=False,
                                                        params_dtype=dtype)
        self.fc2 = tensor_parallel.RowParallelLinear(FFN, H, init_method=noop, tp_group=tp_group,
                                                     bias=False, input_is_parallel=True,
                                                     params_dtype=dtype)

    def forward(self, x):                                   # [s, b, h]
        hidden, _ = self.fc1(x)                             # [s, b, ffn/tp]
        out, _ = self.fc2(torch.tanh(hidden))               # [s, b, h]
        return out


def _grads_on_rank(fused: bool, dtype_name: str):
    dtype = getattr(torch, dtype_name)
    state = ps.initialize_model_parallel(dist.get_world_size(), 1)
    tp, rank = state.tp_size, state.tp_rank
    model = _MLP(state.tp_group, dtype)
    w1, w2 = _full_weights()
    with torch.no_grad():
        model.fc1.weight.copy_(w1.chunk(tp, 0)[rank])
        model.fc2.weight.copy_(w2.chunk(tp, 1)[rank])
    ddp = DistributedDataParallel(model, dp_group=state.dp_group,
                                  accumulate_allreduce_grads_in_fp32=True,
                                  gradient_accumulation_fusion=fused)
    calls = []
    original = layers._accumulate_into_main_grad

    def counting(weight, grad_2d, input_2d):
        calls.append(tuple(weight.shape))
        return original(weight, grad_2d, input_2d)

    layers._accumulate_into_main_grad = counting
    try:
        for micro in range(MICRO):
            out = ddp(_inputs(micro).to(dtype).requires_grad_(True))
            (out.float() ** 2).sum().backward()
    finally:
        layers._accumulate_into_main_grad = original
    return {"g1": model.fc1.weight.main_grad.double(), "g2": model.fc2.weight.main_grad.double(),
            "grads_left": [p.grad is not None for p in model.parameters()],
            "calls": len(calls), "tp": tp, "rank": rank}


@pytest.mark.parametrize("fused", [True, False])
def test_main_grad_matches_float64_autograd(fused):
    ref1, ref2 = _reference_grads()
    for out in run_on_ranks(_grads_on_rank, 2, fused, "float32"):
        tp, rank = out["tp"], out["rank"]
        torch.testing.assert_close(out["g1"], ref1.chunk(tp, 0)[rank], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["g2"], ref2.chunk(tp, 1)[rank], rtol=1e-5, atol=1e-5)
        assert out["grads_left"] == [False, False]
        assert out["calls"] == (2 * MICRO if fused else 0)


def test_bf16_activations_accumulate_in_fp32_main_grad():
    ref1, ref2 = _reference_grads()
    out = run_on_ranks(_grads_on_rank, 1, True, "bfloat16")[0]
    assert out["calls"] == 2 * MICRO
    # bf16 weights and activations: the tolerance is bf16's, the sum is still exact in fp32.
    torch.testing.assert_close(out["g1"], ref1, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(out["g2"], ref2, rtol=5e-2, atol=5e-2)


@pytest.mark.slow  # the main_grad tests above check the fused accumulation against fp64
def test_training_losses_same_with_and_without_fusion(tmp_path):
    data = write_counting_corpus(str(tmp_path / "data" / "counting"))
    flags = gpt_flags(data, 4, tp=2, dropout=0.0)
    fused = run_on_ranks(run_pretrain, 2, flags)[0]["losses"]
    plain = run_on_ranks(run_pretrain, 2, flags + ["--no-gradient-accumulation-fusion"])[0]
    assert len(fused) == 4
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain["losses"]), rtol=1e-5,
                               atol=1e-6)


# -- word embedding tied to the output layer ---------------------------------------------------

V = 8


def _embedding_weight():
    return torch.randn(V, H, generator=torch.Generator().manual_seed(11), dtype=torch.float64)


def _ids(micro: int):
    # Repeated ids: rows that receive several gradients in one backward.
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(200 + micro))


def _reference_tied_grad():
    """float64 gradient of the tied table: lookup -> tanh -> logits against the same table."""
    w = _embedding_weight().requires_grad_(True)
    for micro in range(MICRO):
        x = torch.tanh(torch.nn.functional.embedding(_ids(micro), w)).transpose(0, 1)
        ((x @ w.t()) ** 2).sum().backward()
    return w.grad


class _TiedLM(torch.nn.Module):
    def __init__(self, tp_group, tied: bool):
        super().__init__()
        self.tp_group, self.tied = tp_group, tied
        self.embedding = tensor_parallel.VocabParallelEmbedding(
            V, H, init_method=lambda w: None, tp_group=tp_group, params_dtype=torch.float32)

    def forward(self, ids):                                          # [b, s]
        from megatron.model.language_model import parallel_lm_logits

        x = torch.tanh(self.embedding(ids)).transpose(0, 1)          # [s, b, h]
        if not self.tied:
            return x
        return parallel_lm_logits(x, self.embedding.weight, self.tp_group, False)  # [s, b, V/tp]


def _tied_grads_on_rank(fused: bool, tied: bool, detaching_hooks: bool = False):
    state = ps.initialize_model_parallel(dist.get_world_size(), 1)
    tp, rank = state.tp_size, state.tp_rank
    model = _TiedLM(state.tp_group, tied)
    with torch.no_grad():
        model.embedding.weight.copy_(_embedding_weight().chunk(tp, 0)[rank])
    ddp = DistributedDataParallel(model, dp_group=state.dp_group, overlap_grad_reduce=True,
                                  gradient_accumulation_fusion=fused)
    weight_grads = []
    original = layers.EmbeddingWithGradAccumulation.backward

    def recording(ctx, grad_output):
        grads = original(ctx, grad_output)
        weight_grads.append(grads[1] is not None)
        return grads

    layers.EmbeddingWithGradAccumulation.backward = staticmethod(recording)
    # Saved-tensor hooks that hand back detached aliases (as activation offloading and memory
    # probes do): attributes of the saved tensors, such as main_grad, are lost through them.
    hooks = (torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t)
             if detaching_hooks else contextlib.nullcontext())
    try:
        for micro in range(MICRO):
            with ddp.no_sync() if micro < MICRO - 1 else contextlib.nullcontext(), hooks:
                (ddp(_ids(micro)).float() ** 2).sum().backward()
    finally:
        layers.EmbeddingWithGradAccumulation.backward = staticmethod(original)
    buffer = ddp.param_to_grad_buffer[model.embedding.weight]
    return {"grad": model.embedding.weight.main_grad.double(), "tp": tp, "rank": rank,
            "grad_left": model.embedding.weight.grad is not None,
            "hook_ran": buffer.param_to_bucket[model.embedding.weight].communication_issued,
            "weight_grads": weight_grads}


@pytest.mark.parametrize("fused", [True, False])
def test_tied_embedding_and_output_layer_accumulate_into_main_grad(fused):
    """Lookup and output layer share one table: its ``main_grad`` must hold both parts, the
    fused lookup must hand autograd no second placeholder (the output layer's is enough for the
    hook, which must still run: with overlapped reduction it launches the bucket)."""
    ref = _reference_tied_grad()
    for out in run_on_ranks(_tied_grads_on_rank, 2, fused, True):
        tp, rank = out["tp"], out["rank"]
        torch.testing.assert_close(out["grad"], ref.chunk(tp, 0)[rank], rtol=1e-5, atol=1e-5)
        assert not out["grad_left"] and out["hook_ran"]
        assert out["weight_grads"] == ([False] * MICRO if fused else [])


@pytest.mark.parametrize("detaching_hooks", [False, True])
def test_fused_embedding_alone_matches_float64_autograd(detaching_hooks):
    w = _embedding_weight().requires_grad_(True)
    for micro in range(MICRO):
        (torch.tanh(torch.nn.functional.embedding(_ids(micro), w)) ** 2).sum().backward()
    out = run_on_ranks(_tied_grads_on_rank, 1, True, False, detaching_hooks)[0]
    torch.testing.assert_close(out["grad"], w.grad, rtol=1e-5, atol=1e-5)
    # Alone, the lookup hands autograd the placeholder that makes the hook run.
    assert out["weight_grads"] == [True] * MICRO
    assert not out["grad_left"] and out["hook_ran"]
