"""--use-mup (megatron/core/mup.py) in one process, each part against its own reference.

* At width multiplier 1 with both multipliers 1 and ``--mup-attn-scale-power 0.5`` a muP model is
  the standard model bit for bit (same weights, same logits); with the base head dim equal to
  the head dim and power 1 it is the same function up to rounding.
* The forward (embedding multiplier, attention scale ``sqrt(d0) / d^p``, logit multiplier, its
  ``1 / w`` default) against a naive float64 GPT written out here from the weights.
* Per-group learning rates, min lrs and Adam eps against hand-computed values, also through the
  scheduler, for Adam, SGD, Lion and --decoupled-lr.
* The init std of every parameter kind against the formula: a sample std of n draws is within
  ~1/sqrt(2n) (< 0.3% here) of the true std; 3% catches every wrong factor (the smallest is
  sqrt(2), 41%).
* Bad combinations fail in one line naming the flag.
"""

import math

import pytest
import torch

from megatron.convert.hf import family_for_meta
from megatron.convert.schema import ConversionError, ModelMeta
from megatron.core.config import ConfigError
from megatron.core.mup import attention_scale, mup_group_overrides
from megatron.model import GPTModel
from megatron.optimizer import OptimizerConfig, OptimizerParamScheduler, get_param_groups
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.validation import validate_bert_args
from tests.unit.test_gpt_model import make_batch, make_config, single_process_state

ATOL = 1e-12
BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --train-iters 10 --vocab-size 100 "
        "--tokenizer-type NullTokenizer --lr 1e-3").split()


def _gpt(seed=1234, **overrides):
    return GPTModel(make_config(**overrides), single_process_state(), init_seed=seed,
                    parallel_output=False)


# ---- width multiplier 1 is the standard parametrization --------------------------------------


@pytest.mark.parametrize("untie", [False, True])
def test_width_one_with_standard_attention_is_the_plain_model_bit_for_bit(untie):
    plain = _gpt(untie_embeddings_and_output_weights=untie)
    mup = _gpt(untie_embeddings_and_output_weights=untie, use_mup=True, mup_attn_scale_power=0.5)
    assert mup.config.mup_width_mult == 1.0 and mup.config.mup_output_mult == 1.0
    for (name, a), (_, b) in zip(plain.state_dict().items(), mup.state_dict().items()):
        assert torch.equal(a, b), name
    ids, pos, labels = make_batch()
    assert torch.equal(plain(ids, pos, None), mup(ids, pos, None))
    assert torch.equal(plain(ids, pos, None, labels), mup(ids, pos, None, labels))


def test_width_one_with_base_head_dim_equal_to_head_dim_is_the_plain_function():
    """sqrt(d) / d is 1 / sqrt(d) up to rounding."""
    plain = _gpt()
    mup = _gpt(use_mup=True, mup_base_head_dim=8)
    ids, pos, _ = make_batch()
    torch.testing.assert_close(mup(ids, pos, None), plain(ids, pos, None), rtol=0, atol=ATOL)


def test_default_mup_attention_is_one_over_head_dim():
    plain, mup = _gpt(), _gpt(use_mup=True)
    ids, pos, _ = make_batch()
    assert (mup(ids, pos, None) - plain(ids, pos, None)).abs().max() > 1e-6
    assert attention_scale(8, None, 1.0) == (1.0 / 8, 8.0)
    assert attention_scale(8, 4, 1.0) == (2.0 / 8, 4.0)


# ---- the forward against a naive float64 GPT -------------------------------------------------


def _layer_norm(x, ln):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], ln.weight, ln.bias, 1e-5)


def _gelu(x):
    """Megatron's tanh GeLU, its constant sqrt(2 / pi) rounded to 0.79788456."""
    return 0.5 * x * (1.0 + torch.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))


def _naive_attention(x, attn, heads, scale):
    """Causal attention with per-head [q, k, v] rows (groups == heads), scores times scale."""
    s, b, h = x.shape
    d = h // heads
    qkv = x @ attn.query_key_value.weight.T + attn.query_key_value.bias      # [s, b, 3h]
    qkv = qkv.view(s, b, heads, 3, d)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]                 # [s, b, n, d]
    scores = torch.einsum("ibnd,jbnd->bnij", q, k) * scale
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    context = torch.einsum("bnij,jbnd->ibnd", probs, v).reshape(s, b, h)
    return context @ attn.dense.weight.T + attn.dense.bias


