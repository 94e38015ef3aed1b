"""Generation through a standalone MTP stage (``"Ettmm|L"`` at PP 2, ``"Et|tmm|L"`` at PP 3
where the MTP stage reads the tokens too; float64): the MTP stage hands the loss stage
``[3 s, b, h]``, and the loss stage's logits, with and without the key/value cache, are those
of the same GPT in one process (the same sums: 1e-12). Further from the loss
(``"Ettmm||L"`` at PP 3, ``"Et|tmm||L"`` at PP 4) the empty stages between pass the wide
tensor on."""

import pytest
import torch

from megatron.model import GPTModel
from megatron.text_generation.generation import ForwardStep
from megatron.text_generation.inference_params import InferenceParams
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import BATCH, SEQ, make_batch, make_config, single_process_state

DEPTHS = 2
PROMPT = 5


def _config(layout=None):
    return make_config(position_embedding_type="rope", pipeline_model_parallel_layout=layout)


def _logits(model, pstate, ids, pos):
    """The full forward's logits and the cached prompt-then-one-token-at-a-time ones."""
    full = ForwardStep(model, pstate)(ids, pos)
    cache = InferenceParams(BATCH, SEQ)
    step = ForwardStep(model, pstate, cache)
    pieces = [step(ids[:, :PROMPT], pos[:, :PROMPT])]
    pieces += [step(ids[:, i:i + 1], pos[:, i:i + 1]) for i in range(PROMPT, SEQ)]
    if full is None:
        return None
    return full, torch.cat(pieces, dim=1)


def _pipeline_body(layout, pp):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.layer_layout import is_mtp_standalone_stage

    state = parallel_state.initialize_model_parallel(1, pp)
    model = GPTModel(_config(layout), state, pre_process=state.pp_rank == 0,
                     post_process=state.pp_rank == pp - 1, mtp_num_layers=DEPTHS,
                     mtp_standalone=True,
                     mtp_stage=is_mtp_standalone_stage(layout, pp, state.pp_rank, None))
    model.eval()
    ids, pos, _ = make_batch()
    return _logits(model, state, ids, pos)


@pytest.mark.parametrize("layout, pp", [("Ettmm|L", 2), ("Et|tmm|L", 3), ("Ettmm||L", 3),
                                        ("Et|tmm||L", 4)])
def test_generation_through_a_standalone_mtp_stage_gives_one_process_logits(layout, pp):
    reference = GPTModel(_config(), single_process_state(), mtp_num_layers=DEPTHS)
    reference.eval()
    ids, pos, _ = make_batch()
    pstate = single_process_state()
    pstate.pp_group, pstate.pp_ranks = None, [0]
    want_full, want_cached = _logits(reference, pstate, ids, pos)
    torch.testing.assert_close(want_cached, want_full, rtol=0, atol=1e-12)
    *others, last = run_on_ranks(_pipeline_body, pp, layout, pp)
    assert others == [None] * (pp - 1)
    got_full, got_cached = last
    torch.testing.assert_close(got_full, want_full, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_cached, want_cached, rtol=0, atol=1e-12)
