"""The numerics flags under tensor parallelism (TP = 2, with and without sequence parallelism)
against the same model in one process.

The flags that touch sharded or replicated-but-partial weights are on together:
``--init-method-xavier-uniform`` (drawn on the full shape, so the split weights must equal the
single-process ones bit for bit), ``--qk-layernorm`` (replicated norms fed with each rank's own
heads: their gradients are partial and must be summed by ``finalize_model_grads`` whether or not
sequence parallelism is on), ``--apply-layernorm-1p``, ``--squared-relu``, and rotary with
``--rotary-interleaved`` and ``--rotary-seq-len-interpolation-factor``.

Tolerance as in ``test_gpt_model_tp.py``: float64, the split only reorders sums (~1e-15
relative); 1e-10 absolute on O(1) losses and O(1e-2) gradients, while a missing reduction or a
wrong shard moves them by 1e-4 or more.
"""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.finalize_model_grads import _allreduce_layernorm_grads
from megatron.model import GPTModel
from tests.distributed.test_gpt_model_tp import full_tensor
from tests.multiprocess import run_on_ranks
from tests.unit.test_gpt_model import loss_and_grads, make_batch, make_config, single_process_state

FLAGS = dict(init_method_xavier_uniform=True, qk_layernorm=True, apply_layernorm_1p=True,
             squared_relu=True, position_embedding_type="rope", rotary_interleaved=True,
             rotary_seq_len_interpolation_factor=2, untie_embeddings_and_output_weights=True)
VARIANTS = {"flags": (FLAGS, False), "flags_sp": (FLAGS, True),
            "flags_rms_sp": (dict(FLAGS, normalization="RMSNorm", apply_layernorm_1p=False), True),
            # gpt-oss's gated MLP: [gate; linear] split with stride 2, clamped, linear half
            # + 1 (in place of --squared-relu).
            "quick_geglu_sp": (dict(FLAGS, squared_relu=False, quick_geglu=True,
                                    glu_linear_offset=1.0, activation_func_clamp_value=0.1),
                               True)}


def _perturb_norms(model):
    """Norm weights away from their initial zeros (same values on every rank), so that their
    gradients and the 1p form are exercised with non-trivial values."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _tp_body(batch):
    state = parallel_state.initialize_model_parallel(2)
    out = {}
    for name, (overrides, sp) in VARIANTS.items():
        model = GPTModel(make_config(**overrides), state, sequence_parallel=sp)
        weights = {n: full_tensor(p.detach(), p, state.tp_group, 2).clone()
                   for n, p in model.named_parameters()}
        _perturb_norms(model)
        loss, _ = loss_and_grads(model, batch)
        _allreduce_layernorm_grads([model], state.tp_group, sp)
        grads = {n: full_tensor(p.grad, p, state.tp_group, 2)
                 for n, p in model.named_parameters()}
        out[name] = (loss, grads, weights)
    return out if dist.get_rank() == 0 else None


def test_tp2_matches_single_process_with_numerics_flags():
    results = run_on_ranks(_tp_body, 2, make_batch())[0]
    for name, (overrides, _) in VARIANTS.items():
        ref = GPTModel(make_config(**overrides), single_process_state())
        ref_weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
        _perturb_norms(ref)
        ref_loss, ref_grads = loss_and_grads(ref, make_batch())
        loss, grads, weights = results[name]
        assert any("q_layernorm" in n for n in grads)
        for n in ref_weights:
            assert torch.equal(weights[n], ref_weights[n]), f"{name} weight {n}"
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10, msg=name)
        assert grads.keys() == ref_grads.keys()
        for n in grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=0, atol=1e-10,
                                       msg=f"{name} {n}")
