"""Heterogeneous (per-layer) GPT blocks from a DeciLM style ``block_configs`` JSON: the model's
forward against an fp64 forward written out here from the weights (a no-op attention, a
no-op MLP, linear replacements, and different query groups and MLP sizes per layer), the
parameter names, and errors that name the file and the key.

transformers 5.x has no model reading ``block_configs`` (DeciLM / Nemotron-NAS are remote code
only), so the reference is the naive forward alone.
"""

import json
import math

import pytest
import torch

from megatron.core.heterogeneous import (HeterogeneousConfigError, check_blocks_splittable,
                                         ffn_mult_to_intermediate_size, parse_block_configs)
from megatron.model.gpt_model import GPTModel
from tests.unit.test_gpt_model import BATCH, SEQ, VOCAB, make_batch, make_config, \
    single_process_state

HIDDEN, HEADS = 32, 4

BLOCKS = [
    {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False,
                   "sparsify": None, "window_length": None},
     "ffn": {"intermediate_size": 48, "no_op": False, "replace_with_linear": False}},
    {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
     "ffn": {"ffn_mult": None, "no_op": False, "replace_with_linear": True}},
    {"attention": {"no_op": False, "replace_with_linear": True},
     "ffn": {"ffn_mult": 1.0, "no_op": False, "replace_with_linear": False}},
    {"attention": {"num_query_groups": 1},
     "mlp": {"no_op": True}},
]


def _blocks(blocks=None, num_layers=4):
    text = json.dumps({"block_configs": BLOCKS if blocks is None else blocks})
    return parse_block_configs(text, "config.json", num_layers, HEADS, HIDDEN)


def _model(**kw):
    config = make_config(num_layers=4, heterogeneous_blocks=_blocks(), **kw)
    return GPTModel(config, single_process_state(), parallel_output=False).eval()


def test_fields_map_onto_layers():
    blocks = _blocks()
    assert [b.attention.num_query_groups for b in blocks] == [2, None, None, 1]
    assert [b.attention.no_op for b in blocks] == [False, True, False, False]
    assert [b.attention.replace_with_linear for b in blocks] == [False, False, True, False]
    assert [b.mlp.ffn_hidden_size for b in blocks] == [48, None, 256, None]
    assert [b.mlp.replace_with_linear for b in blocks] == [False, True, False, False]
    assert [b.mlp.no_op for b in blocks] == [False, False, False, True]
    # DeciLM's rule: int(2 m h / 3) rounded up to a multiple of 256 (Llama-3.1-Nemotron-51B:
    # hidden 8192, ffn_mult 2.625 -> 14336).
    assert ffn_mult_to_intermediate_size(2.625, 8192) == 14336
    assert ffn_mult_to_intermediate_size(1.0, 384) == 256


def test_parameter_names_and_shapes():
    params = {n: tuple(p.shape) for n, p in _model().named_parameters()}
    layer = "language_model.encoder.layers."
    hn = HIDDEN // HEADS
    assert params[layer + "0.self_attention.query_key_value.weight"] == ((HEADS + 2 * 2) * hn,
                                                                         HIDDEN)
    assert params[layer + "0.mlp.dense_h_to_4h.weight"] == (48, HIDDEN)
    assert not any(n.startswith(layer + "1.self_attention") or
                   n.startswith(layer + "1.input_layernorm") for n in params)
    assert params[layer + "1.mlp.weight"] == (HIDDEN, HIDDEN)
    assert params[layer + "2.self_attention.weight"] == (HIDDEN, HIDDEN)
    assert params[layer + "2.self_attention.bias"] == (HIDDEN,)
    assert params[layer + "2.mlp.dense_4h_to_h.weight"] == (HIDDEN, 256)
    assert params[layer + "3.self_attention.query_key_value.weight"] == ((HEADS + 2) * hn,
                                                                         HIDDEN)
    assert not any(n.startswith(layer + "3.mlp") or
                   n.startswith(layer + "3.post_attention_layernorm") for n in params)


def _norm(x, w, b, rms):
    if rms:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * w + b


def _linear(x, p, name):
    out = x @ p[name + ".weight"].T
    return out + p[name + ".bias"] if name + ".bias" in p else out


