"""``--ckpt-format torch_dist`` in training: Megatron-Core's files load and resume, and a
checkpoint saved at one parallel layout continues at another.

References: the logits Megatron-Core's own forward gave (``reference.pt``), the Adam moments in
its file, Megatron's learning-rate schedule in float64, and the losses of the run that never
stopped (fp32, dropout 0).
"""

import os

import pytest
import torch

from megatron.checkpoint.dist import DistCheckpointReader
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.functional.test_megatron_written import (LOGITS_ATOL, _logits_after_load,
                                                    _resume_state, fixture_dir,
                                                    megatron_argv, megatron_cosine_lr,
                                                    reference, writable_copy)
from tests.multiprocess import run_on_ranks

# Continued losses of a resharded run against the run that never stopped (fp32; the
# reduction order of the matmuls and of the gradient all-reduces changes with the layout).
LOSS_ATOL = 1e-4


def _with_layout(argv, tp, pp=1):
    argv = list(argv)
    argv[argv.index("--tensor-model-parallel-size") + 1] = str(tp)
    argv[argv.index("--pipeline-model-parallel-size") + 1] = str(pp)
    return argv


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_megatron_core_file_gives_its_logits(tp):
    name = "mcore_dist_tp1"
    argv = _with_layout(megatron_argv(name), tp) + ["--load", fixture_dir(name), "--device",
                                                    "cpu"]
    for logits, iteration, _ in run_on_ranks(_logits_after_load, tp, argv):
        assert iteration == 10
        torch.testing.assert_close(logits.float(), reference(name)["logits"],
                                   atol=LOGITS_ATOL, rtol=0)


def _mcore_key(name: str) -> str:
    """Megatron-Core's key of a legacy parameter name, and its layer (None if not stacked)."""
    from megatron.checkpoint.dist.keys import mcore_key

    return mcore_key(name)


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_megatron_core_trained_file_resumes_with_its_schedule_and_moments(tmp_path, tp):
    from megatron.checkpoint.dist import chunk_layout
    from megatron.checkpoint.dist.model_state import read_local

    name = "mcore_dist_tp1_trained"
    load = writable_copy(name, tmp_path)
    argv = _with_layout(megatron_argv(name), tp) + ["--load", load, "--device", "cpu",
                                                    "--mock-data"]
    results = run_on_ranks(_resume_state, tp, argv)
    reader = DistCheckpointReader(os.path.join(load, "iter_0000003"))
    for tp_rank, out in enumerate(results):
        assert out["iteration"] == 3 and out["consumed"] == 6 and out["num_steps"] == 6
        assert out["next_lrs"] == pytest.approx([megatron_cosine_lr(8)] * 2, rel=1e-12)
        assert len(out["moments"]) == 12 * 4 + 4  # 12 per layer, embeddings, final norm
        layout = chunk_layout(_Config(), _Layout(tp_rank, tp))
        for param, have in out["moments"].items():
            for field in ("exp_avg", "exp_avg_sq"):
                want = read_local(reader, param, have[field], layout,
                                  f"optimizer.state.{field}.")
                assert torch.equal(have[field], want), (param, field, tp_rank)
            assert float(have["step"]) == 3


class _Config:
    num_layers, swiglu = 4, False
    first_pipeline_num_layers = last_pipeline_num_layers = None


class _Layout:
    def __init__(self, tp_rank, tp_size):
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, 0, 1
        self.virtual_pp_size, self.dp_rank = None, 0


# --------------------------------------------------------------------------------------------
# Saved at one layout, continued at another
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("data") / "counting"))


def _flags(corpus, tp=1, pp=1, extra=()):
    return gpt_flags(corpus, 8, tp=tp, dropout=0.0, micro_batch=1, extra=[
        "--pipeline-model-parallel-size", str(pp), "--num-layers", "4",
        "--ckpt-format", "torch_dist", *extra])


LAYOUTS = {
    "tp2pp2": dict(tp=2, pp=2, dp=1, extra=["--num-layers-per-virtual-pipeline-stage", "1"]),
    "tp1dp4_distopt": dict(tp=1, pp=1, dp=4, extra=["--use-distributed-optimizer"]),
    "tp2dp2_distopt": dict(tp=2, pp=1, dp=2, extra=["--use-distributed-optimizer"]),
    "tp2": dict(tp=2, pp=1, dp=1, extra=[]),
    "dp2_distopt": dict(tp=1, pp=1, dp=2, extra=["--use-distributed-optimizer"]),
}


