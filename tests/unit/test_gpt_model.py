"""The GPT model in one process: checkpoint names and nesting, QKV layout against a naive
attention built from the weights, pipeline splits against the whole model, equal alternatives
(fusion flags, SDPA, layer scaling, recomputation), and split-independent initialisation.

Everything runs in float64. Two computations of the same function that differ only in the order
of floating-point operations agree to ~1e-15 relative here; the tolerances (1e-12 unless noted)
leave room for that and still catch any wrong formula, which shows up at 1e-3 or more.
"""

import math
import types

import pytest
import torch

from megatron.core.config import ConfigError, TransformerConfig
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import Float16Module, GPTModel
from megatron.model.module import flatten_state_dict
from megatron.model.rotary_pos_embedding import RotaryEmbedding, apply_rotary_pos_emb

SEQ, BATCH, VOCAB = 16, 2, 128
LAYER_KEYS = [
    "input_layernorm.weight", "input_layernorm.bias",
    "self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
    "self_attention.dense.weight", "self_attention.dense.bias",
    "post_attention_layernorm.weight", "post_attention_layernorm.bias",
    "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
    "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias",
]


def make_config(**overrides) -> TransformerConfig:
    """The small float64 GPT every model test uses (2 layers, hidden 32, 4 heads)."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=VOCAB,
              max_position_embeddings=SEQ, seq_length=SEQ, hidden_dropout=0.0,
              attention_dropout=0.0, params_dtype=torch.float64)
    kw.update(overrides)
    return TransformerConfig(**kw)


def single_process_state(pp_size=1, pp_rank=0, vp_size=None, vp_rank=None, tp_size=1):
    return types.SimpleNamespace(tp_group=None, tp_size=tp_size, tp_rank=0, pp_size=pp_size,
                                 pp_rank=pp_rank, virtual_pp_size=vp_size,
                                 virtual_pp_rank=vp_rank)


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return ids, pos, labels


def loss_and_grads(model, batch, mask=None):
    ids, pos, labels = batch
    loss = model(ids, pos, mask, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_same(a, b, atol=1e-12):
    la, ga = a
    lb, gb = b
    torch.testing.assert_close(la, lb, rtol=0, atol=atol)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=0, atol=atol, msg=name)


def expected_keys(layers, first=True, last=True, position=True, untied=False, head=False,
                  norm_bias=True):
    keys = []
    if first:
        keys.append("language_model.embedding.word_embeddings.weight")
        if position:
            keys.append("language_model.embedding.position_embeddings.weight")
    for n in range(layers):
        keys += [f"language_model.encoder.layers.{n}.{k}" for k in LAYER_KEYS]
    if last:
        keys.append("language_model.encoder.final_layernorm.weight")
        if norm_bias:
            keys.append("language_model.encoder.final_layernorm.bias")
        if untied:
            keys.append("language_model.output_layer.weight")
        if head:
            keys.append("word_embeddings_for_head.weight")
    return keys


# ---- names and checkpoint dicts ------------------------------------------------------------------


def test_parameter_names_are_the_checkpoint_keys():
    model = GPTModel(make_config(), single_process_state())
    names = [n for n, _ in model.named_parameters()]
    assert names == expected_keys(2)
    saved = model.state_dict_for_save_checkpoint()
    assert list(saved) == ["language_model"]
    assert list(saved["language_model"]) == ["embedding", "encoder"]
    emb = saved["language_model"]["embedding"]
    assert list(emb["word_embeddings"]) == ["weight"] == list(emb["position_embeddings"])
    assert "layers.1.mlp.dense_4h_to_h.bias" in saved["language_model"]["encoder"]
    assert list(flatten_state_dict(saved)) == names
    untied = GPTModel(make_config(untie_embeddings_and_output_weights=True),
                      single_process_state())
    assert [n for n, _ in untied.named_parameters()] == expected_keys(2, untied=True)
    assert list(untied.state_dict_for_save_checkpoint()["language_model"]["output_layer"]) == [
        "weight"]


def test_pipeline_stage_names_are_local_and_head_copy_is_kept():
    cfg = make_config(num_layers=4)
    first = GPTModel(cfg, single_process_state(2, 0), pre_process=True, post_process=False)
    last = GPTModel(cfg, single_process_state(2, 1), pre_process=False, post_process=True)
    assert [n for n, _ in first.named_parameters()] == expected_keys(2, last=False)
    assert [n for n, _ in last.named_parameters()] == expected_keys(2, first=False, head=True)
    assert list(last.state_dict_for_save_checkpoint()) == ["language_model",
                                                           "word_embeddings_for_head"]
    assert last.word_embeddings_for_head.weight.shared
    assert torch.equal(last.word_embeddings_for_head.weight,
                       first.language_model.embedding.word_embeddings.weight)


def test_modern_variant_names():
    cfg = make_config(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      add_bias_linear=False, num_query_groups=2)
    names = [n for n, _ in GPTModel(cfg, single_process_state()).named_parameters()]
    want = [k for k in expected_keys(2, position=False, norm_bias=False)
            if not k.endswith("bias")]
    assert names == want


def test_checkpoint_round_trip(tmp_path):
    cfg = make_config()
    model = GPTModel(cfg, single_process_state(), init_seed=5)
    torch.save(model.state_dict_for_save_checkpoint(), tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    other = GPTModel(cfg, single_process_state(), init_seed=6)
    assert not torch.equal(other.language_model.embedding.word_embeddings.weight,
                           model.language_model.embedding.word_embeddings.weight)
    other.load_state_dict(loaded)
    for (n, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(p, q), n
    batch = make_batch()
    assert torch.equal(model(*batch[:2], None, labels=batch[2]),
                       other(*batch[:2], None, labels=batch[2]))
    del loaded["language_model"]["encoder"]["layers.0.input_layernorm.weight"]
    with pytest.raises(RuntimeError, match="layers.0.input_layernorm.weight"):
        other.load_state_dict(loaded)


# ---- the QKV layout, checked against attention written out from the weights ------------------


def naive_self_attention(x, attn, heads, groups):
    """Per head: q, k, v from the head's rows of query_key_value, causal softmax, concat, dense.

    Rows are laid out per query group as [q of each head of the group, k, v] x head_dim.
    """
    s, b, _ = x.shape
    w, bias = attn.query_key_value.weight, attn.query_key_value.bias
    d = w.shape[0] // (heads + 2 * groups)
    per_group = heads // groups
    rows = (per_group + 2) * d
    contexts = []
    for h in range(heads):
        g = h // per_group
        base = g * rows
        q_rows = slice(base + (h % per_group) * d, base + (h % per_group + 1) * d)
        k_rows = slice(base + per_group * d, base + (per_group + 1) * d)
        v_rows = slice(base + (per_group + 1) * d, base + (per_group + 2) * d)
        q = x @ w[q_rows].T + bias[q_rows]                       # [s, b, d]
        k = x @ w[k_rows].T + bias[k_rows]
        v = x @ w[v_rows].T + bias[v_rows]
        out = torch.zeros(s, b, d, dtype=x.dtype)
        for bi in range(b):
            for i in range(s):
                scores = torch.stack([q[i, bi] @ k[j, bi] for j in range(i + 1)]) / math.sqrt(d)
                p = torch.softmax(scores, dim=0)
                out[i, bi] = sum(p[j] * v[j, bi] for j in range(i + 1))
        contexts.append(out)
    return torch.cat(contexts, dim=-1) @ attn.dense.weight.T


@pytest.mark.parametrize("groups", [4, 2])
def test_qkv_rows_are_ordered_per_head(groups):
    model = GPTModel(make_config(num_query_groups=groups, add_qkv_bias=True),
                     single_process_state())
    attn = model.language_model.encoder.layers[0].self_attention
    with torch.no_grad():
        attn.query_key_value.bias.normal_()
    x = torch.randn(6, 2, 32, dtype=torch.float64)
    out, bias = attn(x, None)
    assert bias is attn.dense.bias
    torch.testing.assert_close(out, naive_self_attention(x, attn, 4, groups).detach(), rtol=0,
                               atol=1e-12)


def test_rotary_embedding_rotates_channel_pairs():
    d, base, s = 6, 100, 5
    freqs = RotaryEmbedding(d, base)(s)
    t = torch.randn(s, 2, 3, 8, dtype=torch.float64)
    got = apply_rotary_pos_emb(t, freqs)
    want = t.clone()
    for p in range(s):
        for i in range(d // 2):
            angle = p * base ** (-2 * i / d)
            a, c = t[p, ..., i], t[p, ..., i + d // 2]
            want[p, ..., i] = a * math.cos(angle) - c * math.sin(angle)
            want[p, ..., i + d // 2] = c * math.cos(angle) + a * math.sin(angle)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)   # channels 6, 7 pass through


# ---- pipeline splits against the whole model -------------------------------------------------


def run_pipeline(cfg, stages, batch):
    """Chain the stage models (in execution order) as the pipeline schedule would."""
    ids, pos, labels = batch
    hidden = None
    for i, stage in enumerate(stages):
        if i > 0:
            stage.set_input_tensor(hidden)
        last = i == len(stages) - 1
        hidden = stage(ids if i == 0 else None, pos, None, labels=labels if last else None)
    hidden.mean().backward()
    return hidden.mean().detach()


@pytest.mark.parametrize("vp", [None, 2])
def test_pipeline_split_computes_the_whole_model(vp):
    cfg = make_config(num_layers=4)
    batch = make_batch()
    whole = GPTModel(cfg, single_process_state())
    loss, grads = loss_and_grads(whole, batch)
    chunks = 1 if vp is None else vp
    stages = []          # execution order: chunk 0 of stage 0, of stage 1, chunk 1 of stage 0...
    for v in range(chunks):
        for p in range(2):
            stages.append(GPTModel(cfg, single_process_state(2, p, vp, v if vp else None),
                                   pre_process=(v == 0 and p == 0),
                                   post_process=(v == chunks - 1 and p == 1)))
    torch.testing.assert_close(run_pipeline(cfg, stages, batch), loss, rtol=0, atol=1e-12)
    per_chunk = 4 // (2 * chunks)
    for idx, stage in enumerate(stages):
        offset = idx * per_chunk      # the chunk in execution order holds consecutive layers
        for name, p in stage.named_parameters():
            if name.startswith("language_model.encoder.layers."):
                local = int(name.split(".")[3])
                name = name.replace(f"layers.{local}.", f"layers.{local + offset}.", 1)
            if "word_embeddings" in name:
                continue                 # checked below: split between first and last stage
            torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-12, msg=name)
    # The embedding gradient is split between the first stage and the last stage's head copy;
    # their sum (what the embedding-group all-reduce forms) is the whole model's.
    emb = stages[0].language_model.embedding.word_embeddings.weight.grad
    head = stages[-1].word_embeddings_for_head.weight.grad
    torch.testing.assert_close(emb + head, grads["language_model.embedding.word_embeddings.weight"],
                               rtol=0, atol=1e-12)


# ---- alternatives that must compute the same function ----------------------------------------


@pytest.mark.parametrize("overrides", [
    dict(masked_softmax_fusion=False, bias_gelu_fusion=False, bias_dropout_fusion=False),
    dict(use_flash_attn=True),
    dict(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
    dict(openai_gelu=True),
], ids=["unfused", "sdpa", "qk_layer_scaling", "full_uniform", "full_block", "selective",
        "openai_gelu"])
def test_equal_alternatives(overrides):
    batch = make_batch()
    reference = loss_and_grads(GPTModel(make_config(), single_process_state()), batch)
    other = loss_and_grads(GPTModel(make_config(**overrides), single_process_state()), batch)
    # SDPA sums in another order (1e-10); --openai-gelu uses sqrt(2/pi) exactly where the fused
    # GeLU uses 0.79788456, a 1e-9 relative change of the activation (1e-8).
    atol = {"use_flash_attn": 1e-10, "openai_gelu": 1e-8}.get(next(iter(overrides)), 1e-12)
    assert_same(reference, other, atol=atol)


def test_cross_entropy_loss_fusion_equals_reference_in_fp32(monkeypatch):
    """The fused chunked cross entropy (default) against the reference one, in float32 where the
    kernel runs (float64 falls back to the reference): same loss and gradients, and the kernel's
    in-place backward really ran."""
    from megatron.fused_kernels import ops

    if not ops.kernels_available("cpu"):
        pytest.skip("compiled kernels not built")
    calls = []
    original = ops.ChunkedCrossEntropy.backward

    def counting(ctx, grad_output):
        calls.append(ctx.meta[3])                       # inplace_backward
        return original(ctx, grad_output)

    monkeypatch.setattr(ops.ChunkedCrossEntropy, "backward", staticmethod(counting))
    # The first use in a process self-checks the kernel (an out-of-place backward of its own);
    # only the model's backward is counted here, whichever test ran first.
    monkeypatch.setenv("MEGATRON_KERNEL_SELFCHECK", "0")
    batch = make_batch()
    fp32 = dict(params_dtype=torch.float32)
    reference = loss_and_grads(GPTModel(make_config(cross_entropy_loss_fusion=False, **fp32),
                                        single_process_state()), batch)
    assert calls == []
    fused = loss_and_grads(GPTModel(make_config(**fp32), single_process_state()), batch)
    assert calls == [True]
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-6, atol=1e-6)
    for name, grad in reference[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("flash", [False, True])
def test_explicit_causal_mask_equals_none(flash):
    model = GPTModel(make_config(use_flash_attn=flash), single_process_state())
    ids, pos, labels = make_batch()
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    torch.testing.assert_close(model(ids, pos, mask, labels), model(ids, pos, None, labels),
                               rtol=0, atol=1e-12)
    # the mask is honoured: hiding tokens 0-2 from query 5 changes query 5's loss only
    mask2 = mask.clone()
    mask2[..., 5, :3] = True
    diff = (model(ids, pos, mask2, labels) - model(ids, pos, None, labels)).abs()
    assert diff[:, 5].min() > 1e-6 and diff[:, :5].max() < 1e-12


def test_logits_and_loss_against_torch_cross_entropy():
    model = GPTModel(make_config(), single_process_state(), parallel_output=False)
    ids, pos, labels = make_batch()
    logits = model(ids, pos, None)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                             reduction="none").view(BATCH, SEQ)
    torch.testing.assert_close(model(ids, pos, None, labels), want, rtol=0, atol=1e-12)


def test_dropout_recompute_is_bit_identical():
    cfg = dict(hidden_dropout=0.2, attention_dropout=0.2)
    batch = make_batch()

    def run(**overrides):
        model = GPTModel(make_config(**cfg, **overrides), single_process_state())
        model_parallel_cuda_manual_seed(42, 0)
        return loss_and_grads(model, batch)

    base = run()
    assert_same(base, run(), atol=0)
    for mode in (dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=2),
                 dict(recompute_granularity="full", recompute_method="block",
                      recompute_num_layers=1),
                 dict(recompute_granularity="selective")):
        assert_same(base, run(**mode), atol=0)
    no_dropout = loss_and_grads(GPTModel(make_config(), single_process_state()), batch)
    assert abs(base[0] - no_dropout[0]) > 1e-3       # dropout really was on


# ---- initialisation ---------------------------------------------------------------------------


def test_init_is_seeded_per_piece_and_leaves_global_rng_alone():
    torch.manual_seed(3)
    expected_next = torch.rand(3)
    torch.manual_seed(3)
    a = GPTModel(make_config(), single_process_state(), init_seed=11)
    assert torch.equal(torch.rand(3), expected_next)
    b = GPTModel(make_config(), single_process_state(), init_seed=11)
    c = GPTModel(make_config(), single_process_state(), init_seed=12)
    for (n, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(),
                                      c.named_parameters()):
        assert torch.equal(p, q), n
        if n.endswith("weight") and "layernorm" not in n:
            assert not torch.equal(p, r), n
    w = a.language_model.encoder.layers[0]
    std = 0.02 / math.sqrt(2 * 2)      # output projections scaled by 1/sqrt(2 num_layers)
    assert abs(w.mlp.dense_4h_to_h.weight.std().item() - std) < 0.2 * std
    assert abs(w.mlp.dense_h_to_4h.weight.std().item() - 0.02) < 0.1 * 0.02


def test_bf16_wrapper_tracks_fp32():
    cfg32 = make_config(params_dtype=torch.float32)
    batch = make_batch()
    loss32 = GPTModel(cfg32, single_process_state())(*batch[:2], None, labels=batch[2])
    cfg16 = make_config(params_dtype=torch.bfloat16, bf16=True)
    model16 = Float16Module(GPTModel(cfg16, single_process_state()), cfg16)
    loss16 = model16(*batch[:2], None, labels=batch[2])
    assert loss16.dtype == torch.float32
    assert (loss16 - loss32).abs().max() < 0.05
    assert list(flatten_state_dict(model16.state_dict_for_save_checkpoint())) == expected_keys(2)


def test_unsplittable_configs_are_rejected():
    with pytest.raises(ConfigError, match=r"--num-attention-heads \(4\).*"
                                          r"--tensor-model-parallel-size \(3\)"):
        GPTModel(make_config(), single_process_state(tp_size=3))
    with pytest.raises(ConfigError, match=r"per pipeline stage \(3\).*\(2"):
        GPTModel(make_config(num_layers=6), single_process_state(2, 0, 2, 0))


@pytest.mark.parametrize("first,last", [(1, None), (None, 1), (1, 2)])
def test_uneven_pipeline_split_computes_the_whole_model(first, last):
    """--decoder-first/last-pipeline-num-layers: stages of unequal depth, same function."""
    cfg = make_config(num_layers=4, first_pipeline_num_layers=first,
                      last_pipeline_num_layers=last)
    batch = make_batch()
    loss, grads = loss_and_grads(GPTModel(cfg, single_process_state()), batch)
    pp = 3 if first is not None and last is not None else 2
    stages = [GPTModel(cfg, single_process_state(pp, p), pre_process=p == 0,
                       post_process=p == pp - 1) for p in range(pp)]
    depths = [len(s.language_model.encoder.layers) for s in stages]
    assert depths == {(1, None): [1, 3], (None, 1): [3, 1], (1, 2): [1, 1, 2]}[(first, last)]
    torch.testing.assert_close(run_pipeline(cfg, stages, batch), loss, rtol=0, atol=1e-12)
    offset = 0
    for stage, depth in zip(stages, depths):
        for name, p in stage.named_parameters():
            if name.startswith("language_model.encoder.layers."):
                local = int(name.split(".")[3])
                name = name.replace(f"layers.{local}.", f"layers.{local + offset}.", 1)
                torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-12, msg=name)
        offset += depth


def test_training_logits_reuse_one_storage_bit_identically():
    """In training the output layer writes the logits into storage the model keeps (one page-
    faulting allocation per run instead of per micro-batch). Losses and gradients must be
    bit-identical to fresh logits, each micro-batch must get the same storage back, and a
    second forward before the first one's backward (pipeline schedules) must get its own."""
    cfg = make_config(params_dtype=torch.float32)
    model = GPTModel(cfg, single_process_state())
    plain = GPTModel(cfg, single_process_state())
    plain._logits_buffer = None
    handed_out = []
    acquire = model._logits_buffer.acquire

    def spy(*args):
        out = acquire(*args)
        handed_out.append(None if out is None else out.data_ptr())
        return out

    model._logits_buffer.acquire = spy
    for seed in range(2):
        for m in (model, plain):
            m.zero_grad(set_to_none=True)
        assert_same(loss_and_grads(model, make_batch(seed)),
                    loss_and_grads(plain, make_batch(seed)), atol=0)
    assert len(handed_out) == 2 and handed_out[0] is not None
    assert handed_out[1] == handed_out[0]

    def two_in_flight(m):
        m.zero_grad(set_to_none=True)
        losses = [m(ids, pos, None, labels=labels).mean()
                  for ids, pos, labels in (make_batch(2), make_batch(3))]
        for loss in losses:
            loss.backward()
        return losses[0].detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    assert_same(two_in_flight(model), two_in_flight(plain), atol=0)
    assert handed_out[2:] == [handed_out[0], None]
    with torch.no_grad():                               # evaluation: nothing kept or handed out
        model(*make_batch(4)[:2], None, labels=make_batch(4)[2])
    assert len(handed_out) == 4