def _attention(x, p, name, groups):
    """fp64 causal attention; QKV rows per query group: [q of its heads | k | v]."""
    s, b, _ = x.shape
    hn, per = HIDDEN // HEADS, HEADS // groups
    qkv = _linear(x, p, name + ".query_key_value").view(s, b, groups, (per + 2) * hn)
    q = qkv[..., :per * hn].reshape(s, b, HEADS, hn)
    k = qkv[..., per * hn:(per + 1) * hn].repeat_interleave(per, dim=2)
    v = qkv[..., (per + 1) * hn:].repeat_interleave(per, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(hn)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), -1)
    context = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, HIDDEN)
    return _linear(context, p, name + ".dense")


def _mlp(x, p, name, swiglu):
    inner = _linear(x, p, name + ".dense_h_to_4h")
    if swiglu:
        gate, value = inner.chunk(2, dim=-1)
        inner = torch.nn.functional.silu(gate) * value
    else:
        inner = 0.5 * inner * (1 + torch.tanh(0.7978845608028654 *
                                              (inner + 0.044715 * inner ** 3)))
    return _linear(inner, p, name + ".dense_4h_to_h")


def naive_forward(model, ids, pos, rms=False, swiglu=False):
    """The logits ``[b, s, V]`` of ``model`` (fp64, built from ``BLOCKS``), computed here."""
    p = {n: t.detach().double() for n, t in model.named_parameters()}
    x = p["language_model.embedding.word_embeddings.weight"][ids]
    if "language_model.embedding.position_embeddings.weight" in p:
        x = x + p["language_model.embedding.position_embeddings.weight"][pos]
    x = x.transpose(0, 1)                                          # [s, b, h]
    for i, block in enumerate(_blocks()):
        name = f"language_model.encoder.layers.{i}"
        att, mlp = block.attention, block.mlp
        if not att.no_op:
            h = _norm(x, p.get(f"{name}.input_layernorm.weight"),
                      p.get(f"{name}.input_layernorm.bias"), rms)
            x = x + (_linear(h, p, f"{name}.self_attention") if att.replace_with_linear
                     else _attention(h, p, f"{name}.self_attention",
                                     att.num_query_groups or HEADS))
        if not mlp.no_op:
            h = _norm(x, p.get(f"{name}.post_attention_layernorm.weight"),
                      p.get(f"{name}.post_attention_layernorm.bias"), rms)
            x = x + (_linear(h, p, f"{name}.mlp") if mlp.replace_with_linear
                     else _mlp(h, p, f"{name}.mlp", swiglu))
    x = _norm(x, p["language_model.encoder.final_layernorm.weight"],
              p.get("language_model.encoder.final_layernorm.bias"), rms)
    return (x @ p["language_model.embedding.word_embeddings.weight"].T).transpose(0, 1)


@pytest.mark.parametrize("flags", [
    {},
    {"normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False},
], ids=["layernorm-gelu-bias", "rmsnorm-swiglu-nobias"])
def test_forward_equals_naive_fp64(flags):
    torch.manual_seed(0)
    model = _model(**flags)
    with torch.no_grad():   # random norms and biases, so no term hides behind a 1 or a 0
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.normal_(0.5 if name.endswith("weight") else 0.0, 0.3)
    ids, pos, _ = make_batch()
    logits = model(ids, pos, None)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    want = naive_forward(model, ids, pos, rms=bool(flags), swiglu=bool(flags))
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-11)


def test_no_op_layers_pass_their_input_through():
    """A layer whose attention and MLP are both no-ops is the identity: a model with one more
    such layer computes the same logits from the same weights."""
    identity = {"attention": {"no_op": True}, "ffn": {"no_op": True}}
    config = make_config(num_layers=4, heterogeneous_blocks=_blocks())
    longer = make_config(num_layers=5,
                         heterogeneous_blocks=_blocks(BLOCKS[:2] + [identity] + BLOCKS[2:], 5))
    a = GPTModel(config, single_process_state(), parallel_output=False).eval()
    b = GPTModel(longer, single_process_state(), parallel_output=False).eval()
    renamed = {}
    for name, tensor in a.state_dict().items():
        for old, new in (("layers.2.", "layers.3."), ("layers.3.", "layers.4.")):
            if f".{old}" in name:
                name = name.replace(old, new)
                break
        renamed[name] = tensor
    b.load_state_dict(renamed)
    ids, pos, _ = make_batch()
    torch.testing.assert_close(b(ids, pos, None), a(ids, pos, None), rtol=0, atol=0)