def naive_gpt_logits(model, ids, pos, *, embedding_mult, output_mult, attn_scale, heads=4):
    """``[b, s]`` ids -> ``[b, s, V]`` logits from ``model``'s weights, float64."""
    lm = model.language_model
    x = lm.embedding.word_embeddings.weight[ids] + lm.embedding.position_embeddings.weight[pos]
    x = x.transpose(0, 1) * embedding_mult                                    # [s, b, h]
    for layer in lm.encoder.layers:
        x = x + _naive_attention(_layer_norm(x, layer.input_layernorm), layer.self_attention,
                                 heads, attn_scale)
        mlp = layer.mlp
        y = _layer_norm(x, layer.post_attention_layernorm)
        y = _gelu(y @ mlp.dense_h_to_4h.weight.T + mlp.dense_h_to_4h.bias)
        x = x + y @ mlp.dense_4h_to_h.weight.T + mlp.dense_4h_to_h.bias
    x = _layer_norm(x, lm.encoder.final_layernorm)
    head = (lm.output_layer.weight if model.config.untie_embeddings_and_output_weights
            else lm.embedding.word_embeddings.weight)
    return (x @ head.T * output_mult).transpose(0, 1)                         # [b, s, V]


@pytest.mark.parametrize("untie,output_mult,want_output_mult", [
    (False, 1.0, 0.5),          # left at 1.0: 1 / width_mult
    (True, 0.7, 0.7),           # given: as given
])
def test_forward_against_naive_fp64(untie, output_mult, want_output_mult):
    model = _gpt(use_mup=True, mup_base_hidden_size=16, mup_embedding_mult=3.0,
                 mup_output_mult=output_mult, mup_base_head_dim=4,
                 untie_embeddings_and_output_weights=untie)
    assert model.config.mup_width_mult == 2.0
    assert model.config.mup_output_mult == want_output_mult
    ids, pos, labels = make_batch()
    want = naive_gpt_logits(model, ids, pos, embedding_mult=3.0, output_mult=want_output_mult,
                            attn_scale=math.sqrt(4) / 8).detach()
    torch.testing.assert_close(model(ids, pos, None).detach(), want, rtol=0, atol=ATOL)
    # Each multiplier matters at this tolerance (a naive run with any one left out differs).
    for wrong in (dict(embedding_mult=1.0, output_mult=want_output_mult, attn_scale=0.25),
                  dict(embedding_mult=3.0, output_mult=1.0, attn_scale=0.25),
                  dict(embedding_mult=3.0, output_mult=want_output_mult,
                       attn_scale=1 / math.sqrt(8))):
        assert (naive_gpt_logits(model, ids, pos, **wrong) - want).abs().max() > 1e-6


def test_flash_and_explicit_attention_bodies_agree_under_mup():
    kw = dict(use_mup=True, mup_base_hidden_size=16, mup_base_head_dim=2,
              mup_attn_scale_power=0.75)
    explicit, flash = _gpt(**kw), _gpt(use_flash_attn=True, **kw)
    ids, pos, _ = make_batch()
    torch.testing.assert_close(flash(ids, pos, None), explicit(ids, pos, None), rtol=0,
                               atol=ATOL)


# ---- init std per parameter kind -------------------------------------------------------------


def test_init_std_per_parameter_kind_follows_the_formula():
    sigma, hidden, base, layers = 0.02, 256, 64, 2
    cfg = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
               params_dtype=torch.float32, use_mup=True, mup_base_hidden_size=base,
               untie_embeddings_and_output_weights=True, padded_vocab_size=512)
    model = GPTModel(make_config(**cfg), single_process_state(), init_seed=7)
    w = hidden / base
    want = {"query_key_value.weight": sigma / math.sqrt(w),
            "dense_h_to_4h.weight": sigma / math.sqrt(w),
            "self_attention.dense.weight": sigma / math.sqrt(2 * layers * w),
            "dense_4h_to_h.weight": sigma / math.sqrt(2 * layers * w),
            "word_embeddings.weight": sigma, "position_embeddings.weight": sigma,
            "output_layer.weight": sigma}
    seen = set()
    for name, param in model.named_parameters():
        kind = next((k for k in want if name.endswith(k)), None)
        if kind is None:
            continue
        seen.add(kind)
        assert param.double().std().item() == pytest.approx(want[kind], rel=0.03), name
        assert abs(param.double().mean().item()) < 0.1 * want[kind], name
    assert seen == set(want)