def _run(corpus, layout, extra=()):
    spec = LAYOUTS[layout]
    ranks = spec["tp"] * spec["pp"] * spec["dp"]
    flags = _flags(corpus, spec["tp"], spec["pp"], spec["extra"] + list(extra))
    return run_on_ranks(run_pretrain, ranks, flags)[-1]


@pytest.fixture(scope="module")
def straight(corpus):
    """The uninterrupted run's losses (one process)."""
    out = run_on_ranks(run_pretrain, 1, _flags(corpus))[0]
    return dict(out["losses"])


def _assert_continues(resumed, straight, exact=False, first=5):
    assert [i for i, _ in resumed["losses"]] == list(range(first, 9))
    for i, loss in resumed["losses"]:
        if exact:
            assert loss == straight[i], (i, resumed["losses"], straight)
        else:
            assert abs(loss - straight[i]) <= LOSS_ATOL, (i, resumed["losses"], straight)


def test_resume_at_the_same_layout_is_bit_exact_and_another_layout_continues(corpus, tmp_path,
                                                                            straight):
    save = str(tmp_path / "tp2")
    full = _run(corpus, "tp2", ["--save", save, "--save-interval", "4"])
    again = _run(corpus, "tp2", ["--load", save, "--ckpt-step", "4"])
    _assert_continues(again, dict(full["losses"]), exact=True)
    iter_dir = os.path.join(save, "iter_0000004")
    assert sorted(f for f in os.listdir(iter_dir) if f.endswith(".distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]   # each rank wrote its own shards
    # The distributed optimizer reads its share of a file saved without it, and saves its
    # own share: every DP rank writes part of each moment, and a resume is bit-exact again.
    sharded = str(tmp_path / "dp2")
    other = _run(corpus, "dp2_distopt", ["--load", save, "--ckpt-step", "4", "--save", sharded,
                                         "--save-interval", "2"])
    _assert_continues(other, straight)
    reader = DistCheckpointReader(os.path.join(sharded, "iter_0000006"))
    writers = {key: {reader.chunk_file(key, offset) for offset, _ in reader.chunks(key)}
               for key in reader.tensor_keys() if key.startswith("optimizer.state.exp_avg.")}
    assert set.union(*writers.values()) == {"__0_0.distcp", "__1_0.distcp"}, writers
    again = _run(corpus, "dp2_distopt", ["--load", sharded, "--ckpt-step", "6"])
    _assert_continues(again, dict(other["losses"]), exact=True, first=7)


@pytest.mark.slow  # also swept, killed at every point, in tests/reliability
def test_async_save_writes_the_same_checkpoint(corpus, tmp_path, straight):
    save = str(tmp_path / "async")
    _run(corpus, "dp2_distopt", ["--save", save, "--save-interval", "4", "--async-save"])
    resumed = _run(corpus, "tp2", ["--load", save, "--ckpt-step", "4"])
    _assert_continues(resumed, straight)


@pytest.mark.slow
@pytest.mark.parametrize("saved", ["tp2pp2", "tp1dp4_distopt", "tp2dp2_distopt"])
def test_reshard_matrix(corpus, tmp_path, straight, saved):
    save = str(tmp_path / saved)
    _run(corpus, saved, ["--save", save, "--save-interval", "4"])
    for target in ("tp2pp2", "tp1dp4_distopt", "tp2dp2_distopt"):
        if target != saved:
            _assert_continues(_run(corpus, target, ["--load", save, "--ckpt-step", "4"]),
                              straight)


@pytest.mark.slow
def test_convert_while_loading_writes_the_other_format(corpus, tmp_path):
    """--ckpt-convert-format / --ckpt-convert-save: load, write it in the other format, exit."""
    from megatron.training import checkpointing

    save, converted = str(tmp_path / "dist"), str(tmp_path / "legacy")
    _run(corpus, "tp2", ["--save", save, "--save-interval", "8"])
    out = _run(corpus, "tp2", ["--load", save, "--ckpt-convert-format", "torch",
                               "--ckpt-convert-save", converted])
    assert out["losses"] == []
    state = checkpointing.load_state_file(checkpointing.checkpoint_file(converted, 8, 1, 0, 1))
    assert state["iteration"] == 8 and "optimizer" in state


def test_a_training_save_has_megatron_cores_keys_shapes_and_dtypes(tmp_path):
    """The fixture's own flags, trained here for 3 iterations and saved as torch_dist: the
    same tensor keys, global shapes and dtypes as Megatron-Core's file of that run, and the
    same byte entries."""
    name = "mcore_dist_tp1_trained"
    save = str(tmp_path / "ours")
    argv = megatron_argv(name)
    argv[argv.index("--train-iters") + 1] = "3"
    argv += ["--save", save, "--device", "cpu", "--mock-data", "--eval-iters", "0",
             "--num-workers", "0"]
    run_on_ranks(run_pretrain, 1, argv)
    ours = DistCheckpointReader(os.path.join(save, "iter_0000003"))
    theirs = DistCheckpointReader(os.path.join(fixture_dir(name), "iter_0000003"))
    assert ours.summary() == theirs.summary()
    assert sorted(ours.byte_keys()) == sorted(theirs.byte_keys())
    mine, megatrons = ours.common_state(), theirs.common_state()
    assert set(megatrons) - set(mine) == {"rerun_state_machine"}
    assert float(mine["optimizer"]["state"]["common_step"]) == 3
    assert [(g["wd_mult"], g["lr_mult"]) for g in mine["optimizer"]["param_groups"]] == [
        (g["wd_mult"], g["lr_mult"]) for g in megatrons["optimizer"]["param_groups"]]


def _table_after_load(argv):
    """Rank body: this rank's word-embedding rows and their exp_avg after loading."""
    out = _resume_state(argv)
    name = "language_model.embedding.word_embeddings.weight"
    return out["moments"][name]["exp_avg"], out["iteration"]


@pytest.mark.slow
def test_another_tp_size_with_another_vocabulary_padding_loads(corpus, tmp_path):
    """The table is padded to a multiple of 32 x TP here: 160 rows at TP 1, 192 at TP 2. Saved
    at TP 2 and loaded at TP 1 (and the reverse), the rows both paddings have are the saved
    ones, extra padding rows are dropped or come in as zeros, and training goes on."""
    pad = ["--make-vocab-size-divisible-by", "32"]
    save2, save1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    _run(corpus, "tp2", pad + ["--save", save2, "--save-interval", "4"])
    run_on_ranks(run_pretrain, 1, _flags(corpus, extra=pad + ["--save", save1,
                                                              "--save-interval", "4"]))
    key = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
    saved2 = DistCheckpointReader(os.path.join(save2, "iter_0000004")).read(key)
    saved1 = DistCheckpointReader(os.path.join(save1, "iter_0000004")).read(key)
    assert saved2.shape[0] == 192 and saved1.shape[0] == 160

    at1 = run_on_ranks(_table_after_load, 1, _flags(corpus, extra=pad + [
        "--load", save2, "--ckpt-step", "4", "--mock-data"]))[0][0]
    assert torch.equal(at1, saved2[:160])
    at2 = run_on_ranks(_table_after_load, 2, _flags(corpus, tp=2, extra=pad + [
        "--load", save1, "--ckpt-step", "4", "--mock-data"]))
    whole = torch.cat([rows for rows, _ in at2])
    assert torch.equal(whole[:160], saved1) and not whole[160:].any()
    resumed = run_on_ranks(run_pretrain, 1, _flags(corpus, extra=pad + ["--load", save2,
                                                                        "--ckpt-step", "4"]))[0]
    assert [i for i, _ in resumed["losses"]] == [5, 6, 7, 8]


def _weights_only_load(argv):
    """Rank body: load --load's weights into a fresh model; the error text, if any."""
    import pretrain_gpt
    from megatron.training import checkpointing
    from megatron.training import global_vars
    from megatron.inference import initialize_for_inference, load_model_for_inference

    try:
        args, pstate, _ = initialize_for_inference(argv=argv)
        load_model_for_inference(pretrain_gpt.model_provider, args, pstate)
        return None
    except checkpointing.CheckpointError as err:
        return str(err)
    finally:
        global_vars.unset_global_variables()


def _with_an_extra_tensor(name: str, dest) -> str:
    """A copy of a torch_dist fixture with one more saved tensor, in a second data file."""
    import pickle

    from megatron.checkpoint.dist.writer import ShardWriter, build_metadata
    from megatron.checkpoint.safe_unpickle import load_dcp_metadata

    root = writable_copy(name, dest)
    iter_dir = os.path.join(root, "iter_0000010")
    with ShardWriter(iter_dir, rank=1) as writer:
        writer.add_tensor("decoder.extra_head.weight", torch.ones(3, 4), (3, 4), (0, 0))
    extra = build_metadata(writer.records)
    metadata = load_dcp_metadata(os.path.join(iter_dir, ".metadata"))
    metadata.state_dict_metadata.update(extra.state_dict_metadata)
    metadata.storage_data.update(extra.storage_data)
    with open(os.path.join(iter_dir, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return root


def test_strictness_decides_about_saved_tensors_the_model_lacks(tmp_path, capfd):
    """A saved tensor this model has no place for is ignored by default, listed with
    log_unexpected, and stops the load with raise_unexpected."""
    load = _with_an_extra_tensor("mcore_dist_tp1", tmp_path)
    base = megatron_argv("mcore_dist_tp1") + ["--load", load, "--device", "cpu"]
    assert run_on_ranks(_weights_only_load, 1, base)[0] is None
    logged = run_on_ranks(_weights_only_load, 1, base + ["--dist-ckpt-strictness",
                                                          "log_unexpected"])[0]
    assert logged is None
    assert "decoder.extra_head.weight; ignored" in capfd.readouterr().out
    error = run_on_ranks(_weights_only_load, 1, base + ["--dist-ckpt-strictness",
                                                         "raise_unexpected"])[0]
    assert "1 saved tensor(s) this model has no place for: decoder.extra_head.weight" in error


def _without_a_tensor(name: str, dest, key: str) -> str:
    """A copy of a torch_dist fixture whose metadata no longer lists ``key``."""
    import pickle

    from megatron.checkpoint.safe_unpickle import load_dcp_metadata

    root = writable_copy(name, dest)
    path = os.path.join(root, "iter_0000010", ".metadata")
    metadata = load_dcp_metadata(path)
    del metadata.state_dict_metadata[key]
    for index in [i for i in metadata.storage_data if i.fqn == key]:
        del metadata.storage_data[index]
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    return root


def _final_norm_after_load(argv):
    """Rank body: the final layer norm's weight after loading --load, or the error text."""
    import pretrain_gpt
    from megatron.training import checkpointing
    from megatron.training import global_vars
    from megatron.inference import initialize_for_inference, load_model_for_inference

    try:
        args, pstate, _ = initialize_for_inference(argv=argv)
        chunks, _ = load_model_for_inference(pretrain_gpt.model_provider, args, pstate)
        norms = [p for n, p in chunks[0].named_parameters() if "final" in n and "weight" in n]
        return norms[0].detach().clone()
    except checkpointing.CheckpointError as err:
        return str(err)
    finally:
        global_vars.unset_global_variables()


def test_strictness_decides_about_tensors_the_checkpoint_lacks(tmp_path, capfd):
    """As Megatron-Core's StrictHandling: a tensor the model needs and the checkpoint lacks
    stops the load by default and with raise_all; with log_all it is listed and, as with
    ignore_all, keeps the model's own (initial) value while the rest loads."""
    key = "decoder.final_layernorm.weight"
    load = _without_a_tensor("mcore_dist_tp1", tmp_path, key)
    base = megatron_argv("mcore_dist_tp1") + ["--load", load, "--device", "cpu"]
    for mode in (None, "raise_all", "log_unexpected"):
        flags = base + (["--dist-ckpt-strictness", mode] if mode else [])
        error = run_on_ranks(_final_norm_after_load, 1, flags)[0]
        assert isinstance(error, str) and key in error, (mode, error)
    capfd.readouterr()
    for mode in ("log_all", "ignore_all", "return_all"):
        norm = run_on_ranks(_final_norm_after_load, 1,
                            base + ["--dist-ckpt-strictness", mode])[0]
        assert torch.equal(norm, torch.ones_like(norm)), mode   # a fresh LayerNorm's weight
        out = capfd.readouterr().out
        listed = f"{key}; they keep their current values (--dist-ckpt-strictness {mode})"
        assert (listed in out) == (mode == "log_all"), (mode, out)
