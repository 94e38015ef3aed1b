"""The BERT model in one process: a naive float64 BERT written out from the checkpoint tensors,
the padding mask, checkpoint keys and parameter marks, the masked-LM loss, pipeline splits
against the whole model, and split-independent initialisation.

Everything runs in float64. The model and the naive forward compute the same sums in different
orders, which changes results by ~1e-15 relative; 1e-10 absolute catches any wrong formula (a
missing mask, a wrong GeLU or layer-norm placement shows up at 1e-4 or more).
"""

import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.fused_kernels.bias_gelu import GELU_CUBIC, SQRT_2_OVER_PI
from megatron.model import BertModel, Float16Module, GPTModel
from megatron.model.bert_model import bert_extended_attention_mask
from megatron.model.enums import AttnMaskType
from megatron.model.module import flatten_state_dict
from tests.unit.test_gpt_model import LAYER_KEYS, make_config, single_process_state

SEQ, BATCH, VOCAB, HEADS = 16, 2, 128, 4
REAL_LENGTHS = (SEQ, 11)          # sequence 1 ends in 5 padding tokens


def make_bert_batch(seed=0, num_tokentypes=2):
    """ids, padding mask, token types, labels (-1 where unmasked), loss mask, is_random."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    padding = torch.zeros(BATCH, SEQ, dtype=torch.long)
    types = torch.zeros(BATCH, SEQ, dtype=torch.long)
    for b, n in enumerate(REAL_LENGTHS):
        padding[b, :n] = 1
        if num_tokentypes:
            types[b, n // 2:n] = 1
    loss_mask = (torch.rand(BATCH, SEQ, generator=g) < 0.4).long() * padding
    loss_mask[:, 1] = 1
    labels = torch.where(loss_mask.bool(), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                         torch.full((BATCH, SEQ), -1))
    is_random = torch.tensor([0, 1])
    return ids, padding, (types if num_tokentypes else None), labels, loss_mask, is_random


def bert_loss(model, batch):
    """Masked-LM mean over the loss mask + sentence-order cross entropy (what training uses)."""
    ids, padding, types, labels, loss_mask, is_random = batch
    lm_loss, binary_logits = model(ids, padding, types, lm_labels=labels)
    mask = loss_mask.to(lm_loss.dtype)
    loss = (lm_loss * mask).sum() / mask.sum()
    if binary_logits is not None:
        loss = loss + torch.nn.functional.cross_entropy(binary_logits, is_random)
    return loss


def loss_and_grads(model, batch):
    loss = bert_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ---- the naive BERT ------------------------------------------------------------------------------


def layer_norm(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def gelu_tanh(x, c=SQRT_2_OVER_PI):
    return 0.5 * x * (1.0 + torch.tanh(c * (x + GELU_CUBIC * x ** 3)))


def naive_attention(x, w, bias, dense_w, dense_b, padding):
    """Full softmax attention per sequence and head; masked scores (query or key is padding)
    are -10000 before the softmax, as Megatron's kernels set them."""
    b_, s, h = x.shape
    d = h // HEADS
    qkv = (x @ w.T + bias).view(b_, s, HEADS, 3, d)       # rows per head: [q; k; v]
    out = torch.zeros(b_, s, h, dtype=x.dtype)
    for b in range(b_):
        hidden = torch.tensor([[not (padding[b, i] and padding[b, j]) for j in range(s)]
                               for i in range(s)])
        for head in range(HEADS):
            q, k, v = qkv[b, :, head, 0], qkv[b, :, head, 1], qkv[b, :, head, 2]
            scores = (q @ k.T / math.sqrt(d)).masked_fill(hidden, -10000.0)   # [s, s]
            out[b, :, head * d:(head + 1) * d] = torch.softmax(scores, dim=-1) @ v
    return out @ dense_w.T + dense_b