def test_init_embedding_std_flag_still_wins_under_mup():
    model = GPTModel(make_config(hidden_size=256, num_attention_heads=4, use_mup=True,
                                 mup_base_hidden_size=64, embedding_init_method_std=0.05,
                                 params_dtype=torch.float32, padded_vocab_size=512),
                     single_process_state())
    table = model.language_model.embedding.word_embeddings.weight
    assert table.std().item() == pytest.approx(0.05, rel=0.03)


# ---- per-group learning rates ----------------------------------------------------------------


LR, MIN_LR, EPS, DEC_LR = 1e-3, 1e-4, 1e-8, 4e-3
HIDDEN = {"query_key_value.weight", "self_attention.dense.weight", "dense_h_to_4h.weight",
          "dense_4h_to_h.weight"}


def _by_name(model, groups):
    """name -> (max_lr, min_lr, eps or None) of the group holding the parameter."""
    out = {}
    for group in groups:
        ids = {id(p) for p in group["params"]}
        for name, p in model.named_parameters():
            if id(p) in ids:
                out[name] = (group.get("max_lr", LR), group.get("min_lr", MIN_LR),
                             group.get("eps"))
    assert len(out) == len(list(model.parameters()))
    return out


def _kind(name):
    if any(name.endswith(h) for h in HIDDEN):
        return "hidden"
    return "output" if name.endswith("output_layer.weight") else "vector"


@pytest.mark.parametrize("optimizer,untie,decoupled", [
    ("adam", False, False), ("adam", True, False), ("adam", True, True),
    ("sgd", True, False), ("sgd", True, True), ("lion", True, False)])
def test_group_lrs_equal_hand_computed(optimizer, untie, decoupled):
    w = 2.0
    model = _gpt(untie_embeddings_and_output_weights=untie)
    config = OptimizerConfig(optimizer=optimizer, lr=LR, min_lr=MIN_LR, adam_eps=EPS,
                             decoupled_lr=DEC_LR if decoupled else None, use_mup=True,
                             mup_width_mult=w)
    # Hand-written table: (max_lr, min_lr, eps) per kind of parameter.
    dec = (DEC_LR, MIN_LR, None) if decoupled else None
    table = {
        "adam": {"hidden": (LR / w, MIN_LR / w, EPS / w), "vector": (LR, MIN_LR, None),
                 "output": (LR / w, MIN_LR / w, EPS / w)},
        "sgd": {"hidden": (LR, MIN_LR, None), "vector": (LR * w, MIN_LR * w, None),
                "output": (LR, MIN_LR, None)},
        "lion": {"hidden": (LR / w, MIN_LR / w, None), "vector": (LR, MIN_LR, None),
                 "output": (LR / w, MIN_LR / w, None)},
    }[optimizer]
    for name, got in _by_name(model, get_param_groups([model], config)).items():
        want = table[_kind(name)]
        own = name.endswith(("word_embeddings.weight", "output_layer.weight"))
        if dec is not None and own:
            # --decoupled-lr keeps its lr; Adam's eps of the output matrix is still scaled.
            want = (DEC_LR, MIN_LR, want[2] if _kind(name) == "output" else None)
        assert got[:2] == pytest.approx(want[:2], rel=1e-15), name
        assert got[2] == (None if want[2] is None else pytest.approx(want[2], rel=1e-15)), name


def test_scheduler_runs_each_group_on_its_scaled_range():
    w, warmup, decay = 4.0, 2, 10
    model = _gpt()
    config = OptimizerConfig(lr=LR, min_lr=MIN_LR, use_mup=True, mup_width_mult=w)
    opt = torch.optim.AdamW(get_param_groups([model], config), lr=LR, eps=EPS)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=LR, min_lr=MIN_LR,
                                    lr_warmup_steps=warmup, lr_decay_steps=decay,
                                    lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=decay, wd_incr_style="constant")
    for n in (1, 2, 6, 10, 12):
        sched.num_steps = n - 1
        sched.step(1)
        for group in opt.param_groups:
            f = group.get("mup_lr_factor", 1.0)
            if n <= warmup:
                want = LR * f * n / warmup
            else:
                want = MIN_LR * f + (LR - MIN_LR) * f * max(0.0, 1 - (n - warmup) /
                                                           (decay - warmup))
            assert group["lr"] == pytest.approx(want, rel=1e-12), (n, f)
    factors = sorted({g.get("mup_lr_factor", 1.0) for g in opt.param_groups})
    assert factors == [1 / w, 1.0]


