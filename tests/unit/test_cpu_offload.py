"""``--optimizer-cpu-offload``: the host step gives the optimizer's own results, bit for bit.

This machine has no accelerator, so the device parameters are CPU tensors too; the offload path
still runs whole (host copies of the parameters, gradients copied into host buffers, a host
optimizer over the copies, results copied back), and the reference is the same optimizer
without offload, which must agree exactly: the host part applies the same arithmetic to the
same values. Checkpoints are interchangeable with and without offload.
"""

import io

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.optimizer.cpu_offload import HybridDeviceOptimizer, split_for_offload
from megatron.training.arguments import ArgumentsError, parse_args, validate_args


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)
        self.proj = torch.nn.Linear(3, 2, bias=False)


def _config(**kwargs):
    base = dict(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    base.update(kwargs)
    return OptimizerConfig(**base)


def _model(dtype=torch.float32):
    torch.manual_seed(3)
    return Tiny().to(dtype)


def _build(model, config):
    return get_megatron_optimizer(config, [model], mp_group=None, tp_group=None)


def _train(model, opt, steps, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        ok, _, _ = opt.step()
        assert ok


def _state_tensors(opt):
    state = opt.state_dict()
    inner = state.get("optimizer", state)
    return [v for s in inner["state"].values() for v in s.values() if torch.is_tensor(v)]


def test_split_follows_megatrons_rule():
    params = [torch.empty(4), torch.empty(4), torch.empty(2)]
    assert split_for_offload(params, 1.0) == [True, True, True]
    assert split_for_offload(params, 0.0) == [False, False, False]
    # threshold 5 elements: sent 0 < 5, 4 < 5, then 8 >= 5
    assert split_for_offload(params, 0.5) == [True, True, False]
    assert split_for_offload(params, 0.1) == [True, False, False]


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "lion"])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_step_equals_the_plain_step(optimizer, fraction, precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    kwargs = dict(optimizer=optimizer, bf16=precision == "bf16")
    plain_model, model = _model(dtype), _model(dtype)
    plain = _build(plain_model, _config(**kwargs))
    opt = _build(model, _config(optimizer_cpu_offload=True,
                                optimizer_offload_fraction=fraction, **kwargs))
    assert isinstance(opt.optimizer, HybridDeviceOptimizer)
    _train(plain_model, plain, 4, dtype=dtype)
    _train(model, opt, 4, dtype=dtype)
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_state_tensors(plain), _state_tensors(opt)):
        assert torch.equal(a, b)
    hybrid = opt.optimizer
    stepped = [p for g in hybrid.param_groups for p in g["params"]]
    expected = split_for_offload(stepped, fraction)
    assert [p in hybrid.host_copies for p in stepped] == expected
    assert (hybrid.host_optimizer is not None) == any(expected)
    for param, copy in hybrid.host_copies.items():
        # A separate host tensor was stepped, and holds the result copied back.
        assert copy.data_ptr() != param.data_ptr() and torch.equal(copy, param)
        if optimizer != "sgd":
            assert hybrid.host_optimizer.state[copy] is hybrid.state[param]


@pytest.mark.parametrize("save_offloaded", [True, False])
def test_checkpoints_move_between_offloaded_and_plain_runs(save_offloaded):
    offload = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.6)
    saving_config = _config(**offload) if save_offloaded else _config()
    loading_config = _config() if save_offloaded else _config(**offload)
    model = _model()
    opt = _build(model, saving_config)
    _train(model, opt, 3, seed=1)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    _train(model, opt, 3, seed=2)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = Tiny()
    resumed_opt = _build(resumed, loading_config)
    _train(resumed, resumed_opt, 1, seed=9)  # a step before the load: copies go stale
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    _train(resumed, resumed_opt, 3, seed=2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_torch_optimizer_for_both_parts_matches_torch_adamw():
    model, reference = _model(), _model()
    opt = _build(model, _config(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                                use_torch_optimizer_for_cpu_offload=True, clip_grad=0.0))
    groups = [dict(g, params=list(r)) for g, r in zip(
        opt.param_groups, ([dict(reference.named_parameters())[n] for n, p in
                            model.named_parameters() if any(p is q for q in g["params"])]
                           for g in opt.param_groups))]
    torch_adamw = torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8)
    _train(model, opt, 3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p in reference.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        torch_adamw.step()
    hybrid = opt.optimizer
    assert type(hybrid.host_optimizer) is torch.optim.AdamW
    assert type(hybrid.device_optimizer) is torch.optim.AdamW
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_bad_values_are_refused_naming_the_flag():
    with pytest.raises(ConfigError, match="--optimizer-offload-fraction must be in"):
        _config(optimizer_offload_fraction=1.5)
    with pytest.raises(ConfigError, match="--optimizer muon is not offloaded"):
        _config(optimizer="muon", optimizer_cpu_offload=True)


def _validated(extra):
    args = parse_args(argv=["--num-layers", "2", "--hidden-size", "8",
                            "--num-attention-heads", "2", "--seq-length", "8",
                            "--max-position-embeddings", "8", "--micro-batch-size", "1",
                            "--lr", "1e-3", "--train-iters", "2", "--device", "cpu",
                            "--mock-data", *extra])
    args.world_size = 1
    return validate_args(args)


def test_flags_reach_the_config_and_cpu_runs_get_a_note(capsys):
    args = _validated(["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25",
                       "--overlap-cpu-optimizer-d2h-h2d", "--no-pin-cpu-grads",
                       "--no-pin-cpu-params", "--use-torch-optimizer-for-cpu-offload"])
    assert "optimizer state already lives in host memory" in capsys.readouterr().out
    from megatron.training.configs import _optimizer_config

    config = _optimizer_config(args)
    assert (config.optimizer_cpu_offload, config.optimizer_offload_fraction,
            config.overlap_cpu_optimizer_d2h_h2d, config.pin_cpu_grads, config.pin_cpu_params,
            config.use_torch_optimizer_for_cpu_offload) == (True, 0.25, True, False, False, True)
    _validated(["--no-pin-cpu-grads"])
    assert "--no-pin-cpu-grads has no effect without --optimizer-cpu-offload" in \
        capsys.readouterr().out
    with pytest.raises(ArgumentsError, match="--optimizer muon is not offloaded"):
        _validated(["--optimizer-cpu-offload", "--optimizer", "muon"])


def test_a_parameter_written_from_outside_is_picked_up():
    """A device parameter rewritten in place (a weights-only load) refreshes its host copy."""
    plain_model, model = _model(), _model()
    plain = _build(plain_model, _config())
    opt = _build(model, _config(optimizer_cpu_offload=True))
    for m, o in ((plain_model, plain), (model, opt)):
        _train(m, o, 2)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.5)
        _train(m, o, 2, seed=4)
    for a, b in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