def _error(blocks, match, num_layers=4):
    with pytest.raises(HeterogeneousConfigError, match=match) as err:
        _blocks(blocks, num_layers)
    assert str(err.value).startswith("config.json: ")


def test_parse_errors_name_the_file_and_the_key():
    with pytest.raises(HeterogeneousConfigError, match=r"^config.json: not valid JSON"):
        parse_block_configs("{", "config.json", 4, HEADS, HIDDEN)
    with pytest.raises(HeterogeneousConfigError, match=r"^c.json: block_configs: missing"):
        parse_block_configs('{"num_hidden_layers": 4}', "c.json", 4, HEADS, HIDDEN)
    _error(BLOCKS[:3], r"block_configs: expected a list of --num-layers \(4\) entries, got 3")
    bad = [dict(b) for b in BLOCKS]
    bad[2] = {"attention": {"n_heads_in_group": 3}, "ffn": {}}
    _error(bad, r"block_configs\[2\]\.attention\.n_heads_in_group: --num-attention-heads "
                r"\(4\) must be a multiple of it \(3\)")
    bad[2] = {"attention": {"window_length": 128}, "ffn": {}}
    _error(bad, r"block_configs\[2\]\.attention\.window_length: 128 is not built")
    bad[2] = {"attention": {"no_op": True, "n_heads_in_group": 2}, "ffn": {}}
    _error(bad, r"block_configs\[2\]\.attention\.n_heads_in_group: a no-op or linear")
    bad[2] = {"attention": {}, "ffn": {"ffn_mul": 2.0}}
    _error(bad, r"block_configs\[2\]\.ffn\.ffn_mul: unknown field")
    bad[2] = {"attention": {}, "ffn": {"ffn_mult": 1.0, "intermediate_size": 64}}
    _error(bad, r"block_configs\[2\]\.ffn: give one of intermediate_size, ffn_mult, not several")
    bad[2] = {"attention": {}, "ffn": {"no_op": "yes"}}
    _error(bad, r"block_configs\[2\]\.ffn\.no_op: expected true or false, got 'yes'")
    bad[2] = {"attention": {}}
    _error(bad, r"block_configs\[2\]\.ffn: missing")
    with pytest.raises(HeterogeneousConfigError, match=r"block_configs\[0\]: attention query "
                       r"groups \(2\) must be divisible by --tensor-model-parallel-size \(4\)"):
        check_blocks_splittable(_blocks(), 4, HIDDEN)
    with pytest.raises(HeterogeneousConfigError, match=r"block_configs\[0\]: ffn size \(48\) "
                       r"must be divisible by --tensor-model-parallel-size \(32\)"):
        check_blocks_splittable(_blocks([{"attention": {}, "ffn": {"ffn_hidden_size": 48}}], 1),
                                32, HIDDEN * 32)
    check_blocks_splittable(_blocks(BLOCKS[:3], 3), 2, HIDDEN)


# --- torch_dist: per-layer keys (layers differ in shape), written out by hand ----------------

def _tp_piece(name, tensor, tp_rank, tp):
    """This TP rank's piece of a whole tensor of the model above (no SwiGLU)."""
    rows = ("query_key_value.weight", "query_key_value.bias", "dense_h_to_4h.weight",
            "dense_h_to_4h.bias", "word_embeddings.weight", "self_attention.weight",
            "self_attention.bias", "mlp.weight", "mlp.bias")
    if name.endswith(rows):
        return tensor.chunk(tp)[tp_rank].clone()
    if name.endswith(("dense.weight", "dense_4h_to_h.weight")):
        return tensor.chunk(tp, dim=1)[tp_rank].clone()
    return tensor.clone()