def test_width_one_leaves_the_groups_as_without_mup():
    model = _gpt()
    plain = get_param_groups([model], OptimizerConfig(lr=LR))
    mup = get_param_groups([model], OptimizerConfig(lr=LR, use_mup=True, mup_width_mult=1.0))
    assert [{k: v for k, v in g.items() if k != "params"} for g in plain] == \
        [{k: v for k, v in g.items() if k != "params"} for g in mup]
    assert [[id(p) for p in g["params"]] for g in plain] == \
        [[id(p) for p in g["params"]] for g in mup]


def test_vector_like_parameters_are_embeddings_and_vectors():
    p2, p1 = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    assert mup_group_overrides("adam", 2.0, False, p2, "x.dense.weight") == (0.5, 0.5)
    assert mup_group_overrides("adam", 2.0, False, p1, "x.dense.bias") == (1.0, 1.0)
    assert mup_group_overrides("adam", 2.0, False, p2, "word_embeddings_for_head.weight") == \
        (1.0, 1.0)


# ---- bad combinations ------------------------------------------------------------------------


def _validated(*extra):
    args = parse_args(argv=BASE + list(extra))
    args.world_size = 1
    return validate_args(args)


@pytest.mark.parametrize("extra,flag", [
    (["--mup-width-mult", "2"], "--mup-width-mult"),
    (["--mup-output-mult", "0.5"], "--mup-output-mult"),
    (["--mup-base-head-dim", "8"], "--mup-base-head-dim"),
    (["--use-mup", "--mup-base-hidden-size", "0"], "--mup-base-hidden-size"),
    (["--use-mup", "--mup-width-mult", "-1"], "--mup-width-mult"),
    (["--use-mup", "--mup-embedding-mult", "0"], "--mup-embedding-mult"),
    (["--use-mup", "--mup-output-mult", "nan"], "--mup-output-mult"),
    (["--use-mup", "--mup-attn-scale-power", "inf"], "--mup-attn-scale-power"),
    (["--use-mup", "--mup-base-head-dim", "-4"], "--mup-base-head-dim"),
    (["--use-mup", "--mup-base-hidden-size", "16", "--mup-width-mult", "3"],
     "--mup-width-mult"),
    (["--use-mup", "--init-method-xavier-uniform"], "--init-method-xavier-uniform"),
    (["--use-mup", "--optimizer", "muon"], "--optimizer muon"),
    (["--use-mup", "--multi-latent-attention"], "--multi-latent-attention"),
])
def test_bad_combinations_are_refused_in_one_line(extra, flag):
    with pytest.raises(ArgumentsError) as err:
        _validated(*extra)
    message = str(err.value)
    assert flag in message and "\n" not in message, message


def test_good_flags_pass_and_agree_with_the_config():
    args = _validated("--use-mup", "--mup-base-hidden-size", "16", "--mup-width-mult", "2")
    assert args.use_mup and args.mup_base_hidden_size == 16
    with pytest.raises(ConfigError, match="--mup-base-hidden-size"):
        make_config(use_mup=True, mup_base_hidden_size=-2)
    with pytest.raises(ConfigError, match="--optimizer muon"):
        OptimizerConfig(lr=LR, optimizer="muon", use_mup=True)
    assert make_config(use_mup=True, mup_width_mult=3.0).mup_output_mult == 1 / 3.0


def test_bert_refuses_mup():
    args = _validated("--use-mup")
    args.tokenizer_type = "BertWordPieceLowerCase"
    with pytest.raises(ArgumentsError, match="--use-mup"):
        validate_bert_args(args)


def test_hf_export_refuses_a_mup_checkpoint_in_one_line():
    """No transformers class written here has muP's multipliers."""
    meta = ModelMeta(num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=4, kv_channels=8, max_position_embeddings=16,
                     vocab_size=100, padded_vocab_size=128, source_args={"use_mup": True})
    with pytest.raises(ConversionError, match="^--use-mup: ") as err:
        family_for_meta(meta)
    assert "\n" not in str(err.value)
    family_for_meta(ModelMeta(**{**meta.__dict__, "source_args": {"use_mup": False}}))
