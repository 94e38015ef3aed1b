"""``--optimizer muon`` under tensor parallelism (TP = 2) against the same run in one process.

With ``--muon-tp-mode duplicated`` each rank gathers a split weight's whole update, orthogonalises
it and keeps its own rows or columns, so the weights after a few steps must equal the
single-process run's. The query/key/value weight is split per query group on both sides, and
the stride-2 SwiGLU projection arrives as a row permutation of the whole matrix, which the
Newton-Schulz iteration commutes with.

Tolerance: the model is float64, the iteration runs in fp32 (``--muon-fp32-matmul-prec high``)
on matrices whose rows the split reorders, so sums run in another order: ~1e-6 relative on the
update, ~1e-8 on weights after three steps at lr 1e-2. 1e-6 is far above that and far below
what a wrong shard, a per-shard orthogonalisation or a scale on the shard's shape gives (the
update changes at O(1), ~1e-3 on weights).
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.model import GPTModel
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.distributed.test_gpt_model_tp import full_tensor
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import loss_and_grads, make_batch, make_config, single_process_state

GQA = dict(num_query_groups=2, swiglu=True, untie_embeddings_and_output_weights=True,
           normalization="RMSNorm")
STEPS = 3


def _config():
    return OptimizerConfig(optimizer="muon", lr=1e-2, weight_decay=0.1, clip_grad=0.0,
                           muon_nesterov=True, muon_fp32_matmul_prec="high")


def _train(model, state, tp_group):
    optimizer = get_megatron_optimizer(_config(), [model], mp_group=tp_group, tp_group=tp_group)
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        loss_and_grads(model, make_batch(seed=step))
        optimizer.step()
    if tp_group is None:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    return {n: full_tensor(p.detach(), p, tp_group, state.tp_size)
            for n, p in model.named_parameters()}


def _tp_body():
    state = parallel_state.initialize_model_parallel(2)
    model = GPTModel(make_config(**GQA), state)
    weights = _train(model, state, state.tp_group)
    return weights if dist.get_rank() == 0 else None


def _single():
    state = single_process_state()
    return _train(GPTModel(make_config(**GQA), state), state, None)


@pytest.mark.slow
def test_muon_tp2_matches_single_process():
    split = run_on_ranks(_tp_body, 2)[0]
    whole = _single()
    assert split.keys() == whole.keys()
    start = {n: p.detach() for n, p in GPTModel(make_config(**GQA),
                                                 single_process_state()).named_parameters()}
    for name in whole:
        assert not torch.equal(whole[name], start[name]), name
        torch.testing.assert_close(split[name], whole[name], rtol=0, atol=1e-6, msg=name)
