"""--log-params-norm's norm on 4 gloo ranks (TP = 2 x PP = 2, tied embeddings) against the fp64
norm of the same, unsplit model in one process.

The split counts every parameter once: TP shards on both TP ranks, TP-replicated parameters
(layer norms, row-parallel biases, position embeddings) on TP rank 0 only, and the last stage's
copy of the tied word embedding not at all. Double counting any of them moves the norm by far
more than the tolerance: the norm is accumulated in fp32, rel=1e-6 leaves room for that only.
"""

import types

import pytest
import torch

from megatron.core import parallel_state
from megatron.model import GPTModel
from megatron.training.log import calc_params_l2_norm
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import make_config, single_process_state


def _norm64(model):
    return float(torch.sqrt(sum((p.detach().double() ** 2).sum() for p in model.parameters())))


def _split_body():
    state = parallel_state.initialize_model_parallel(2, 2)
    model = GPTModel(make_config(), state, pre_process=state.is_first_stage(),
                     post_process=state.is_last_stage())
    shared = [n for n, p in model.named_parameters() if getattr(p, "shared", False)]
    return calc_params_l2_norm([model], state), shared


@pytest.mark.slow  # 4 ranks; tests/functional/test_flag_surface.py checks the logged norm
def test_params_norm_tp2_pp2_matches_the_whole_model():
    reference = _norm64(GPTModel(make_config(), single_process_state()))
    results = run_on_ranks(_split_body, 4)
    for norm, _ in results:
        assert norm == pytest.approx(reference, rel=1e-6)
    # The last stage does hold a (shared) copy of the word embedding, which must not count.
    assert any(shared for _, shared in results)


def test_params_norm_one_process_is_the_fp64_norm():
    model = GPTModel(make_config(), single_process_state())
    state = types.SimpleNamespace(tp_rank=0, model_parallel_group=None)
    assert calc_params_l2_norm([model], state) == pytest.approx(_norm64(model), rel=1e-6)
