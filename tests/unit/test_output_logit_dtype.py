"""--output-logit-dtype (dest logit_dtype): the output layer's product in fp32 or bf16, as
Megatron-Core's ``logit_dtype`` sets the output GEMM's result dtype. Reference: the same product
in float64 from the model's own (bf16) hidden states and weights."""

import types

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.model import GPTModel
from megatron.training.arguments import parse_args

SEQ, BATCH, VOCAB = 8, 2, 64


def _model(params_dtype, logit_dtype, untie=False):
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
                            seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=params_dtype, logit_dtype=logit_dtype,
                            untie_embeddings_and_output_weights=untie)
    state = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0,
                                  virtual_pp_size=None, virtual_pp_rank=None)
    return GPTModel(cfg, state, init_seed=3)


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)


def _fp64_logits(model, ids, pos):
    hidden = model.language_model(ids, pos, None)                      # [s, b, h] bf16
    weight = (model.shared_embedding_or_output_weight()
              if model.share_embeddings_and_output_weights
              else model.language_model.output_layer.weight)
    return (hidden.double() @ weight.double().t()).transpose(0, 1)    # [b, s, V]


@pytest.mark.parametrize("untie", [False, True])
def test_fp32_logits_of_a_bf16_model_are_the_unrounded_product(untie):
    ids, pos = _batch()
    model = _model(torch.bfloat16, torch.float32, untie)
    with torch.no_grad():
        logits = model(ids, pos, None)
        ref = _fp64_logits(model, ids, pos)
        model.config.logit_dtype = None
        default = model(ids, pos, None)
    assert logits.dtype == torch.float32 and default.dtype == torch.bfloat16
    scale = ref.abs().max().item()
    # fp32 sum of 32 exact products: within a few fp32 ulps of the float64 value.
    assert (logits.double() - ref).abs().max().item() <= 1e-6 * scale
    # The default rounds to bf16 (8 bits of mantissa): visibly farther off, so the test bites.
    assert (default.double() - ref).abs().max().item() > 1e-4 * scale


def test_bf16_logits_round_an_fp32_model_product():
    ids, pos = _batch()
    model = _model(torch.float32, torch.bfloat16)
    with torch.no_grad():
        logits = model(ids, pos, None)
        model.config.logit_dtype = None
        full = model(ids, pos, None)
    assert logits.dtype == torch.bfloat16
    assert torch.equal(logits, full.to(torch.bfloat16))


def test_gradients_flow_through_the_fp32_head():
    ids, pos = _batch()
    model = _model(torch.bfloat16, torch.float32)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    loss = model(ids, pos, None, labels=labels)
    assert loss.dtype == torch.float32
    loss.mean().backward()
    grad = model.shared_embedding_or_output_weight().grad
    assert grad is not None and grad.dtype == torch.bfloat16 and torch.isfinite(grad).all()


def test_flag_parses_to_megatron_dest():
    assert parse_args(argv=["--output-logit-dtype", "fp32"]).logit_dtype == "fp32"
    assert parse_args(argv=[]).logit_dtype is None
    with pytest.raises(SystemExit):
        parse_args(argv=["--output-logit-dtype", "fp16"])
