"""Manifold-constrained hyper-connections (megatron/model/hyper_connection.py) in one process.

References: a naive fp64 layer written here (explicit Sinkhorn loops over rows and columns,
explicit per-token stream mixing, Megatron-Core's formulas), the plain residual model (n = 1
with the gates at their identity setting), and the same model without recomputation.
Everything runs in float64; two computations of the same function in another operation order
agree to ~1e-15 here, so 1e-12 catches any wrong formula (1e-3 and more).
"""

import math

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.core.parallel_state import ModelGroups
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.model import GPTModel
from megatron.model import hyper_connection as mhc
from megatron.model.transformer import ParallelTransformerLayer
from tests.unit.test_gpt_model import (expected_keys, loss_and_grads, make_batch, make_config,
                                       single_process_state)

SITES = ("self_attention_hyper_connection", "mlp_hyper_connection")
HC_KEYS = ("alpha_pre", "alpha_post", "alpha_res", "bias", "mapping_proj.weight")


def naive_sinkhorn(logits, iterations, eps=1e-6):
    """One n x n matrix, entry by entry: row softmax + eps, a column pass, then row/column
    passes."""
    n = logits.shape[0]
    m = [[None] * n for _ in range(n)]
    for i in range(n):
        row_max = max(logits[i, j] for j in range(n))
        exps = [torch.exp(logits[i, j] - row_max) for j in range(n)]
        total = sum(exps)
        for j in range(n):
            m[i][j] = exps[j] / total + eps

    def columns():
        for j in range(n):
            total = sum(m[i][j] for i in range(n)) + eps
            for i in range(n):
                m[i][j] = m[i][j] / total

    def rows():
        for i in range(n):
            total = sum(m[i][j] for j in range(n)) + eps
            for j in range(n):
                m[i][j] = m[i][j] / total

    columns()
    for _ in range(iterations - 1):
        rows()
        columns()
    return torch.stack([torch.stack(r) for r in m])


def naive_mappings(hc, x_token, n, iterations):
    """H_pre, H_post, H_res of one token's ``[n*h]`` streams."""
    norm = torch.sqrt((x_token ** 2).sum())
    r = 1.0 / (norm / math.sqrt(x_token.numel()) + 1e-6)
    proj = hc.mapping_proj.weight @ x_token
    h = [None] * (n * n + 2 * n)
    for k in range(n * n + 2 * n):
        alpha = hc.alpha_pre if k < n else hc.alpha_post if k < 2 * n else hc.alpha_res
        h[k] = alpha[0] * proj[k] * r + hc.bias[k]
    h_pre = torch.stack([torch.sigmoid(h[k]) + 1e-6 for k in range(n)])
    h_post = torch.stack([2 * torch.sigmoid(h[n + k]) for k in range(n)])
    h_res = naive_sinkhorn(torch.stack(h[2 * n:]).view(n, n), iterations)
    return h_pre, h_post, h_res


def naive_site(hc, streams, sublayer, n, iterations):
    """``streams [s, b, n, h]``: read, run ``sublayer`` on the read ``[s, b, h]``, write."""
    s, b, _, h = streams.shape
    maps = [[naive_mappings(hc, streams[t, k].reshape(-1), n, iterations) for k in range(b)]
            for t in range(s)]
    read = torch.stack([torch.stack([
        sum(maps[t][k][0][j] * streams[t, k, j] for j in range(n)) for k in range(b)])
        for t in range(s)])
    out, bias = sublayer(read)
    if bias is not None:
        out = out + bias
    written = torch.empty_like(streams)
    for t in range(s):
        for k in range(b):
            h_pre, h_post, h_res = maps[t][k]
            for i in range(n):
                mixed = sum(h_res[j, i] * streams[t, k, j] for j in range(n))
                written[t, k, i] = mixed + h_post[i] * out[t, k]
    return written


