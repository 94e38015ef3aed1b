"""Multi-latent attention's --cache-mla-latents and --mla-down-proj-fusion.

Latent cache: the same float64 GPT generates through the expanded key/value cache (itself
checked against the full forward in tests/distributed/test_text_generation.py) and through the
latent cache; absorbing the up projection only reorders sums, so the logits of every step agree
to 1e-12 (a wrong head slice of W_uk / W_uv, an unrotated cached key or a missing norm moves
them by 1e-2 or more), and greedy generation gives the same tokens. The cache holds one tensor
of kv_lora_rank + qk_pos_emb_head_dim values per token per layer.

Down-projection fusion: a fused model built from the same seed holds the unfused weights
stacked (rows [q | c + r]); one with other weights that loads the unfused state computes the
same losses and gradients (the fused gradient is the stack of the unfused ones). Checkpoints:
torch_dist stores the fused layer under Megatron-Core's two unfused keys with the unfused
model's shapes (FusedMLASelfAttention's sharded state dict), so each model loads the other's
files; a torch-format state of either spelling loads into either model.
"""

import types

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel
from megatron.text_generation.generation import generate_tokens
from megatron.text_generation.inference_params import InferenceParams
from tests.unit.test_gpt_model import make_batch, make_config, single_process_state

Q, C, R, D, DV = 12, 16, 4, 8, 6
MLA = dict(multi_latent_attention=True, position_embedding_type="rope", normalization="RMSNorm",
           qk_layernorm=True, kv_lora_rank=C, qk_head_dim=D, qk_pos_emb_head_dim=R,
           v_head_dim=DV, init_method_std=0.2)
SINGLE = types.SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, tp_ranks=[0],
                               pp_group=None, pp_size=1, pp_rank=0, pp_ranks=[0])
ATTN = "language_model.encoder.layers.{}.self_attention."


def _model(seed=7, **overrides):
    model_parallel_cuda_manual_seed(1234, 0)
    kw = dict(MLA, q_lora_rank=Q)
    kw.update(overrides)
    return GPTModel(make_config(**kw), single_process_state(), init_seed=seed)


def _cached_logits(model, ids, prompt):
    """Logits of the prompt, then of one token at a time, through one cache."""
    s = ids.size(1)
    pos = torch.arange(s).expand(ids.size(0), s)
    cache = InferenceParams(max_batch_size=ids.size(0), max_sequence_length=s + 3)
    with torch.no_grad():
        steps = [model(ids[:, :prompt], pos[:, :prompt], None, inference_params=cache)]
        cache.sequence_len_offset = prompt
        for t in range(prompt, s):
            steps.append(model(ids[:, t:t + 1], pos[:, t:t + 1], None, inference_params=cache))
            cache.sequence_len_offset += 1
    return torch.cat(steps, dim=1), cache


LATENT_VARIANTS = {
    "q_lora": {},
    "no_q_lora": dict(q_lora_rank=None),
    "sdpa_fused": dict(use_flash_attn=True, mla_down_proj_fusion=True),
    "window_sinks": dict(window_size=(3, 0), window_attn_skip_freq=2, softmax_type="learnable"),
    "yarn": dict(position_embedding_type="yarn", yarn_rotary_scaling_factor=4.0, yarn_mscale=0.9,
                 yarn_mscale_all_dim=0.7, yarn_original_max_position_embeddings=8),
}


@pytest.mark.parametrize("variant", list(LATENT_VARIANTS))
def test_latent_cache_gives_the_expanded_cache_logits_over_a_generation(variant):
    expanded = _model(**LATENT_VARIANTS[variant]).eval()
    latent = _model(cache_mla_latents=True, **LATENT_VARIANTS[variant]).eval()
    ids = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    want, wide = _cached_logits(expanded, ids, 5)
    got, small = _cached_logits(latent, ids, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert sorted(small.key_value_memory_dict) == [1, 2]
    for layer in (1, 2):
        (held,) = small.key_value_memory_dict[layer]
        assert held.shape == (16, 2, C + R)
        keys, values = wide.key_value_memory_dict[layer]
        assert keys.shape == (16, 2, 4, D + R) and values.shape == (16, 2, 4, DV)
        # the cached rotary key is the expanded cache's (shared by every head)
        torch.testing.assert_close(held[:13, :, C:], keys[:13, :, 0, D:], rtol=0, atol=1e-12)


def test_latent_cache_greedy_generation_gives_the_same_tokens_in_float32():
    kw = dict(params_dtype=torch.float32)
    expanded, latent = _model(**kw).eval(), _model(cache_mla_latents=True, **kw).eval()
    tokens = torch.zeros(3, 16, dtype=torch.int64)
    lengths = torch.tensor([2, 6, 4])
    for i, n in enumerate(lengths.tolist()):
        tokens[i, :n] = torch.arange(10 * i, 10 * i + n)
    kw = dict(vocab_size=100, stop_token=127, top_k=1, return_log_probs=True)
    want = generate_tokens(expanded, SINGLE, tokens, lengths, use_kv_cache=True, **kw)
    got = generate_tokens(latent, SINGLE, tokens, lengths, use_kv_cache=True, **kw)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=0, atol=1e-5)
    assert len(set(got.tokens[:, 6:].flatten().tolist())) > 3


