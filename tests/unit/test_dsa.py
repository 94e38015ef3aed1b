"""DeepSeek sparse attention (--experimental-attention-variant dsa) against references written
here in fp64: the indexer by hand (explicit projections, a LayerNorm, half-split rotation with
cos and sin, the Hadamard matrix built by Kronecker products, per-head ReLU scores), the
attention as MLA with an explicit top-k mask, the indexer loss as an explicit KL divergence;
and against transformers' DeepseekV32Attention with the same weights."""

import math

import pytest
import torch

from megatron.core.config import TransformerConfig
from megatron.core.utils import init_method_normal
from megatron.model.dsa import hadamard_rotate, index_scores, select_topk
from megatron.model.multi_latent_attention import MultiLatentAttention
from megatron.model.rotary_pos_embedding import build_rotary_embedding
from megatron.training.arguments import ArgumentsError, parse_args, validate_args

H, HEADS, D, R, DV, C, QL = 32, 4, 8, 4, 6, 16, 12
IH, ID = 8, 8                                  # indexer heads, indexer head dim
S, B = 7, 2


def _config(**kw):
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=HEADS, padded_vocab_size=64,
                max_position_embeddings=64, seq_length=16, attention_dropout=0.0,
                hidden_dropout=0.0, params_dtype=torch.float64, normalization="RMSNorm",
                layernorm_epsilon=1e-6, qk_layernorm=True, add_bias_linear=False,
                position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=QL,
                kv_lora_rank=C, qk_head_dim=D, qk_pos_emb_head_dim=R, v_head_dim=DV,
                experimental_attention_variant="dsa", dsa_indexer_n_heads=IH,
                dsa_indexer_head_dim=ID, dsa_indexer_topk=3, dsa_indexer_k_norm_epsilon=1e-6)
    base.update(kw)
    return TransformerConfig(**base)


def _module(config, seed=3):
    torch.manual_seed(seed)
    init = init_method_normal(0.3)
    module = MultiLatentAttention(config, 1, None, 1, False, init, init)
    with torch.no_grad():     # norms away from identity, so a missing weight or bias shows
        for name, param in module.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.uniform_(-.3, .3)
    return module


def _x(seed=1):
    return torch.randn(S, B, H, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _hadamard(n):
    m = torch.ones(1, 1, dtype=torch.float64)
    while m.size(0) < n:
        m = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), m)
    return m / math.sqrt(n)


