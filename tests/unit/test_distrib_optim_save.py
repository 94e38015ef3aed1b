"""Writing Megatron-LM's ``distrib_optim.pt`` (``--ckpt-format torch`` with the distributed
optimizer).

The written files are read back by the naive layout of ``test_distrib_optim_file`` (Megatron-LM's
gradient buffer rebuilt element by element from its documented rules, not from this project's
code): every parameter's values must sit in its slice, bit for bit, and the gaps between
parameters must be zero, as Megatron-LM's gather leaves them. The project's own reader must give
back the state that was written.
"""

import argparse

import pytest
import torch

from megatron.checkpoint import distrib_optim_file as dof
from megatron.checkpoint.layout import CheckpointError
from megatron.model import GPTModel
from tests.unit.test_distrib_optim_file import (KEYS, megatron_order, naive_buckets,
                                                naive_file, random_values, read_back,
                                                saved_args)
from tests.unit.test_gpt_model import make_config, single_process_state


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPTModel(make_config(params_dtype=torch.float32), single_process_state())


def _groups(model):
    """Two param groups as the builder makes them: matrices (decayed), then the rest."""
    params = list(model.named_parameters())
    decayed = [p for n, p in params if p.dim() > 1]
    rest = [p for n, p in params if p.dim() <= 1]
    return [decayed, rest]


def _param_state(model, values):
    by_param = {p: values[n] for n, p in model.named_parameters()}
    return [[by_param[p] for p in group] for group in _groups(model)]


def naive_read(content, numels, bucket_size, dp):
    """``{name: {key: flat values}}`` and the gap mask, read at the naive layout's offsets."""
    where, unpadded = naive_buckets(numels, bucket_size, dp)
    (dtype, entry), = content[0].items()
    starts = [sum(unpadded[:b]) for b in range(len(unpadded))]
    gaps = torch.ones(sum(unpadded), dtype=torch.bool)
    out = {}
    for name, (b, start) in where.items():
        lo = starts[b] + start
        out[name] = {k: entry[k][lo:lo + numels[name]] for k in KEYS}
        gaps[lo:lo + numels[name]] = False
    return out, gaps, entry, dtype


@pytest.mark.parametrize("overlap,bucket_size,dp", [(False, None, 2), (True, 3000, 2),
                                                    (True, 100, 8)])
def test_every_parameter_written_to_its_slice(tmp_path, model, overlap, bucket_size, dp):
    values = random_values(model)
    args = saved_args(overlap_grad_reduce=overlap, ddp_bucket_size=bucket_size,
                      data_parallel_size=dp)
    content = dof.coalesced_state(_param_state(model, values), [model], _groups(model), args)
    assert content["buckets_coalesced"] is True
    assert sorted(k for k in content if isinstance(k, int)) == [0]
    numels = {n: values[n]["param"].numel() for n in megatron_order()}
    got, gaps, entry, dtype = naive_read(content, numels, bucket_size if overlap else None, dp)
    assert dtype == (torch.float32, torch.float32)
    assert entry["numel_unpadded"] == gaps.numel()
    for name in megatron_order():
        for key in KEYS:
            assert entry[key].dtype == torch.float32 and entry[key].numel() == gaps.numel()
            assert torch.equal(got[name][key], values[name][key].reshape(-1)), (name, key)
    for key in KEYS:
        assert gaps.any() and torch.count_nonzero(entry[key][gaps]) == 0
    # The project's reader gets back exactly what was written.
    path = tmp_path / dof.FILE_NAME
    torch.save(content, path)
    back = read_back(path, model, args)
    for name in megatron_order():
        for key in KEYS:
            assert torch.equal(back[name][key], values[name][key]), (name, key)


