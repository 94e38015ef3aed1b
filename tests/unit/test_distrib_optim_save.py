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


def naive_read(content, numels, bucket_size, dp, own=()):
    """``{name: {key: flat values}}`` and the gap mask, read at the naive layout's offsets."""
    where, unpadded = naive_buckets(numels, bucket_size, dp, own=own)
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
    model.language_model.encoder.layers[0].mlp.dense_h_to_4h.weight.allreduce = False
    why = dof.megatron_layout_refusal([model], adam)
    assert "expert parameters (language_model.encoder.layers.0.mlp.dense_h_to_4h.weight)" in why


# The word embedding of a first stage (last in the buffer), and a parameter first in the buffer
# (as the head's copy of the embedding is on a last stage), which moves every later one.
TIED = [("first_stage", ("language_model.embedding.word_embeddings.weight",)),
        ("last_stage", ("language_model.encoder.final_layernorm.bias",))]


@pytest.mark.parametrize("own", [o for _, o in TIED], ids=[i for i, _ in TIED])
def test_tied_embedding_gets_a_bucket_of_its_own(tmp_path, model, own):
    """Megatron-LM gives a word embedding tied across pipeline stages (``shared_embedding``)
    a bucket of its own; written and read at the naive layout's offsets."""
    params = dict(model.named_parameters())
    for name in own:
        params[name].shared_embedding = True
    adam = argparse.Namespace(config=argparse.Namespace(optimizer="adam"), grad_buffers={})
    assert dof.megatron_layout_refusal([model], adam) == ""
    values = random_values(model)
    args = saved_args(data_parallel_size=2)
    content = dof.coalesced_state(_param_state(model, values), [model], _groups(model), args)
    numels = {n: values[n]["param"].numel() for n in megatron_order()}
    got, gaps, entry, _ = naive_read(content, numels, None, 2, own)
    assert entry["numel_unpadded"] == gaps.numel()
    for name in megatron_order():
        for key in KEYS:
            assert torch.equal(got[name][key], values[name][key].reshape(-1)), (name, key)
    torch.save(naive_file(values, dp=2, own=own), tmp_path / dof.FILE_NAME)
    back = read_back(tmp_path / dof.FILE_NAME, model, args)
    for name in megatron_order():
        for key in KEYS:
            assert torch.equal(back[name][key], values[name][key]), (name, key)
    plain, tied = _flat_starts(numels), _flat_starts(numels, own)
    # Before the embedding the open bucket closes at its aligned start (no move); after a
    # parameter with a bucket of its own the next one starts unaligned.
    assert (plain != tied) == (own == TIED[1][1])


def _flat_starts(numels, own=()):
    where, unpadded = naive_buckets(numels, None, 2, own=own)
    return {n: sum(unpadded[:b]) + start for n, (b, start) in where.items()}


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


def test_converter_places_a_head_copy_tied_across_stages(tmp_path):
    """A last pipeline stage's tree (legacy names): the head's copy of a tied embedding,
    registered last, opens the buffer in a bucket of its own, so the next parameter starts
    right after it (35 elements, not 64); the converter must find every slice there."""
    from megatron.checkpoint.optimizer_state import MAIN, SourceOptimizer

    g = torch.Generator().manual_seed(3)
    shapes = {"language_model.encoder.final_layernorm.weight": (8,),
              "language_model.encoder.final_layernorm.bias": (8,),
              "word_embeddings_for_head.weight": (5, 7)}
    values = {n: {k: torch.randn(s, generator=g) for k in KEYS} for n, s in shapes.items()}
    own = ("word_embeddings_for_head.weight",)
    torch.save(naive_file(values, dp=2, own=own), tmp_path / dof.FILE_NAME)
    groups = [{"lr": 1e-3, "wd_mult": 1.0, "lr_mult": 1.0, "step": 2},
              {"lr": 1e-3, "wd_mult": 0.0, "lr_mult": 1.0, "step": 2}]
    tree = {n: v["param"].clone() for n, v in values.items()}
    args = saved_args(pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=False)
    state = {"optimizer": {"optimizer": {"param_groups": groups}}, "args": args, "model": tree}
    found, why = SourceOptimizer.read(state, [tree], str(tmp_path / "model.pt"))
    assert why == ""
    for name in shapes:
        assert torch.equal(found.entries[(0, name)][MAIN], values[name]["param"]), name
        assert torch.equal(found.entries[(0, name)]["exp_avg_sq"], values[name]["exp_avg_sq"])
    # Read as if untied, the layernorm slices would be looked for at 64, 128: not there.
    state["args"] = saved_args(pipeline_model_parallel_size=2)
    found, why = SourceOptimizer.read(state, [tree], str(tmp_path / "model.pt"))
    assert found is None or not torch.equal(
        found.entries[(0, "language_model.encoder.final_layernorm.bias")][MAIN],
        values["language_model.encoder.final_layernorm.bias"]["param"])