def _rms(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rotate_halves(v, pos, inv_freq):
    """Channels (i, i + r/2) of v [r] at position pos turned by pos * inv_freq[i]."""
    half = v.numel() // 2
    out = v.clone()
    for i in range(half):
        c, s = math.cos(pos * inv_freq[i]), math.sin(pos * inv_freq[i])
        out[i], out[i + half] = v[i] * c - v[i + half] * s, v[i] * s + v[i + half] * c
    return out


def _naive_index_scores(module, x, relu=True, rotate=True, interleaved=False, grad=False):
    """fp64 indexer scores [b, s, s] (-inf above the diagonal), token by token (``grad``: from
    the module's parameters themselves, for autograd)."""
    p = {k: v if grad else v.detach() for k, v in module.named_parameters()}
    pre = "core_attention.indexer."
    qr = _rms(x @ p["linear_q_down_proj.weight"].T, p["q_layernorm.weight"])
    inv_freq = [10000 ** (-2 * i / R) for i in range(R // 2)]
    had = _hadamard(ID)

    def rope(v, t):
        pos = v[:R]
        if interleaved:
            pos = torch.cat([pos[0::2], pos[1::2]])
        v = torch.cat([_rotate_halves(pos, t, inv_freq), v[R:]])
        return v @ had if rotate else v

    out = torch.full((B, S, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        keys = []
        for t in range(S):
            k = x[t, b] @ p[pre + "linear_wk.weight"].T
            k = (k - k.mean()) / torch.sqrt(k.var(unbiased=False) + 1e-6)
            keys.append(rope(k * p[pre + "k_norm.weight"] + p[pre + "k_norm.bias"], t))
        for t in range(S):
            q = (qr[t, b] @ p[pre + "linear_wq_b.weight"].T).view(IH, ID)
            w = x[t, b] @ p[pre + "linear_weights_proj.weight"].T / math.sqrt(IH * ID)
            for j in range(t + 1):
                dots = torch.stack([rope(q[h], t) @ keys[j] for h in range(IH)])
                out[b, t, j] = (w * (dots.clamp_min(0) if relu else dots)).sum()
    return out


def _indexer_scores(module, x):
    dsa = module.core_attention
    latent = module.q_layernorm(module.linear_q_down_proj(x))
    rotary = build_rotary_embedding(module.config)(S)
    q, k, w = dsa.indexer(x, latent, rotary)
    masked = torch.ones(S, S, dtype=torch.bool).triu(1).expand(B, S, S)
    return index_scores(q, k, w, masked, dsa.use_relu)


def _topk_mask(scores, k):
    """Bool [b, s, s]: each row's k largest finite scores; asserts no tie at the cut."""
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    for b in range(scores.size(0)):
        for t in range(scores.size(1)):
            finite = torch.isfinite(scores[b, t]).nonzero().flatten().tolist()
            order = sorted(finite, key=lambda j: -float(scores[b, t, j]))
            if len(order) > k:
                gap = float(scores[b, t, order[k - 1]] - scores[b, t, order[k]])
                assert gap > 1e-9, "a tie at the top-k cut: pick another seed"
            chosen[b, t, order[:k]] = True
    return chosen


def test_hadamard_rotation_is_the_normalised_sylvester_matrix():
    x = torch.randn(3, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hadamard_rotate(x), x @ _hadamard(16), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="--dsa-indexer-head-dim must be a power of two"):
        hadamard_rotate(torch.zeros(2, 12))


@pytest.mark.parametrize("relu,rotate,interleaved", [(True, True, False), (False, True, False),
                                                    (True, False, True)])
def test_indexer_scores_and_topk_match_naive_fp64(relu, rotate, interleaved):
    config = _config(dsa_indexer_scoring_relu=relu, dsa_indexer_rotate_activation=rotate,
                     dsa_indexer_rope_interleaved=interleaved)
    module = _module(config)
    x = _x()
    got = _indexer_scores(module, x)
    want = _naive_index_scores(module, x, relu, rotate, interleaved)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    indices, chosen = select_topk(got, 3)
    # A top-k by definition (ReLU scores tie at 0, so the set itself may differ by a tie):
    # min(3, visible keys) chosen, none masked, none below a key left out.
    finite = torch.isfinite(want)
    assert torch.equal(chosen.sum(-1), finite.sum(-1).clamp(max=3))
    assert not (chosen & ~finite).any()
    low = want.masked_fill(~chosen, float("inf")).amin(-1)
    high = want.masked_fill(chosen | ~finite, float("-inf")).amax(-1)
    assert (low >= high).all()
    # Query 0 sees one key: one real index, the other slots -1.
    assert indices[:, 0].sort(dim=-1).values.tolist() == [[-1, -1, 0]] * B


def _naive_masked_mla(module, x, allowed):
    """fp64 MLA of x whose query t attends to keys j with allowed[b, t, j] only."""
    p = {k: v.detach().double() for k, v in module.state_dict().items()}
    inv_freq = [10000 ** (-2 * i / R) for i in range(R // 2)]

    def rot_pairs(v, t):        # MLA rotates neighbouring pairs (2i, 2i + 1)
        return _rotate_halves(torch.cat([v[0::2], v[1::2]]), t, inv_freq)

    q_all = _rms(x @ p["linear_q_down_proj.weight"].T, p["q_layernorm.weight"]) \
        @ p["linear_q_up_proj.weight"].T
    kv = x @ p["linear_kv_down_proj.weight"].T
    kv_up = _rms(kv[..., :C], p["kv_layernorm.weight"]) @ p["linear_kv_up_proj.weight"].T
    out = torch.zeros(S, B, HEADS * DV, dtype=torch.float64)
    for b in range(B):
        for h in range(HEADS):
            q = q_all[:, b, h * (D + R):(h + 1) * (D + R)]
            kvh = kv_up[:, b, h * (D + DV):(h + 1) * (D + DV)]
            for t in range(S):
                qt = torch.cat([q[t, :D], rot_pairs(q[t, D:], t)])
                keys = [j for j in range(S) if allowed[b, t, j]]
                logits = torch.stack([qt @ torch.cat([kvh[j, :D], rot_pairs(kv[j, b, C:], j)])
                                      for j in keys]) / math.sqrt(D + R)
                probs = torch.softmax(logits, 0)
                out[t, b, h * DV:(h + 1) * DV] = sum(pr * kvh[j, D:] for pr, j in zip(probs, keys))
    return out @ p["linear_proj.weight"].T


@pytest.mark.parametrize("topk", [3, 5])
def test_dsa_attention_matches_naive_top_k_masked_mla(topk):
    module = _module(_config(dsa_indexer_topk=topk)).eval()
    x = _x()
    allowed = _topk_mask(_naive_index_scores(module, x), topk)
    out, _ = module(x, None, build_rotary_embedding(module.config)(S))
    torch.testing.assert_close(out, _naive_masked_mla(module, x, allowed), rtol=1e-10,
                               atol=1e-10)
    dense = _naive_masked_mla(module, x, torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S))
    assert (out - dense).abs().max() > 1e-3      # the mask really drops keys


def test_dsa_matches_transformers_deepseek_v32():
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf
    module = _module(_config(dsa_indexer_topk=3)).eval()
    cfg = hf.DeepseekV32Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                               q_lora_rank=QL, kv_lora_rank=C, qk_nope_head_dim=D,
                               qk_rope_head_dim=R, v_head_dim=DV, index_n_heads=IH,
                               index_head_dim=ID, index_topk=3, rms_norm_eps=1e-6,
                               attention_bias=False, max_position_embeddings=64,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    ref = hf.DeepseekV32Attention(cfg, 0).double().eval()
    names = {"q_a_proj": "linear_q_down_proj", "q_a_layernorm": "q_layernorm",
             "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
             "kv_a_layernorm": "kv_layernorm", "kv_b_proj": "linear_kv_up_proj",
             "o_proj": "linear_proj", "indexer.wq_b": "core_attention.indexer.linear_wq_b",
             "indexer.wk": "core_attention.indexer.linear_wk",
             "indexer.k_norm": "core_attention.indexer.k_norm",
             "indexer.weights_proj": "core_attention.indexer.linear_weights_proj"}
    ours = module.state_dict()
    state = {}
    for key in ref.state_dict():
        prefix, _, leaf = key.rpartition(".")
        state[key] = ours[f"{names[prefix]}.{leaf}"]
    ref.load_state_dict(state)
    x = _x()
    _topk_mask(_naive_index_scores(module, x), 3)          # no tie decides the comparison
    hs = x.transpose(0, 1)                                 # [b, s, h]
    pos = torch.arange(S)[None].expand(B, S)
    cos_sin = hf.DeepseekV32RotaryEmbedding(cfg)(hs, pos)
    mask = torch.full((S, S), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    want, _ = ref(hs, cos_sin, mask.expand(B, 1, S, S).clone(), position_ids=pos)
    got, _ = module(x, None, build_rotary_embedding(module.config)(S))
    # transformers takes the rotary angles and RMS norms in fp32: ~1e-7 apart. A different key
    # set would differ by ~1e-1.
    torch.testing.assert_close(got.transpose(0, 1), want, rtol=1e-5, atol=2e-6)


def _naive_kl_loss(module, x, scores, coeff, sparse, topk):
    """coeff * mean_(b, t) sum_j p log(p / softmax(scores)), p the head-summed attention."""
    p = {k: v.detach().double() for k, v in module.state_dict().items()}
    allowed = torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)
    keep = allowed & _topk_mask(scores.detach(), topk) if sparse else allowed
    probs = _attention_probs(module, p, x, keep)                        # [b, heads, s, s]
    target = probs.sum(1)
    target = target / target.sum(-1, keepdim=True)
    total = 0.0
    for b in range(B):
        for t in range(S):
            js = keep[b, t].nonzero().flatten()
            log_q = torch.log_softmax(scores[b, t, js], 0)
            pt = target[b, t, js]
            total = total + (pt * (torch.log(pt.clamp_min(1e-10)) - log_q)).sum()
    return coeff * total / (B * S)


def _attention_probs(module, p, x, keep):
    """fp64 MLA attention probabilities [b, heads, s, s] over the keys keep allows."""
    inv_freq = [10000 ** (-2 * i / R) for i in range(R // 2)]

    def rot_pairs(v, t):
        return _rotate_halves(torch.cat([v[0::2], v[1::2]]), t, inv_freq)

    q_all = _rms(x @ p["linear_q_down_proj.weight"].T, p["q_layernorm.weight"]) \
        @ p["linear_q_up_proj.weight"].T
    kv = x @ p["linear_kv_down_proj.weight"].T
    kv_up = _rms(kv[..., :C], p["kv_layernorm.weight"]) @ p["linear_kv_up_proj.weight"].T
    probs = torch.zeros(B, HEADS, S, S, dtype=torch.float64)
    for b in range(B):
        for h in range(HEADS):
            q = q_all[:, b, h * (D + R):(h + 1) * (D + R)]
            k = kv_up[:, b, h * (D + DV):(h + 1) * (D + DV)]
            keys = torch.stack([torch.cat([k[j, :D], rot_pairs(kv[j, b, C:], j)])
                                for j in range(S)])
            for t in range(S):
                logits = keys @ torch.cat([q[t, :D], rot_pairs(q[t, D:], t)]) / math.sqrt(D + R)
                logits = logits.masked_fill(~keep[b, t], float("-inf"))
                probs[b, h, t] = torch.softmax(logits, 0)
    return probs


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("sparse", [False, True])
def test_indexer_loss_matches_fp64_kl_and_only_trains_the_indexer(sparse):
    config = _config(dsa_indexer_loss_coeff=0.25, dsa_indexer_use_sparse_loss=sparse)
    module = _module(config).train()
    x = _x()
    rotary = build_rotary_embedding(config)(S)
    out, _ = module(x, None, rotary)
    out.sum().backward()
    with_loss = _grads(module)
    indexer = {n for n in with_loss if ".indexer." in n}
    assert len(indexer) == 5
    # The reference loss, differentiated by autograd through the fp64 indexer.
    ref = _module(config)
    scores = _naive_index_scores(ref, x, grad=True)
    want = _naive_kl_loss(ref, x, scores, 0.25, sparse, 3)
    want.backward()
    for name in indexer:
        torch.testing.assert_close(with_loss[name], dict(ref.named_parameters())[name].grad,
                                   rtol=1e-8, atol=1e-12)
    # The model's own gradients do not see the loss: as with the loss switched off.
    plain = _module(_config()).train()
    plain(x, None, rotary)[0].sum().backward()
    without = _grads(plain)
    assert not any(".indexer." in n for n in without)        # no loss: the indexer is frozen
    for name, grad in without.items():
        torch.testing.assert_close(with_loss[name], grad, rtol=0, atol=0)
    # The recorded value is the loss (with its coefficient) of layer 1.
    from megatron.model.dsa import INDEXER_LOSS_NAME, attach_dsa_tracker
    tracker = attach_dsa_tracker(module, 2)
    module(x, None, rotary)
    torch.testing.assert_close(float(tracker.values[INDEXER_LOSS_NAME][0]), want.item(),
                               rtol=1e-10, atol=0)


def test_loss_is_off_in_eval_and_without_coefficient():
    module = _module(_config(dsa_indexer_loss_coeff=1.0)).eval()
    out, _ = module(_x(), None, build_rotary_embedding(module.config)(S))
    assert not out.requires_grad or out.grad_fn is not None
    out.sum().backward()
    assert all(p.grad is None for n, p in module.named_parameters() if ".indexer." in n)


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--multi-latent-attention", "--position-embedding-type", "rope",
        "--qk-pos-emb-head-dim", "4", "--qk-head-dim", "8", "--v-head-dim", "8"]
DSA = ["--experimental-attention-variant", "dsa", "--dsa-indexer-n-heads", "2",
       "--dsa-indexer-head-dim", "8", "--dsa-indexer-topk", "4"]


def _validated(argv):
    return validate_args(parse_args(argv=argv))


def test_dsa_flags_parse_with_megatron_names_and_defaults():
    args = _validated(BASE + DSA + ["--dsa-indexer-loss-coeff", "0.5",
                                         "--dsa-indexer-use-sparse-loss",
                                         "--no-dsa-indexer-rotate-activation",
                                         "--no-dsa-indexer-scoring-relu",
                                         "--dsa-indexer-rope-interleaved",
                                         "--dsa-indexer-k-norm-epsilon", "1e-6",
                                         "--dsa-indexer-k-norm-fp32"])
    assert (args.experimental_attention_variant, args.dsa_indexer_n_heads,
            args.dsa_indexer_head_dim, args.dsa_indexer_topk) == ("dsa", 2, 8, 4)
    assert (args.dsa_indexer_loss_coeff, args.dsa_indexer_use_sparse_loss,
            args.dsa_indexer_rotate_activation, args.dsa_indexer_scoring_relu,
            args.dsa_indexer_rope_interleaved, args.dsa_indexer_k_norm_epsilon,
            args.dsa_indexer_k_norm_fp32) == (0.5, True, False, False, True, 1e-6, True)
    defaults = parse_args(argv=BASE + DSA)
    assert (defaults.dsa_indexer_topk_freq, defaults.dsa_indexer_skip_topk_offset,
            defaults.dsa_kernel_backend, defaults.dsa_indexer_rotate_activation,
            defaults.dsa_indexer_scoring_relu) == (1, 0, "none", True, True)


@pytest.mark.parametrize("extra,message", [
    (["--dsa-kernel-backend", "tilelang"], "--dsa-kernel-backend tilelang"),
    (["--dsa-kernel-backend", "cudnn"], "--dsa-kernel-backend cudnn"),
    (["--dsa-indexer-topk-freq", "2"], "--dsa-indexer-topk-freq 2"),
    (["--context-parallel-size", "2"], "context parallelism"),
    (["--dsa-indexer-head-dim", "12"], "power of two"),
    (["--dsa-indexer-head-dim", "2"], "--qk-pos-emb-head-dim"),
    (["--dsa-indexer-topk", "0"], "--dsa-indexer-topk must be at least 1"),
    (["--calculate-per-token-loss"], "--calculate-per-token-loss"),
    (["--recompute-activations"], "recomputing core_attn"),
])
def test_dsa_refuses_what_is_not_built(extra, message):
    with pytest.raises(ArgumentsError, match=message):
        _validated(BASE + DSA + extra)


def test_dsa_needs_mla_its_sizes_and_refuses_variants_not_built():
    with pytest.raises(ArgumentsError, match="needs --multi-latent-attention"):
        _validated([a for a in BASE if a != "--multi-latent-attention"] + DSA)
    with pytest.raises(ArgumentsError, match="--dsa-indexer-topk"):
        _validated(BASE + DSA[:-2])
    with pytest.raises(ArgumentsError, match="gdn2: not built yet"):
        _validated(BASE + ["--experimental-attention-variant", "gdn2"])


def test_without_q_lora_rank_the_indexer_queries_come_from_the_hidden_states():
    config = _config(q_lora_rank=None, qk_layernorm=False, dsa_indexer_loss_coeff=0.5)
    module = _module(config).train()
    assert module.core_attention.indexer.linear_wq_b.weight.shape == (IH * ID, H)
    x = _x()
    out, _ = module(x, None, build_rotary_embedding(config)(S))
    out.sum().backward()
    assert module.core_attention.indexer.linear_wq_b.weight.grad.abs().sum() > 0


def test_bf16_hadamard_sums_in_fp32():
    x = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = hadamard_rotate(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    want = (x.to(torch.bfloat16).double() @ _hadamard(64)).to(torch.bfloat16)
    assert torch.equal(got, want)
