"""``--cpu-offloading-num-layers N``: the first N layers' saved activations go through the host
stash, and the loss and gradients are those of the plain model bit for bit.

On this machine every tensor is already on the host, where a run keeps them as they are; the
tests make the stash copy them anyway (``copy_host_tensors``), so the whole round trip runs.
Layers are alike, so each offloaded layer packs the same number of tensors: counting them
checks that exactly the first N layers are offloaded.
"""

import pytest
import torch

from megatron.core.config import ConfigError
from megatron.model import GPTModel
from megatron.model.activation_offload import HostActivationStash
from megatron.model.transformer import ParallelTransformer
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.unit.test_gpt_model import (loss_and_grads, make_batch, make_config,
                                       single_process_state)


def _gpt(offloaded_layers, copy=True, retain=False):
    model = GPTModel(make_config(num_layers=3, cpu_offloading_num_layers=offloaded_layers,
                                 params_dtype=torch.float32), single_process_state(),
                     init_seed=7)
    stashes = []
    for module in model.modules():
        if isinstance(module, ParallelTransformer):
            module.activation_stash = HostActivationStash(retain_buffers=retain,
                                                          copy_host_tensors=copy)
            stashes.append(module.activation_stash)
    return model, stashes


def _same(a, b):
    assert torch.equal(a[0], b[0])
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


def test_first_n_layers_go_through_the_stash_with_the_same_gradients():
    plain = loss_and_grads(_gpt(0)[0], make_batch())
    counts = {}
    for n in (1, 2):
        model, (stash,) = _gpt(n)
        _same(loss_and_grads(model, make_batch()), plain)
        counts[n] = stash.packed
    assert counts[1] > 0 and counts[2] == 2 * counts[1], counts
    model, (stash,) = _gpt(0)
    loss_and_grads(model, make_batch())
    assert stash.packed == 0


def test_host_tensors_are_kept_as_they_are_in_a_run():
    model, (stash,) = _gpt(2, copy=False)
    _same(loss_and_grads(model, make_batch()), loss_and_grads(_gpt(0)[0], make_batch()))
    assert stash.packed == 0


def test_retained_buffers_are_reused_across_iterations():
    model, (stash,) = _gpt(1, retain=True)
    plain = _gpt(0)[0]
    for seed in (0, 1):
        model.zero_grad()
        plain.zero_grad()
        _same(loss_and_grads(model, make_batch(seed)), loss_and_grads(plain, make_batch(seed)))
        pooled = sum(len(v) for v in stash._pool.values())
        assert pooled == stash.packed // (seed + 1)  # every buffer back in the pool, none new


def test_range_is_checked_naming_the_flag(capsys):
    with pytest.raises(ConfigError, match=r"--cpu-offloading-num-layers must be in \[0, "):
        make_config(num_layers=2, cpu_offloading_num_layers=2)
    base = ("--num-layers 2 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
            "--max-position-embeddings 8 --micro-batch-size 1 --lr 1e-3 --train-iters 2 "
            "--mock-data --device cpu").split()

    def validated(*extra):
        args = parse_args(argv=base + list(extra))
        args.world_size = 1
        return validate_args(args)

    assert validated("--cpu-offloading-num-layers", "1").cpu_offloading_num_layers == 1
    assert "activations already live in host memory" in capsys.readouterr().out
    with pytest.raises(ArgumentsError, match="--cpu-offloading-num-layers must be in"):
        validated("--cpu-offloading-num-layers", "5")