def test_latent_cache_swaps_beams_and_is_refused_in_training():
    model = _model(cache_mla_latents=True).eval()
    ids = torch.randint(0, 100, (2, 4), generator=torch.Generator().manual_seed(1))
    _, cache = _cached_logits(model, ids, 4)
    before = cache.key_value_memory_dict[1][0].clone()
    cache.swap_key_value_dict(torch.tensor([1, 0]))
    # Rows past the 4 filled positions are never-written memory (torch.empty), NaN now and then.
    torch.testing.assert_close(cache.key_value_memory_dict[1][0], before[:, [1, 0]], rtol=0,
                               atol=0, equal_nan=True)
    assert not torch.equal(before[:4, 0], before[:4, 1])     # the swap is visible
    ids, pos, labels = make_batch()
    with pytest.raises(ConfigError, match="--cache-mla-latents .*training"):
        model.train()(ids, pos, None, labels=labels)


def _loss_grads(model):
    ids, pos, labels = make_batch()
    loss = model(ids, pos, None, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _fused_view(grads):
    """Unfused gradients with each layer's two down projections stacked as fused."""
    out = dict(grads)
    for layer in (0, 1):
        a = ATTN.format(layer)
        out[a + "linear_qkv_down_proj.weight"] = torch.cat(
            (out.pop(a + "linear_q_down_proj.weight"), out.pop(a + "linear_kv_down_proj.weight")))
    return out


def test_fused_down_projection_draws_the_unfused_weights_stacked():
    unfused, fused = _model(), _model(mla_down_proj_fusion=True)
    want = _fused_view(dict(unfused.named_parameters()))
    got = dict(fused.named_parameters())
    assert sorted(got) == sorted(want)
    assert got[ATTN.format(0) + "linear_qkv_down_proj.weight"].shape == (Q + C + R, 32)
    assert all(torch.equal(got[n], want[n]) for n in got)


def test_fused_down_projection_computes_the_unfused_function_with_copied_weights():
    unfused, fused = _model(), _model(seed=99, mla_down_proj_fusion=True)
    fused.load_state_dict(unfused.state_dict())   # unfused spelling into the fused model
    ref_loss, ref_grads = _loss_grads(unfused)
    loss, grads = _loss_grads(fused)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
    want = _fused_view(ref_grads)
    assert sorted(grads) == sorted(want)
    for n in want:
        torch.testing.assert_close(grads[n], want[n], rtol=0, atol=1e-12, msg=n)


def test_torch_format_states_of_either_spelling_load_into_either_model():
    unfused, fused = _model(), _model(seed=5, mla_down_proj_fusion=True)
    fused_state = fused.state_dict_for_save_checkpoint()
    assert any(k.endswith("linear_qkv_down_proj.weight") for k in fused_state_names(fused_state))
    other = _model(seed=11)
    other.load_state_dict(fused.state_dict())           # fused rows split at --q-lora-rank
    for layer in (0, 1):
        a = ATTN.format(layer)
        w = dict(fused.named_parameters())[a + "linear_qkv_down_proj.weight"]
        got = dict(other.named_parameters())
        assert torch.equal(got[a + "linear_q_down_proj.weight"], w[:Q])
        assert torch.equal(got[a + "linear_kv_down_proj.weight"], w[Q:])
    back = _model(seed=13, mla_down_proj_fusion=True)
    back.load_state_dict(unfused.state_dict())
    for layer in (0, 1):
        a = ATTN.format(layer)
        ref = dict(unfused.named_parameters())
        assert torch.equal(dict(back.named_parameters())[a + "linear_qkv_down_proj.weight"],
                           torch.cat((ref[a + "linear_q_down_proj.weight"],
                                      ref[a + "linear_kv_down_proj.weight"])))


def fused_state_names(state, prefix=""):
    for k, v in state.items():
        if isinstance(v, dict):
            yield from fused_state_names(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def _layout(model):
    from megatron.checkpoint.dist import chunk_layout

    return chunk_layout(model.config, single_process_state())


def test_torch_dist_keeps_megatron_core_unfused_keys_and_round_trips(tmp_path):
    from megatron.checkpoint.dist import (DistCheckpointReader, extra_state_objects,
                                          load_model_state, model_shards, save_shards)
    from megatron.model.module import flatten_state_dict

    unfused, fused = _model(), _model(mla_down_proj_fusion=True)
    for name, model in (("unfused", unfused), ("fused", fused)):
        save_shards(str(tmp_path / name), model_shards(model.state_dict_for_save_checkpoint(),
                                                       _layout(model)))
    a, b = (DistCheckpointReader(str(tmp_path / n)) for n in ("unfused", "fused"))
    assert b.summary() == a.summary()        # same keys, shapes (same seed: same weights)
    attn = "decoder.layers.self_attention."
    assert b.summary()[attn + "linear_q_down_proj.weight"][0] == (2, Q, 32)
    assert b.summary()[attn + "linear_kv_down_proj.weight"][0] == (2, C + R, 32)
    for key in a.tensor_keys():
        out = torch.empty(a.shape(key), dtype=torch.float64)
        other = torch.empty(b.shape(key), dtype=torch.float64)
        a.read(key, (0,) * out.dim(), tuple(out.shape), out=out)
        b.read(key, (0,) * other.dim(), tuple(other.shape), out=other)
        assert torch.equal(out, other), key
    state = fused.state_dict_for_save_checkpoint()
    extra = {o.fqn.split("/")[0] for o in extra_state_objects(
        _layout(fused), 2, list(flatten_state_dict(state)))}
    assert {attn + "linear_q_down_proj._extra_state",
            attn + "linear_kv_down_proj._extra_state"} <= extra
    assert not any("linear_qkv_down_proj" in k for k in extra)
    want = {n: p.detach() for n, p in fused.named_parameters()}   # = unfused's, stacked
    for folder, fuse, seed in (("fused", True, 21), ("unfused", True, 22), ("fused", False, 23)):
        target = _model(seed=seed, mla_down_proj_fusion=fuse)
        loaded = load_model_state(DistCheckpointReader(str(tmp_path / folder)),
                                  target.state_dict_for_save_checkpoint(), _layout(target))
        target.load_state_dict(loaded)
        got = dict(target.named_parameters())
        got = got if fuse else _fused_view(got)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want), (folder, fuse)


def test_fused_placements_split_rows_into_the_two_megatron_core_keys():
    from megatron.checkpoint.dist import ChunkLayout, KeyMappingError, placements

    rank1 = ChunkLayout(num_layers=2, tp_rank=1, tp_size=2, mla=True, mla_q_lora_rank=Q)
    name = ATTN.format(1) + "linear_qkv_down_proj.weight"
    q, kv = placements(name, (Q + C + R, 32), rank1)
    assert (q.key, q.global_shape, q.global_offset, q.local_rows, q.written) == (
        "decoder.layers.self_attention.linear_q_down_proj.weight", (2, Q, 32), (1, 0, 0),
        (0, Q), False)
    assert (kv.key, kv.global_shape, kv.local_rows) == (
        "decoder.layers.self_attention.linear_kv_down_proj.weight", (2, C + R, 32),
        (Q, Q + C + R))
    with pytest.raises(KeyMappingError, match="--q-lora-rank"):
        placements(name, (Q + C + R, 32), ChunkLayout(num_layers=2, mla=True))


def test_flags_parse_and_bad_combinations_name_the_flag():
    from megatron.training.arguments import build_parser

    args = build_parser().parse_args(["--cache-mla-latents", "--mla-down-proj-fusion"])
    assert args.cache_mla_latents and args.mla_down_proj_fusion
    with pytest.raises(ConfigError, match="--mla-down-proj-fusion .*--q-lora-rank"):
        _model(q_lora_rank=None, mla_down_proj_fusion=True)
    for flag in ("cache_mla_latents", "mla_down_proj_fusion"):
        with pytest.raises(ConfigError, match="--multi-latent-attention only"):
            make_config(**{flag: True})


def test_validate_args_refuses_the_options_before_any_process_group():
    from megatron.training.arguments import ArgumentsError, parse_args, validate_args

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 1 "
            "--train-iters 1 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 64").split()
    mla = ["--multi-latent-attention", "--position-embedding-type", "rope"]
    for extra, match in ((["--cache-mla-latents"], "--cache-mla-latents applies to"),
                         (["--mla-down-proj-fusion"], "--mla-down-proj-fusion applies to"),
                         (mla + ["--mla-down-proj-fusion"], "needs --q-lora-rank")):
        with pytest.raises(ArgumentsError, match=match):
            validate_args(parse_args(argv=base + extra))
    args = validate_args(parse_args(argv=base + mla + ["--q-lora-rank", "8",
                                                       "--mla-down-proj-fusion",
                                                       "--cache-mla-latents"]))
    assert args.mla_down_proj_fusion and args.cache_mla_latents