def test_split_leaves_param_groups_and_scaler_in_the_model_file(model):
    values = random_values(model)
    groups = [{"lr": 1e-3, "wd_mult": 1.0, "lr_mult": 1.0, "step": 5, "params": [0, 1]},
              {"lr": 1e-3, "wd_mult": 0.0, "lr_mult": 1.0, "step": 5, "params": [0]}]
    state = {"optimizer": {"param_groups": groups}, "param_state": _param_state(model, values),
             "grad_scaler": {"scale": 4.0}}
    optimizer = argparse.Namespace(model_param_groups=_groups(model), grad_buffers={})
    entry, content = dof.split_for_save(state, [model], optimizer, saved_args())
    # Megatron-Core matches groups by these four keys and its fused Adam reads bias_correction.
    megatron = {"is_expert_parallel": False, "is_decoupled_lr": False, "bias_correction": True}
    assert entry == {"optimizer": {"param_groups": [
        {"lr": 1e-3, "wd_mult": 1.0, "lr_mult": 1.0, "step": 5, **megatron},
        {"lr": 1e-3, "wd_mult": 0.0, "lr_mult": 1.0, "step": 5, **megatron}]},
        "grad_scaler": {"scale": 4.0}}
    assert "params" in groups[0]  # the live state is left alone
    assert dof.is_megatron_layout(entry) and not dof.is_megatron_layout(state)
    assert entry["optimizer"]["param_groups"][0]["step"] == 5
    assert set(content) == {"buckets_coalesced", 0}


def test_cases_the_reader_refuses_keep_the_state_in_the_model_file(model):
    adam = argparse.Namespace(config=argparse.Namespace(optimizer="adam"), grad_buffers={})
    assert dof.megatron_layout_refusal([model], adam) == ""
    sgd = argparse.Namespace(config=argparse.Namespace(optimizer="sgd"), grad_buffers={})
    assert "--optimizer sgd" in dof.megatron_layout_refusal([model], sgd)
    experts = argparse.Namespace(config=adam.config, grad_buffers={(0, torch.float32, True): 0})
    assert "expert" in dof.megatron_layout_refusal([model], experts)
    embedding = model.language_model.embedding.word_embeddings.weight
    embedding.shared_embedding = True
    why = dof.megatron_layout_refusal([model], adam)
    assert "word_embeddings.weight" in why and "tied across pipeline stages" in why


def test_replicated_optimizer_gets_a_clear_error_for_the_megatron_layout():
    entry = {"optimizer": {"param_groups": [{"lr": 1.0, "step": 1}]}}
    with pytest.raises(CheckpointError, match="rank/model_optim_rng.pt.*--use-distributed-opt"):
        dof.has_megatron_layout(entry, object(), "rank/model_optim_rng.pt")
    replicated = {"optimizer": {"state": {}, "param_groups": [{"lr": 1.0, "params": [0]}]}}
    assert not dof.has_megatron_layout(replicated, object(), "x")


@pytest.mark.parametrize("legacy", [False, True], ids=["coalesced", "legacy"])
def test_converter_reads_the_file_beside_the_model_file(tmp_path, model, legacy):
    """The converter has the saved model trees, not the modules: it lays the buffers out from
    the trees and finds each parameter's moments and main copy in a file the naive writer
    made (a sentinel between parameters)."""
    from megatron.checkpoint.optimizer_state import MAIN, SourceOptimizer

    values = random_values(model)
    torch.save(naive_file(values, dp=2, legacy=legacy), tmp_path / dof.FILE_NAME)
    groups = [{"lr": 1e-3, "wd_mult": 1.0, "lr_mult": 1.0, "step": 3},
              {"lr": 1e-3, "wd_mult": 0.0, "lr_mult": 1.0, "step": 3}]
    state = {"optimizer": {"optimizer": {"param_groups": groups}}, "args": saved_args(),
             "model": {n: p.detach() for n, p in model.named_parameters()}}
    found, why = SourceOptimizer.read(state, [state["model"]], str(tmp_path / "model.pt"))
    assert why == "" and found.step == 3
    for name in megatron_order():
        entry = found.entries[(0, name)]
        assert torch.equal(entry[MAIN], values[name]["param"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(entry[key], values[name][key]), (name, key)
    missing, why = SourceOptimizer.read(state, [state["model"]], str(tmp_path / "x" / "m.pt"))
    assert missing is None and "distrib_optim.pt: not found" in why
