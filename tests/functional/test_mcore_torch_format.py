"""``--ckpt-format torch`` files of a Megatron-Core model: Megatron-LM's default model since 2024
saved with ``--ckpt-format torch``, and its converter's ``--saver core`` output
(``megatron/checkpoint/mcore_torch.py``).

The files are made from the tensors of Megatron's own ``torch_dist`` fixture (``mcore_dist_tp1``:
the model of ``legacy_tp1``, whose logits Megatron recorded), laid out as Megatron-LM's torch
saver lays out a Megatron-Core chunk: its flat state dict under ``model``, each rank's shard,
``_extra_state`` entries, in either norm spelling. ``tests/interop/test_megatron_core.py`` loads
one that Megatron-Core itself writes.
"""

import argparse
import os
import shutil

import pytest
import torch

from megatron.checkpoint.dist import DistCheckpointReader
from megatron.checkpoint.safe_unpickle import stand_ins_in, torch_load
from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load, fixture_dir,
                                                    megatron_argv, reference)
from tests.multiprocess import run_on_ranks

# Megatron-Core's split of each layer tensor over TP ranks (dim), others replicated.
SPLIT = {"self_attention.linear_qkv.weight": 0, "self_attention.linear_qkv.bias": 0,
         "self_attention.linear_proj.weight": 1, "mlp.linear_fc1.weight": 0,
         "mlp.linear_fc1.bias": 0, "mlp.linear_fc2.weight": 1}
LOCAL_SPEC = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
              "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm."}
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")


def _megatron_args(tp: int) -> argparse.Namespace:
    """The fixture run's saved args (its Megatron classes left out), at ``tp``."""
    saved = torch_load(os.path.join(fixture_dir("legacy_tp1"), "iter_0000010", "mp_rank_00",
                                    "model_optim_rng.pt"))["args"]
    args = argparse.Namespace(**vars(saved))
    for name, _ in stand_ins_in(args):
        setattr(args, name.split(".")[0], None)
    args.tensor_model_parallel_size = tp
    args.use_legacy_models = False
    return args


def _mcore_rank_state(tp: int, rank: int, spec: str) -> dict:
    """Rank ``rank``'s flat Megatron-Core state of the fixture model at ``tp``."""
    reader = DistCheckpointReader(os.path.join(fixture_dir("mcore_dist_tp1"), "iter_0000010"))
    state = {}
    for key in reader.tensor_keys():
        whole = reader.read(key)
        if key == "embedding.word_embeddings.weight":
            state[key] = whole.chunk(tp, 0)[rank].clone()
            continue
        if not key.startswith("decoder.layers."):
            state[key] = whole
            continue
        inner = key[len("decoder.layers."):]
        for layer in range(whole.shape[0]):
            tensor = whole[layer]
            if inner in SPLIT:
                tensor = tensor.chunk(tp, SPLIT[inner])[rank]
            name = inner
            for fused, local in LOCAL_SPEC.items():
                if spec == "local" and name.startswith(fused):
                    name = local + name[len(fused):]
            state[f"decoder.layers.{layer}.{name}"] = tensor.clone()
    for layer in range(4):
        for module in EXTRA_STATE_MODULES:
            state[f"decoder.layers.{layer}.{module}._extra_state"] = (
                None if spec == "local" else torch.empty(0, dtype=torch.uint8))
    return state


def _write(root, tp: int, spec: str, extra: dict = None) -> str:
    """A Megatron-LM torch-format save of the fixture model at ``tp``; returns the folder."""
    root = str(root)
    for rank in range(tp):
        folder = os.path.join(root, "iter_0000010", f"mp_rank_{rank:02d}")
        os.makedirs(folder)
        state = {"args": _megatron_args(tp), "checkpoint_version": 3.0, "iteration": 10,
                 "model": _mcore_rank_state(tp, rank, spec), **(extra or {})}
        torch.save(state, os.path.join(folder, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("10")
    shutil.copy(os.path.join(fixture_dir("legacy_tp1"), "reference.pt"), root)
    return root


@pytest.mark.parametrize("tp, spec", [(1, "transformer_engine"), (2, "local")])
def test_a_megatron_core_torch_save_gives_megatrons_logits(tmp_path, tp, spec):
    load = _write(tmp_path / "ckpt", tp, spec)
    argv = megatron_argv("legacy_tp1") + ["--load", load, "--device", "cpu"]
    argv[argv.index("--tensor-model-parallel-size") + 1] = str(tp)
    for logits, iteration, _ in run_on_ranks(_logits_after_load, tp, argv):
        assert iteration == 10
        torch.testing.assert_close(logits.float(), reference("legacy_tp1")["logits"],
                                   atol=LOGITS_ATOL, rtol=0)


def _train_from(argv):
    from tests.functional.gpt_runs import run_pretrain

    try:
        return run_pretrain(argv)
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        return {"error": f"{type(err).__name__}: {err}"}


def test_its_optimizer_state_is_refused_and_the_weights_train_on(tmp_path):
    """Its Adam state lists Megatron-Core's parameter order, which is not mapped: resuming is
    refused by name, and --no-load-optim trains on from the weights."""
    load = _write(tmp_path / "ckpt", 1, "transformer_engine",
                  {"optimizer": {"state": {}, "param_groups": []}, "opt_param_scheduler": {},
                   "rng_state": []})
    base = megatron_argv("legacy_tp1") + [
        "--load", load, "--device", "cpu", "--mock-data", "--exit-interval", "12",
        "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0", "--no-load-rng"]
    refused = run_on_ranks(_train_from, 1, base)[0]
    assert "a Megatron-Core model saved with --ckpt-format torch" in refused["error"]
    assert "--no-load-optim" in refused["error"]
    out = run_on_ranks(_train_from, 1, base + ["--no-load-optim"])[0]
    assert "error" not in out, out
    assert out["iteration"] == 12 and torch.isfinite(torch.tensor(out["losses"])).all()


def _load_error(argv):
    try:
        _logits_after_load(argv)
    except Exception as err:  # noqa: BLE001 - the message is what the test reads
        return str(err)
    return None


def test_a_key_it_cannot_place_is_named(tmp_path):
    load = _write(tmp_path / "ckpt", 1, "transformer_engine")
    path = os.path.join(load, "iter_0000010", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.mlp.linear_fc3.weight"] = torch.zeros(2)
    del state["model"]["decoder.final_layernorm.bias"]
    torch.save(state, path)
    argv = megatron_argv("legacy_tp1") + ["--load", load, "--device", "cpu"]
    error = run_on_ranks(_load_error, 1, argv)[0]
    assert "model state does not fit the model" in error
    assert "language_model.encoder.final_layernorm.bias" in error     # missing, by model name
    assert "decoder.layers.0.mlp.linear_fc3.weight" in error          # unexpected, by its key
