"""The GPT under tensor parallelism (TP = 2, 4), with and without sequence parallelism and with
each recompute mode, against the same model in one process (TP = 1).

Each rank's gradient shards are gathered to full tensors (honouring each parameter's
``partition_dim`` and ``partition_stride``), and gradients of parameters marked
``sequence_parallel`` are first all-reduced over the TP group, as the data-parallel wrapper does.

Tolerance: everything runs in float64. The split model computes the same sums in a different
order (partial matmuls summed by all-reduce, per-rank softmax statistics), which changes results
by a few ulps, ~1e-15 relative; 1e-10 absolute on O(1) losses and O(1e-2) gradients leaves a
wide margin over that while any real error (a wrong shard, a missing reduction, a wrong layout)
shows up at 1e-4 or more. Weights are compared bit for bit: they are drawn on the full shape from
the same seed and only then split.

One spawn per world size; each runs all its variants (spawning ranks costs seconds).
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import (
    loss_and_grads,
    make_batch,
    make_config,
    single_process_state,
)

RECOMPUTE = {
    "none": {},
    "uniform": dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1),
    "block": dict(recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),
}
MODERN = dict(position_embedding_type="rope", rotary_percent=0.5, normalization="RMSNorm",
              swiglu=True, num_query_groups=2, untie_embeddings_and_output_weights=True)
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)


def variants(tp):
    """name -> (config overrides, sequence_parallel)."""
    out = {}
    for sp in (False, True):
        for mode, overrides in RECOMPUTE.items():
            out[f"{mode}{'_sp' if sp else ''}"] = (overrides, sp)
    if tp == 2:
        out["modern_nobias_sp"] = (dict(MODERN, add_bias_linear=False), True)
        out["modern_bias"] = (MODERN, False)
    return out


def full_tensor(local, param, group, tp, reduce_sequence_parallel=False):
    """The unsplit tensor from every rank's ``local`` piece of ``param`` (or its gradient)."""
    if reduce_sequence_parallel and getattr(param, "sequence_parallel", False):
        local = local.clone()
        dist.all_reduce(local, group=group)
    if not getattr(param, "tensor_model_parallel", False):
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    dim, stride = param.partition_dim, param.partition_stride
    blocks = [p.chunk(stride, dim) for p in parts]
    return torch.cat([blocks[r][k] for k in range(stride) for r in range(tp)], dim=dim)


def run_split(state, overrides, sp, batch, seed=None, with_weights=False):
    """Loss, full gradients (and full weights) of the TP-split model on this rank."""
    model = GPTModel(make_config(**overrides), state, sequence_parallel=sp)
    if seed is not None:
        model_parallel_cuda_manual_seed(seed, state.tp_rank)
    loss, _ = loss_and_grads(model, batch)
    grads, weights = {}, {}
    for name, p in model.named_parameters():
        grads[name] = full_tensor(p.grad, p, state.tp_group, state.tp_size, True)
        if with_weights:
            weights[name] = full_tensor(p.detach(), p, state.tp_group, state.tp_size)
    return loss, grads, weights


def _tp_body(tp, batch):
    state = parallel_state.initialize_model_parallel(tp)
    results = {}
    for name, (overrides, sp) in variants(tp).items():
        results[name] = run_split(state, overrides, sp, batch, with_weights=(name == "none"))
    model = GPTModel(make_config(), state, parallel_output=False)
    results["logits"] = model(batch[0], batch[1], None)
    return results if dist.get_rank() == 0 else None


def _dropout_body(batch):
    """With dropout on: two identical runs, and each recompute mode, per SP setting."""
    state = parallel_state.initialize_model_parallel(2)
    out = {}
    for sp in (False, True):
        for mode, overrides in RECOMPUTE.items():
            out[(sp, mode)] = run_split(state, dict(DROPOUT, **overrides), sp, batch, seed=99)[:2]
        out[(sp, "repeat")] = run_split(state, DROPOUT, sp, batch, seed=99)[:2]
    return out if dist.get_rank() == 0 else None


def reference(overrides):
    model = GPTModel(make_config(**overrides), single_process_state())
    loss, grads = loss_and_grads(model, make_batch())
    return loss, grads, {n: p.detach() for n, p in model.named_parameters()}, model


def check_against_reference(results, tp):
    refs = {}
    for name, (overrides, _) in variants(tp).items():
        key = "modern_nobias" if "nobias" in name else "modern" if "modern" in name else "base"
        if key not in refs:
            ref_over = dict(MODERN, add_bias_linear=False) if key == "modern_nobias" else (
                MODERN if key == "modern" else {})
            refs[key] = reference(ref_over)
        ref_loss, ref_grads, ref_weights, _ = refs[key]
        loss, grads, weights = results[name]
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10, msg=f"tp={tp} {name}")
        assert grads.keys() == ref_grads.keys()
        for p in grads:
            torch.testing.assert_close(grads[p], ref_grads[p], rtol=0, atol=1e-10,
                                       msg=f"tp={tp} {name} {p}")
        for p in weights:
            assert torch.equal(weights[p], ref_weights[p]), f"tp={tp} weight {p}"
    ids, pos, _ = make_batch()
    ref_logits = refs["base"][3](ids, pos, None)
    torch.testing.assert_close(results["logits"], ref_logits, rtol=0, atol=1e-10)


def test_tp2_matches_single_process():
    check_against_reference(run_on_ranks(_tp_body, 2, 2, make_batch())[0], 2)


def test_tp4_matches_single_process():
    check_against_reference(run_on_ranks(_tp_body, 4, 4, make_batch())[0], 4)


def test_tp2_dropout_reproducible_and_recompute_bit_identical():
    out = run_on_ranks(_dropout_body, 2, make_batch())[0]
    no_dropout = reference({})[0]
    for sp in (False, True):
        base_loss, base_grads = out[(sp, "none")]
        assert abs(base_loss - no_dropout) > 1e-3, "dropout had no effect"
        for mode in ("repeat", "uniform", "block", "selective"):
            loss, grads = out[(sp, mode)]
            assert torch.equal(loss, base_loss), (sp, mode)
            for name in grads:
                assert torch.equal(grads[name], base_grads[name]), (sp, mode, name)
    # sequence parallelism draws hidden dropout per sequence slice: a different mask
    assert not torch.equal(out[(True, "none")][0], out[(False, "none")][0])