def randomise_gates(module, seed=3):
    """Gates and static biases far from their init, so every mapping matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "hyper_connection" in name and "mapping_proj" not in name:
                param.copy_(torch.randn(param.shape, generator=g, dtype=param.dtype))


def test_sinkhorn_matches_the_explicit_loop_and_is_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(5, 3, 4, 4, generator=g, dtype=torch.float64)
    out = mhc.sinkhorn_knopp(logits, 20)
    for idx in [(0, 0), (2, 1), (4, 2)]:
        torch.testing.assert_close(out[idx], naive_sinkhorn(logits[idx], 20), rtol=0,
                                   atol=1e-14)
    # The last pass normalises columns (to 1 - eps); the rows converge with the iterations
    # (measured on these logits: 0.1 off after 5, 4e-3 after 20, eps after 100).
    ones = torch.ones(5, 3, 4, dtype=torch.float64)
    for iterations, row_tol in ((20, 1e-2), (100, 2e-6)):
        out = mhc.sinkhorn_knopp(logits, iterations)
        assert (out > 0).all()
        torch.testing.assert_close(out.sum(-2), ones, rtol=0, atol=2e-6)
        torch.testing.assert_close(out.sum(-1), ones, rtol=0, atol=row_tol)
    # A single iteration is a row softmax and one column pass: rows are not yet balanced.
    assert (mhc.sinkhorn_knopp(logits, 1).sum(-1) - 1).abs().max() > 1e-1


@pytest.mark.parametrize("n", [3, 1])
def test_layer_matches_naive_fp64(n):
    cfg = make_config(enable_mhc_connections=True, mhc_num_residual_streams=n,
                      mhc_sinkhorn_iterations=7)
    layer = ParallelTransformerLayer(cfg, 1, ModelGroups.of(single_process_state(), False),
                                     hyper_connections=True)
    randomise_gates(layer)
    s, b, h = 4, 2, cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s, b, n * h, generator=g, dtype=torch.float64, requires_grad=True)
    out = layer(x, None)
    assert out.shape == (s, b, n * h)

    def attention(read):
        return layer.self_attention(layer.input_layernorm(read), None)

    def mlp(read):
        return layer.mlp(layer.post_attention_layernorm(read))

    streams = x.view(s, b, n, h)
    mid = naive_site(layer.self_attention_hyper_connection, streams, attention, n, 7)
    want = naive_site(layer.mlp_hyper_connection, mid, mlp, n, 7).view(s, b, n * h)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    weight = layer.mlp_hyper_connection.mapping_proj.weight
    grad, = torch.autograd.grad(out.square().sum(), weight)
    grad_want, = torch.autograd.grad(want.square().sum(), weight)
    torch.testing.assert_close(grad, grad_want, rtol=0, atol=1e-10)


def test_parameters_init_and_checkpoint_keys():
    cfg = make_config(enable_mhc_connections=True, mhc_num_residual_streams=4,
                      mhc_init_gating_factor=0.05)
    model = GPTModel(cfg, single_process_state())
    names = [n for n, _ in model.named_parameters()]
    hc = [f"language_model.encoder.layers.{i}.{site}.{k}" for i in range(2) for site in SITES
          for k in HC_KEYS]
    assert sorted(names) == sorted(expected_keys(2) + hc)
    layer = model.language_model.encoder.layers[0]
    site = layer.self_attention_hyper_connection
    assert site.mapping_proj.weight.shape == (4 * 4 + 2 * 4, 4 * cfg.hidden_size)
    assert site.bias.shape == (24,) and not site.bias.any()
    for gate in (site.alpha_pre, site.alpha_post, site.alpha_res):
        assert gate.shape == (1,) and gate.item() == 0.05
    # Xavier-uniform bound sqrt(6 / (fan_in + fan_out)).
    bound = math.sqrt(6 / (24 + 4 * cfg.hidden_size))
    assert site.mapping_proj.weight.abs().max() <= bound
    assert site.mapping_proj.weight.abs().max() > 0.8 * bound


def test_streams_expand_at_the_first_stage_and_average_before_the_final_norm():
    x = torch.randn(3, 2, 5, dtype=torch.float64)
    wide = mhc.expand_streams(x, 4)
    assert wide.shape == (3, 2, 20)
    for i in range(4):
        assert torch.equal(wide[..., 5 * i:5 * (i + 1)], x)
    y = torch.randn(3, 2, 20, dtype=torch.float64)
    torch.testing.assert_close(mhc.contract_streams(y, 4),
                               sum(y[..., 5 * i:5 * (i + 1)] for i in range(4)) / 4)


@pytest.mark.parametrize("exact", [True, False])
def test_one_stream_with_identity_gates_is_the_plain_residual_model(monkeypatch, exact):
    """n = 1, the gates 0 and the static pre bias large: H_pre = sigmoid(40) + eps,
    H_post = 2 sigmoid(0) = 1, H_res = Sinkhorn of a 1 x 1 matrix. Megatron-Core's small
    constants keep these eps from 1 (H_res ~ 1 - 40 eps over 20 iterations): with them zeroed
    the model is the plain one to rounding; with them, within 1e-4."""
    if exact:
        monkeypatch.setattr(mhc, "SINKHORN_EPS", 0.0)
        monkeypatch.setattr(mhc, "H_PRE_EPS", 0.0)
    plain = GPTModel(make_config(), single_process_state())
    model = GPTModel(make_config(enable_mhc_connections=True, mhc_num_residual_streams=1),
                     single_process_state())
    missing = model.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == sorted(f"language_model.encoder.layers.{i}.{s}.{k}"
                                     for i in range(2) for s in SITES for k in HC_KEYS)
    with torch.no_grad():
        for layer in model.language_model.encoder.layers:
            for site in (layer.self_attention_hyper_connection, layer.mlp_hyper_connection):
                for gate in (site.alpha_pre, site.alpha_post, site.alpha_res):
                    gate.zero_()
                site.bias[0] = 40.0
    batch = make_batch()
    want, got = loss_and_grads(plain, batch), loss_and_grads(model, batch)
    tol = 1e-12 if exact else 1e-4
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=0)
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=tol, atol=tol, msg=name)
    if exact:
        return
    # The gates are live: away from the identity setting the model differs.
    with torch.no_grad():
        model.language_model.encoder.layers[0].mlp_hyper_connection.bias[1] = 1.0
    assert abs(loss_and_grads(model, batch)[0] - want[0]) > 1e-3


@pytest.mark.parametrize("group", [None, 1, "full"])
def test_recompute_gives_identical_gradients(group):
    """--recompute-modules mhc: the reads and writes are freed after use and recomputed in
    backward, dropout masks replayed; gradients equal the stored run's bit for bit. Full
    recomputation of layers carries the n streams through its checkpoints just as well."""
    kw = dict(num_layers=2, enable_mhc_connections=True, mhc_num_residual_streams=3,
              mhc_sinkhorn_iterations=3, hidden_dropout=0.2)
    base = GPTModel(make_config(**kw), single_process_state())
    if group == "full":
        how = dict(recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=1)
    else:
        how = dict(recompute_granularity="selective", recompute_modules=("mhc", "core_attn"),
                   mhc_recompute_layer_num=group)
    recomputed = GPTModel(make_config(**kw, **how), single_process_state())
    recomputed.load_state_dict(base.state_dict())
    randomise_gates(base)
    randomise_gates(recomputed)
    batch = make_batch()
    model_parallel_cuda_manual_seed(7, 0)
    torch.manual_seed(7)
    want = loss_and_grads(base, batch)
    model_parallel_cuda_manual_seed(7, 0)
    torch.manual_seed(7)
    got = loss_and_grads(recomputed, batch)
    assert torch.equal(got[0], want[0])
    for name, grad in want[1].items():
        assert torch.equal(got[1][name], grad), name
    # Dropout is on: another RNG state gives another loss.
    model_parallel_cuda_manual_seed(8, 0)
    torch.manual_seed(8)
    assert not torch.equal(loss_and_grads(base, batch)[0], want[0])


def test_recompute_frees_the_reads_and_writes():
    cfg = make_config(num_layers=4, enable_mhc_connections=True, mhc_num_residual_streams=2,
                      mhc_sinkhorn_iterations=2, recompute_granularity="selective",
                      recompute_modules=("mhc",), mhc_recompute_layer_num=2)
    model = GPTModel(cfg, single_process_state())
    groups = []
    original = mhc.MHCRecomputeGroup.close

    def spy(self, output):
        groups.append(self)
        original(self, output)

    mhc.MHCRecomputeGroup.close = spy
    try:
        ids, pos, labels = make_batch()
        loss = model(ids, pos, None, labels=labels).mean()
    finally:
        mhc.MHCRecomputeGroup.close = original
    # Two groups of two layers; per layer two reads and two writes, less the group's last write.
    assert [len(g.records) for g in groups] == [7, 7]
    assert all(r.output.untyped_storage().size() == 0 for g in groups for r in g.records)
    loss.backward()
    assert all(g.restored for g in groups)


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="--mhc-sinkhorn-iterations"):
        make_config(enable_mhc_connections=True, mhc_sinkhorn_iterations=0)
    with pytest.raises(ConfigError, match="--apply-residual-connection-post-layernorm"):
        make_config(enable_mhc_connections=True, apply_residual_connection_post_layernorm=True)
    with pytest.raises(ConfigError, match="--recompute-modules mhc needs"):
        make_config(recompute_granularity="selective", recompute_modules=("mhc",))
    with pytest.raises(ConfigError, match="mhc and mlp"):
        make_config(enable_mhc_connections=True, recompute_granularity="selective",
                    recompute_modules=("mhc", "mlp"))


@pytest.mark.parametrize("extra, pattern", [
    (["--mtp-num-layers", "1"], r"--enable-mhc-connections cannot be combined with "
                                r"--mtp-num-layers"),
    (["--fp32-residual-connection"], r"cannot be combined with --fp32-residual-connection"),
    (["--mhc-num-residual-streams", "0"], r"--mhc-num-residual-streams must be >= 1, got 0"),
    (["--mhc-recompute-layer-num", "0"], r"--mhc-recompute-layer-num must be >= 1, got 0"),
])
def test_flags_refuse_what_is_not_built(extra, pattern):
    from megatron.training.arguments import ArgumentsError, validate_args
    from tests.unit.test_arguments import BASE, _args

    with pytest.raises(ArgumentsError, match=pattern):
        validate_args(_args(BASE + ["--enable-mhc-connections"] + extra))
    with pytest.raises(ArgumentsError, match="--recompute-modules mhc needs"):
        validate_args(_args(BASE + ["--recompute-granularity", "selective",
                                    "--recompute-modules", "mhc"]))


def test_flags_reach_the_model_config():
    from megatron.training.arguments import build_configs, validate_args
    from tests.unit.test_arguments import BASE, _args

    args = validate_args(_args(BASE + [
        "--enable-mhc-connections", "--mhc-num-residual-streams", "2",
        "--mhc-sinkhorn-iterations", "5", "--mhc-init-gating-factor", "0.1",
        "--recompute-granularity", "selective", "--recompute-modules", "mhc",
        "--mhc-recompute-layer-num", "3"]))
    args.padded_vocab_size = 1024
    model = build_configs(args).model
    assert (model.enable_mhc_connections, model.mhc_num_residual_streams,
            model.mhc_sinkhorn_iterations, model.mhc_init_gating_factor,
            model.mhc_recompute_layer_num) == (True, 2, 5, 0.1, 3)
    assert model.recomputes("mhc") and model.residual_stream_size == 2 * model.hidden_size
    args = validate_args(_args(BASE))
    args.padded_vocab_size = 1024
    defaults = build_configs(args).model
    assert not defaults.enable_mhc_connections
    assert defaults.residual_stream_size == defaults.hidden_size


def test_cached_decoding_gives_the_full_forward_logits():
    """The reads and writes are per token, so a key/value-cached generation step sees what the
    full forward computes at that position."""
    from megatron.text_generation.inference_params import InferenceParams

    model = GPTModel(make_config(enable_mhc_connections=True, mhc_num_residual_streams=2,
                                 mhc_sinkhorn_iterations=3), single_process_state())
    randomise_gates(model)
    ids, pos, _ = make_batch()
    seq = ids.shape[1]
    with torch.no_grad():
        full = model(ids, pos, None)
        cache, prompt = InferenceParams(2, seq), seq - 3
        steps = [model(ids[:, :prompt], pos[:, :prompt], None, inference_params=cache)]
        cache.sequence_len_offset = prompt
        for i in range(prompt, seq):
            steps.append(model(ids[:, i:i + 1], pos[:, i:i + 1], None, inference_params=cache))
            cache.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)


def test_hugging_face_export_refuses_an_mhc_checkpoint():
    import types as _types

    from megatron.convert import hf
    from megatron.convert.schema import ConversionError

    hf._refuse_numerics_flags(_types.SimpleNamespace(source_args={"enable_mhc_connections":
                                                                  False}))
    with pytest.raises(ConversionError, match="--enable-mhc-connections"):
        hf._refuse_numerics_flags(_types.SimpleNamespace(source_args={
            "enable_mhc_connections": True}))