def naive_bert(p, cfg, ids, padding, types, num_layers=2):
    """Logits ``[b, s, V]`` and binary logits ``[b, 2]`` from the checkpoint tensors ``p``."""
    eps = cfg.layernorm_epsilon
    post_ln = cfg.apply_residual_connection_post_layernorm
    mlp_gelu = (lambda t: gelu_tanh(t, math.sqrt(2 / math.pi))) if cfg.openai_gelu else gelu_tanh
    head_gelu = mlp_gelu  # one GeLU for the whole model
    emb = "language_model.embedding."
    x = p[emb + "word_embeddings.weight"][ids] + p[emb + "position_embeddings.weight"][:SEQ]
    if types is not None:
        x = x + p[emb + "tokentype_embeddings.weight"][types]
    for n in range(num_layers):
        L = {k: p[f"language_model.encoder.layers.{n}.{k}"] for k in LAYER_KEYS}
        ln1 = layer_norm(x, L["input_layernorm.weight"], L["input_layernorm.bias"], eps)
        attn = naive_attention(ln1, L["self_attention.query_key_value.weight"],
                               L["self_attention.query_key_value.bias"],
                               L["self_attention.dense.weight"], L["self_attention.dense.bias"],
                               padding)
        mid = (ln1 if post_ln else x) + attn
        ln2 = layer_norm(mid, L["post_attention_layernorm.weight"],
                         L["post_attention_layernorm.bias"], eps)
        mlp = mlp_gelu(ln2 @ L["mlp.dense_h_to_4h.weight"].T + L["mlp.dense_h_to_4h.bias"])
        mlp = mlp @ L["mlp.dense_4h_to_h.weight"].T + L["mlp.dense_4h_to_h.bias"]
        x = (ln2 if post_ln else mid) + mlp
    x = layer_norm(x, p["language_model.encoder.final_layernorm.weight"],
                   p["language_model.encoder.final_layernorm.bias"], eps)
    t = head_gelu(x @ p["lm_head.dense.weight"].T + p["lm_head.dense.bias"])
    t = layer_norm(t, p["lm_head.layernorm.weight"], p["lm_head.layernorm.bias"], eps)
    logits = t @ p[emb + "word_embeddings.weight"].T + p["lm_head.bias"]
    binary = None
    if "binary_head.weight" in p:
        pooled = torch.tanh(x[:, 0] @ p["language_model.pooler.dense.weight"].T
                            + p["language_model.pooler.dense.bias"])
        binary = pooled @ p["binary_head.weight"].T + p["binary_head.bias"]
    return logits, binary


