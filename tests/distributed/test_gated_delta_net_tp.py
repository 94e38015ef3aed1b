"""Gated delta net layers (--experimental-attention-variant gdn) under tensor parallelism (TP = 2,
with and without sequence parallelism) against the same model in one process.

Each rank holds whole key and value heads: its rows of ``in_proj`` are the r-th slice of each of
the q, k, v, z, b, a sections, and of ``conv1d`` the r-th slice of q, k, v. The test puts the
full tensors back together by those sections (not by a plain concatenation), so a wrong deal
fails. Weights are drawn on the full shape and dealt out, so they must be equal bit for bit;
loss and gradients agree within float64 rounding (1e-10: the split sums in another order).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.model import GPTModel
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import loss_and_grads, make_batch, make_config

NK, NV, DK, DV = 2, 4, 8, 6
GDN = dict(num_layers=3, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
           experimental_attention_variant="gdn", linear_attention_freq=(1, 0, 1),
           linear_conv_kernel_dim=4, linear_key_head_dim=DK, linear_value_head_dim=DV,
           linear_num_key_heads=NK, linear_num_value_heads=NV)
SECTIONS = {"in_proj.weight": [NK * DK, NK * DK, NV * DV, NV * DV, NV, NV],
            "conv1d.weight": [NK * DK, NK * DK, NV * DV]}


def _full(local, name, param, group, tp):
    """The unsplit tensor of ``param`` (or its gradient) from every rank's ``local`` piece."""
    if getattr(param, "sum_grad_over_tp", False) or getattr(param, "sequence_parallel", False):
        if local is param.grad:
            local = local.clone()
            dist.all_reduce(local, group=group)
    if not getattr(param, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim = param.partition_dim
    sections = next((s for key, s in SECTIONS.items() if name.endswith(key)), None)
    if sections is None:
        stride = param.partition_stride
        blocks = [p.chunk(stride, dim) for p in parts]
        return torch.cat([blocks[r][k] for k in range(stride) for r in range(tp)], dim=dim)
    pieces = [p.split([s // tp for s in sections], dim=0) for p in parts]
    return torch.cat([pieces[r][i] for i in range(len(sections)) for r in range(tp)], dim=0)


def _body(batch):
    state = parallel_state.initialize_model_parallel(2)
    out = {}
    for sp in (False, True):
        model = GPTModel(make_config(**GDN), state, sequence_parallel=sp)
        loss, _ = loss_and_grads(model, batch)
        grads, weights = {}, {}
        for name, p in model.named_parameters():
            grads[name] = _full(p.grad, name, p, state.tp_group, 2)
            weights[name] = _full(p.detach(), name, p, state.tp_group, 2)
        out[sp] = (loss, grads, weights)
    return out if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_tp2_matches_single_process():
    from tests.unit.test_gpt_model import single_process_state
    results = run_on_ranks(_body, 2, make_batch())[0]
    model = GPTModel(make_config(**GDN), single_process_state())
    ref_loss, ref_grads = loss_and_grads(model, make_batch())
    names = [n for n, _ in model.named_parameters()]
    assert any("in_proj" in n for n in names) and any("query_key_value" in n for n in names)
    for sp, (loss, grads, weights) in results.items():
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10, msg=f"sp={sp}")
        for name, param in model.named_parameters():
            assert torch.equal(weights[name], param.detach()), f"sp={sp} {name}"
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=1e-10,
                                       msg=f"sp={sp} {name}")