def _save_dist(path, whole, blocks, tp):
    from megatron.checkpoint.dist import (ChunkLayout, ShardWriter, extra_state_objects,
                                             model_shards, write_metadata)
    records = []
    for tp_rank in range(tp):
        layout = ChunkLayout(num_layers=len(blocks), tp_rank=tp_rank, tp_size=tp,
                             per_layer=True, blocks=blocks)
        local = {n: _tp_piece(n, t, tp_rank, tp) for n, t in whole.items()}
        writer = ShardWriter(path, tp_rank)
        writer.add(model_shards(local, layout))
        writer.add(extra_state_objects(layout, len(blocks), list(local)))
        records += writer.close()
    write_metadata(path, records)


def test_torch_dist_keys_are_per_layer_and_load_at_another_tp(tmp_path):
    from megatron.checkpoint.dist import ChunkLayout, DistCheckpointReader, load_model_state
    from megatron.checkpoint.dist.model_state import chunk_layout

    blocks = _blocks(BLOCKS[:3], 3)
    config = make_config(num_layers=3, heterogeneous_blocks=blocks)
    assert chunk_layout(config, single_process_state()).per_layer
    model = GPTModel(config, single_process_state())
    whole = {n: t.detach() for n, t in model.named_parameters()}
    _save_dist(str(tmp_path), whole, blocks, tp=2)
    reader = DistCheckpointReader(str(tmp_path))
    hn, d = HIDDEN // HEADS, "decoder.layers."
    shapes = {k: tuple(reader.shape(k)) for k in reader.tensor_keys() if k.startswith(d)}
    assert shapes == {
        d + "0.self_attention.linear_qkv.layer_norm_weight": (HIDDEN,),
        d + "0.self_attention.linear_qkv.layer_norm_bias": (HIDDEN,),
        d + "0.self_attention.linear_qkv.weight": ((HEADS + 4) * hn, HIDDEN),
        d + "0.self_attention.linear_qkv.bias": ((HEADS + 4) * hn,),
        d + "0.self_attention.linear_proj.weight": (HIDDEN, HIDDEN),
        d + "0.self_attention.linear_proj.bias": (HIDDEN,),
        d + "0.mlp.linear_fc1.layer_norm_weight": (HIDDEN,),
        d + "0.mlp.linear_fc1.layer_norm_bias": (HIDDEN,),
        d + "0.mlp.linear_fc1.weight": (48, HIDDEN), d + "0.mlp.linear_fc1.bias": (48,),
        d + "0.mlp.linear_fc2.weight": (HIDDEN, 48), d + "0.mlp.linear_fc2.bias": (HIDDEN,),
        d + "1.mlp.layer_norm_weight": (HIDDEN,), d + "1.mlp.layer_norm_bias": (HIDDEN,),
        d + "1.mlp.weight": (HIDDEN, HIDDEN), d + "1.mlp.bias": (HIDDEN,),
        d + "2.self_attention.layer_norm_weight": (HIDDEN,),
        d + "2.self_attention.layer_norm_bias": (HIDDEN,),
        d + "2.self_attention.weight": (HIDDEN, HIDDEN), d + "2.self_attention.bias": (HIDDEN,),
        d + "2.mlp.linear_fc1.layer_norm_weight": (HIDDEN,),
        d + "2.mlp.linear_fc1.layer_norm_bias": (HIDDEN,),
        d + "2.mlp.linear_fc1.weight": (256, HIDDEN), d + "2.mlp.linear_fc1.bias": (256,),
        d + "2.mlp.linear_fc2.weight": (HIDDEN, 256), d + "2.mlp.linear_fc2.bias": (HIDDEN,)}
    torch.testing.assert_close(reader.read(d + "2.self_attention.weight"),
                               whole["language_model.encoder.layers.2.self_attention.weight"],
                               rtol=0, atol=0)
    assert set(reader.byte_keys()) == {
        d + f"{k}._extra_state/shard_0_1" for k in (
            "0.self_attention.linear_proj", "0.self_attention.linear_qkv", "0.mlp.linear_fc1",
            "0.mlp.linear_fc2", "1.mlp", "2.self_attention", "2.mlp.linear_fc1",
            "2.mlp.linear_fc2")}
    layout = ChunkLayout(num_layers=3, per_layer=True, blocks=blocks)
    loaded = load_model_state(reader, {k: torch.zeros_like(v) for k, v in whole.items()},
                              layout)
    for name, tensor in whole.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
