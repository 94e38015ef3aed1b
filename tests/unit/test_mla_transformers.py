"""The GPT model with --multi-latent-attention against transformers' own DeepSeek-V3 (built here
from a tiny config, dense layers only, never downloaded): with the same weights, placed by
the name table below, the logits must agree in fp32 (rope, and YaRN with its mscales)."""

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from megatron.core.config import TransformerConfig  # noqa: E402
from megatron.model.gpt_model import GPTModel  # noqa: E402

H, HEADS, LAYERS, VOCAB, FFN = 32, 4, 2, 64, 48
D, R, DV, C = 8, 4, 6, 16


def _hf(q_lora_rank, rope):
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN, num_hidden_layers=LAYERS,
        first_k_dense_replace=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank, kv_lora_rank=C, qk_nope_head_dim=D, qk_rope_head_dim=R,
        v_head_dim=DV, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters=rope, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0, 0.2)
    return model


def _ours(q_lora_rank, **rope_kw):
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, padded_vocab_size=VOCAB,
        max_position_embeddings=64, seq_length=16, ffn_hidden_size=FFN, hidden_dropout=0.0,
        attention_dropout=0.0, normalization="RMSNorm", layernorm_epsilon=1e-6, swiglu=True,
        add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True,
        multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=C, qk_head_dim=D,
        qk_pos_emb_head_dim=R, v_head_dim=DV, **rope_kw)
    pstate = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0)
    return GPTModel(config, pstate, parallel_output=False).eval()


def _hf_name(ours: str) -> str:
    """The transformers name of one of our parameters (layer tensors by table)."""
    top = {"language_model.embedding.word_embeddings.weight": "model.embed_tokens.weight",
           "language_model.encoder.final_layernorm.weight": "model.norm.weight",
           "language_model.output_layer.weight": "lm_head.weight"}
    if ours in top:
        return top[ours]
    layer, rest = ours.split("language_model.encoder.layers.")[1].split(".", 1)
    table = {"input_layernorm.weight": "input_layernorm.weight",
             "post_attention_layernorm.weight": "post_attention_layernorm.weight",
             "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
             "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
             "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
             "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
             "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
             "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
             "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
             "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
             "mlp.dense_4h_to_h.weight": "mlp.down_proj.weight"}
    return f"model.layers.{layer}.{table[rest]}"


def _load_hf_weights(ours: GPTModel, hf) -> None:
    theirs = dict(hf.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith("mlp.dense_h_to_4h.weight"):
                prefix = "model.layers." + name.split("layers.")[1].split(".")[0] + ".mlp."
                param.copy_(torch.cat([theirs[prefix + "gate_proj.weight"],
                                       theirs[prefix + "up_proj.weight"]]))
            else:
                param.copy_(theirs[_hf_name(name)])


YARN_HF = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
           "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
           "mscale": 0.9, "mscale_all_dim": 0.7}
YARN_OURS = dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0,
                 yarn_original_max_position_embeddings=8, yarn_beta_fast=32.0,
                 yarn_beta_slow=1.0, yarn_mscale=0.9, yarn_mscale_all_dim=0.7)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("rope", ["rope", "yarn"])
def test_mla_gpt_logits_match_transformers_deepseek_v3(q_lora_rank, rope):
    if rope == "rope":
        hf = _hf(q_lora_rank, {"rope_type": "default", "rope_theta": 10000.0})
        ours = _ours(q_lora_rank, position_embedding_type="rope")
    else:
        hf = _hf(q_lora_rank, dict(YARN_HF))
        ours = _ours(q_lora_rank, **YARN_OURS)
    _load_hf_weights(ours, hf)
    # every HF tensor is used: gate_proj and up_proj make one fused fc1 per layer
    assert len(dict(ours.named_parameters())) + LAYERS == len(dict(hf.named_parameters()))
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = hf(tokens).logits
        got = ours(tokens, None, None)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_cached_decoding_gives_the_full_forward_logits(q_lora_rank):
    """Generation's key/value cache: a prompt, then one token at a time, equals one forward."""
    from megatron.text_generation.inference_params import InferenceParams

    torch.manual_seed(1)
    model = _ours(q_lora_rank, **YARN_OURS)
    seq = 10
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(seq).expand(2, seq)
    with torch.no_grad():
        full = model(ids, pos, None)
        cache, prompt = InferenceParams(2, seq), seq - 4
        steps = [model(ids[:, :prompt], pos[:, :prompt], None, inference_params=cache)]
        cache.sequence_len_offset = prompt
        for i in range(prompt, seq):
            steps.append(model(ids[:, i:i + 1], pos[:, i:i + 1], None, inference_params=cache))
            cache.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