def randomised(model):
    """Give zero-initialised biases and unit norms random values, so the naive forward checks
    every tensor's placement."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layernorm.weight" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("overrides", [
    {}, dict(apply_residual_connection_post_layernorm=True), dict(openai_gelu=True),
    dict(layernorm_epsilon=1e-12, masked_softmax_fusion=False, bias_gelu_fusion=False),
], ids=["pre_ln", "post_ln", "openai_gelu", "unfused_eps"])
def test_forward_equals_naive_bert(overrides):
    cfg = make_config(**overrides)
    model = randomised(BertModel(cfg, single_process_state(), parallel_output=False))
    ids, padding, types = make_bert_batch()[:3]
    logits, binary = model(ids, padding, types)
    p = {k: v.detach() for k, v in flatten_state_dict(
        model.state_dict_for_save_checkpoint()).items()}
    want_logits, want_binary = naive_bert(p, cfg, ids, padding, types)
    assert logits.shape == (BATCH, SEQ, VOCAB) and binary.shape == (BATCH, 2)
    torch.testing.assert_close(logits.detach(), want_logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(binary.detach(), want_binary, rtol=0, atol=1e-10)


@pytest.mark.parametrize("flash", [False, True])
def test_padding_does_not_reach_real_tokens(flash):
    """Other pad ids and types change nothing at real positions (SDPA too), but do change the
    padded positions (so the comparison has teeth)."""
    model = BertModel(make_config(use_flash_attn=flash), single_process_state())
    ids, padding, types = make_bert_batch()[:3]
    other_ids, other_types = ids.clone(), types.clone()
    other_ids[1, REAL_LENGTHS[1]:] = (ids[1, REAL_LENGTHS[1]:] + 7) % VOCAB
    other_types[1, REAL_LENGTHS[1]:] = 1
    logits, binary = model(ids, padding, types)
    other_logits, other_binary = model(other_ids, padding, other_types)
    real = padding.bool()
    torch.testing.assert_close(other_logits[real], logits[real], rtol=0, atol=1e-13)
    torch.testing.assert_close(other_binary, binary, rtol=0, atol=1e-13)
    assert (other_logits[~real] - logits[~real]).abs().max() > 1e-3
    if flash:                          # SDPA's real positions equal the explicit softmax's
        explicit = BertModel(make_config(), single_process_state())(ids, padding, types)
        torch.testing.assert_close(logits[real], explicit[0][real], rtol=0, atol=1e-10)
        torch.testing.assert_close(binary, explicit[1], rtol=0, atol=1e-10)


def test_extended_attention_mask():
    padding = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    mask = bert_extended_attention_mask(padding)
    assert mask.shape == (2, 1, 4, 4) and mask.dtype == torch.bool
    for b in range(2):
        for i in range(4):
            for j in range(4):
                assert mask[b, 0, i, j] == (padding[b, i] == 0 or padding[b, j] == 0)


def test_attention_is_bidirectional():
    """A change of the last real token reaches the first position (no causal mask)."""
    model = BertModel(make_config(), single_process_state())
    ids, padding, types = make_bert_batch()[:3]
    changed = ids.clone()
    changed[0, SEQ - 1] = (ids[0, SEQ - 1] + 1) % VOCAB
    assert (model(changed, padding, types)[0][0, 0] - model(ids, padding, types)[0][0, 0]
            ).abs().max() > 1e-6


@pytest.mark.parametrize("flash", [False, True])
def test_padding_mask_type_reaches_every_layer(flash):
    """BERT's layers take the padding mask type (GPT's stay causal): without a mask they attend
    everywhere, as with a padding mask that hides nothing."""
    cfg = make_config(use_flash_attn=flash)
    bert = BertModel(cfg, single_process_state())
    gpt = GPTModel(cfg, single_process_state())
    for model, kind in ((bert, AttnMaskType.padding), (gpt, AttnMaskType.causal)):
        for layer in model.language_model.encoder.layers:
            assert layer.self_attention.core_attention.attn_mask_type == kind
    ids, _, types = make_bert_batch()[:3]
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    no_padding = bert_extended_attention_mask(torch.ones(BATCH, SEQ, dtype=torch.long))
    hidden, pooled = bert.language_model(ids, pos, None, tokentype_ids=types)
    want_hidden, want_pooled = bert.language_model(ids, pos, no_padding, tokentype_ids=types)
    torch.testing.assert_close(hidden, want_hidden, rtol=0, atol=1e-12)
    torch.testing.assert_close(pooled, want_pooled, rtol=0, atol=1e-12)


# ---- the masked-LM loss ------------------------------------------------------------------------


@pytest.mark.parametrize("fusion", [True, False])
def test_lm_loss_is_cross_entropy_of_logits(fusion):
    model = BertModel(make_config(cross_entropy_loss_fusion=fusion), single_process_state(),
                      parallel_output=False)
    ids, padding, types, labels = make_bert_batch()[:4]
    assert (labels == -1).any()
    logits, binary = model(ids, padding, types)
    loss, binary2 = model(ids, padding, types, lm_labels=labels)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                             labels.clamp(min=0).reshape(-1),
                                             reduction="none").view(BATCH, SEQ)
    assert loss.shape == (BATCH, SEQ)
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(binary2, binary, rtol=0, atol=0)


def test_lm_loss_in_float32_fused_equals_reference():
    """The fused cross entropy (float32 runs the kernel where built) against the reference,
    with -1 labels present."""
    fp32 = dict(params_dtype=torch.float32)
    batch = make_bert_batch()
    ref = loss_and_grads(BertModel(make_config(cross_entropy_loss_fusion=False, **fp32),
                                   single_process_state()), batch)
    fused = loss_and_grads(BertModel(make_config(**fp32), single_process_state()), batch)
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=1e-6)
    for name, grad in ref[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


# ---- names, checkpoint dicts and parameter marks ----------------------------------------------


def expected_keys(layers, first=True, last=True, tokentypes=True, binary=True, head=False):
    keys = []
    if first:
        keys += ["language_model.embedding.word_embeddings.weight",
                 "language_model.embedding.position_embeddings.weight"]
        if tokentypes:
            keys.append("language_model.embedding.tokentype_embeddings.weight")
    for n in range(layers):
        keys += [f"language_model.encoder.layers.{n}.{k}" for k in LAYER_KEYS]
    if last:
        keys += ["language_model.encoder.final_layernorm.weight",
                 "language_model.encoder.final_layernorm.bias"]
        if binary:
            keys += ["language_model.pooler.dense.weight", "language_model.pooler.dense.bias"]
        keys += ["lm_head.bias", "lm_head.dense.weight", "lm_head.dense.bias",
                 "lm_head.layernorm.weight", "lm_head.layernorm.bias"]
        if binary:
            keys += ["binary_head.weight", "binary_head.bias"]
        if head:
            keys.append("word_embeddings_for_head.weight")
    return keys


@pytest.mark.parametrize("num_tokentypes", [0, 2])
@pytest.mark.parametrize("binary", [True, False])
def test_checkpoint_keys(num_tokentypes, binary):
    model = BertModel(make_config(), single_process_state(), num_tokentypes=num_tokentypes,
                      add_binary_head=binary)
    saved = model.state_dict_for_save_checkpoint()
    want = expected_keys(2, tokentypes=num_tokentypes > 0, binary=binary)
    assert list(flatten_state_dict(saved)) == want
    assert [n for n, _ in model.named_parameters()] == want
    assert list(saved) == ["language_model", "lm_head"] + (["binary_head"] if binary else [])
    assert list(saved["language_model"]) == (["embedding", "encoder"]
                                             + (["pooler"] if binary else []))
    assert list(saved["lm_head"]) == ["bias", "dense.weight", "dense.bias", "layernorm.weight",
                                      "layernorm.bias"]
    if num_tokentypes:
        table = saved["language_model"]["embedding"]["tokentype_embeddings"]["weight"]
        assert table.shape == (2, 32)
    ids, padding, types = make_bert_batch(num_tokentypes=num_tokentypes)[:3]
    logits, binary_logits = model(ids, padding, types)
    assert (binary_logits is None) != binary


def test_pipeline_stage_keys():
    cfg = make_config(num_layers=4)
    first = BertModel(cfg, single_process_state(2, 0), pre_process=True, post_process=False)
    last = BertModel(cfg, single_process_state(2, 1), pre_process=False, post_process=True)
    assert list(flatten_state_dict(first.state_dict_for_save_checkpoint())) == expected_keys(
        2, last=False)
    assert list(flatten_state_dict(last.state_dict_for_save_checkpoint())) == expected_keys(
        2, first=False, head=True)
    assert last.word_embeddings_for_head.weight.shared
    assert last.word_embeddings_for_head.weight.shared_embedding
    assert first.language_model.embedding.word_embeddings.weight.shared_embedding
    assert torch.equal(last.word_embeddings_for_head.weight,
                       first.language_model.embedding.word_embeddings.weight)
    assert last.shared_embedding_or_output_weight() is last.word_embeddings_for_head.weight


@pytest.mark.parametrize("sp", [False, True])
def test_parameter_marks(sp):
    model = BertModel(make_config(), single_process_state(), sequence_parallel=sp)
    params = dict(model.named_parameters())
    bias = params["lm_head.bias"]
    assert (bias.tensor_model_parallel, bias.partition_dim, bias.partition_stride) == (True, 0, 1)
    assert torch.count_nonzero(bias) == 0
    for name in ("lm_head.dense.weight", "lm_head.dense.bias", "lm_head.layernorm.weight",
                 "lm_head.layernorm.bias", "language_model.encoder.final_layernorm.weight"):
        assert params[name].sequence_parallel == sp, name
    for name in ("language_model.pooler.dense.weight", "binary_head.weight",
                 "binary_head.bias", "language_model.embedding.tokentype_embeddings.weight"):
        assert not getattr(params[name], "sequence_parallel", False), name
        assert not getattr(params[name], "tensor_model_parallel", False), name
    assert torch.count_nonzero(params["binary_head.bias"]) == 0
    std = params["binary_head.weight"].std().item()       # only 64 numbers: a loose bound
    assert 0.01 < std < 0.03


def test_checkpoint_round_trip(tmp_path):
    cfg = make_config()
    model = BertModel(cfg, single_process_state(), init_seed=5)
    torch.save(model.state_dict_for_save_checkpoint(), tmp_path / "model.pt")
    other = BertModel(cfg, single_process_state(), init_seed=6)
    other.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    batch = make_bert_batch()
    assert torch.equal(bert_loss(model, batch), bert_loss(other, batch))


def test_untied_head_is_rejected():
    with pytest.raises(ConfigError, match="untie-embeddings-and-output-weights"):
        BertModel(make_config(untie_embeddings_and_output_weights=True), single_process_state())


def test_context_parallel_layout_is_rejected():
    # Its layers would ignore the cp group: every cp rank would run whole sequences.
    pstate = single_process_state()
    pstate.cp_size = 2
    with pytest.raises(ConfigError, match="--context-parallel-size 1, got 2"):
        BertModel(make_config(), pstate)


# ---- initialisation and pipeline splits -------------------------------------------------------


def test_init_shares_pieces_with_gpt_and_ignores_tokentypes():
    """Same seed: the word and position tables and the layers equal GPT's; the token-type table
    is drawn after them and changes nothing else; another seed changes every weight."""
    cfg = make_config()
    gpt = dict(GPTModel(cfg, single_process_state(), init_seed=3).named_parameters())
    bert = dict(BertModel(cfg, single_process_state(), init_seed=3).named_parameters())
    plain = dict(BertModel(cfg, single_process_state(), init_seed=3, num_tokentypes=0,
                           add_binary_head=False).named_parameters())
    for name, p in gpt.items():
        assert torch.equal(bert[name], p) and torch.equal(plain[name], p), name
    other = dict(BertModel(cfg, single_process_state(), init_seed=4).named_parameters())
    for name, p in bert.items():
        if name.endswith("weight") and "layernorm" not in name:
            assert not torch.equal(other[name], p), name


def run_pipeline(stages, batch):
    ids, padding, types, labels, loss_mask, is_random = batch
    hidden = None
    for i, stage in enumerate(stages):
        if i > 0:
            stage.set_input_tensor(hidden)
        hidden = stage(ids if i == 0 else None, padding, types if i == 0 else None,
                       lm_labels=labels)
    lm_loss, binary_logits = hidden
    mask = loss_mask.to(lm_loss.dtype)
    loss = (lm_loss * mask).sum() / mask.sum() + torch.nn.functional.cross_entropy(
        binary_logits, is_random)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("post_ln", [False, True])
def test_pipeline_split_computes_the_whole_model(post_ln):
    cfg = make_config(num_layers=4, apply_residual_connection_post_layernorm=post_ln)
    batch = make_bert_batch()
    loss, grads = loss_and_grads(BertModel(cfg, single_process_state()), batch)
    stages = [BertModel(cfg, single_process_state(2, p), pre_process=p == 0,
                        post_process=p == 1) for p in range(2)]
    torch.testing.assert_close(run_pipeline(stages, batch), loss, rtol=0, atol=1e-12)
    for p, stage in enumerate(stages):
        for name, param in stage.named_parameters():
            if name.startswith("language_model.encoder.layers."):
                local = int(name.split(".")[3])
                name = name.replace(f"layers.{local}.", f"layers.{local + 2 * p}.", 1)
            if "word_embeddings" in name:
                continue
            torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=1e-12, msg=name)
    emb = stages[0].language_model.embedding.word_embeddings.weight.grad
    head = stages[1].word_embeddings_for_head.weight.grad
    assert emb.abs().max() > 0 and head.abs().max() > 0
    torch.testing.assert_close(emb + head, grads["language_model.embedding.word_embeddings.weight"],
                               rtol=0, atol=1e-12)


def test_bf16_wrapper_tracks_fp32():
    batch = make_bert_batch()
    loss32 = bert_loss(BertModel(make_config(params_dtype=torch.float32),
                                 single_process_state()), batch)
    cfg16 = make_config(params_dtype=torch.bfloat16, bf16=True)
    model16 = Float16Module(BertModel(cfg16, single_process_state()), cfg16)
    lm_loss, binary = model16(*batch[:3], lm_labels=batch[3])
    assert lm_loss.dtype == torch.float32 and binary.dtype == torch.float32
    assert (bert_loss(model16, batch) - loss32).abs() < 0.05
