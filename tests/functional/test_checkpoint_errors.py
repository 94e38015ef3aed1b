"""Checkpoints: wrong layout, wrong shape, corrupt or malicious files, missing or failed saves."""

import os
import pickle

import pytest
import torch

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


@pytest.fixture(scope="module")
def saved(corpus, tmp_path_factory):
    """A TP=1 checkpoint at iteration 2, in the torch format (one file per rank): the tests
    below are about that format's files and its layout check."""
    save = str(tmp_path_factory.mktemp("ckpt") / "save")
    run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 2, extra=["--save", save,
                                                              "--ckpt-format", "torch"]))
    return save


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_layout_mismatch_names_both_layouts_and_tool(corpus, saved):
    with pytest.raises(AssertionError, match=r"saved with tensor-model-parallel size 1 x "
                       r"pipeline-model-parallel size 1, but this run uses 2 x 1; run with "
                       r"--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1, or "
                       r"convert it first: python tools/checkpoint/convert.py --model-type "
                       r"GPT .* "
                       r"--target-tensor-parallel-size 2 --target-pipeline-parallel-size 1"):
        run_on_ranks(run_pretrain, 2, gpt_flags(corpus, 4, tp=2, extra=["--load", saved]))


def test_shape_mismatch_lists_flags(corpus, saved):
    flags = gpt_flags(corpus, 4, extra=["--load", saved])
    flags[flags.index("--hidden-size") + 1] = "64"
    flags[flags.index("--num-layers") + 1] = "3"
    with pytest.raises(AssertionError, match=r"model shape differs from the flags: "
                       r"--num-layers \(checkpoint 2, flags 3\); --hidden-size \(checkpoint 32, "
                       r"flags 64\)"):
        run_on_ranks(run_pretrain, 1, flags)


def _load_into_fresh_model(flags):
    """Build model/optimizer as pretrain does, try to load, report whether weights changed."""
    import pretrain_gpt
    from megatron.training import checkpointing
    from megatron.training import global_vars
    from megatron.training.arguments import build_configs, parse_args, validate_args
    from megatron.training.initialize import initialize_megatron
    from megatron.tokenizer import build_tokenizer
    from megatron.training.training import setup_model_and_optimizer

    args = validate_args(parse_args(argv=flags))
    pstate = initialize_megatron(args)
    tokenizer = build_tokenizer(args)
    build_configs(args)
    global_vars.set_global_variables(args=args, tokenizer=tokenizer, parallel_state=pstate)
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, args,
                                                            pstate)
    before = [p.detach().clone() for p in model[0].parameters()]
    try:
        checkpointing.load_checkpoint(model, optimizer, scheduler, args, pstate)
        error = None
    except checkpointing.CheckpointError as err:
        error = str(err)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model[0].parameters()))
    global_vars.unset_global_variables()
    return error, unchanged


def test_corrupt_file_is_named_and_nothing_loaded(corpus, saved, tmp_path):
    load = _copy(saved, str(tmp_path / "corrupt"))
    path = os.path.join(load, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    error, unchanged = run_on_ranks(_load_into_fresh_model,
                                    1, gpt_flags(corpus, 4, extra=["--load", load]))[0]
    assert error is not None and path in error and "cannot be read" in error
    assert unchanged


def test_missing_tensor_is_reported_before_loading(corpus, saved, tmp_path):
    load = _copy(saved, str(tmp_path / "partial"))
    path = os.path.join(load, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    del state["model"]["language_model"]["encoder"]["final_layernorm.weight"]
    state["model"]["language_model"]["embedding"]["word_embeddings"]["weight"].mul_(2)
    torch.save(state, path)
    error, unchanged = run_on_ranks(_load_into_fresh_model,
                                    1, gpt_flags(corpus, 4, extra=["--load", load]))[0]
    assert "missing ['language_model.encoder.final_layernorm.weight']" in error
    assert unchanged  # the doubled embedding was not copied in before the check failed


class _Payload:
    """Pickles to a call of os.system: what a hostile checkpoint would hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused(corpus, saved, tmp_path):
    load = _copy(saved, str(tmp_path / "evil"))
    path = os.path.join(load, "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    marker = str(tmp_path / "code_ran")
    state = torch.load(path, weights_only=False)
    state["args"] = _Payload(marker)
    with open(path, "wb") as f:
        torch.save(state, f, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(AssertionError, match=r"refusing to load; the file holds objects other "
                       r"than tensors and plain data"):
        run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 4, extra=["--load", load]))
    assert not os.path.exists(marker)


def test_missing_checkpoint_starts_fresh_or_exits(corpus, tmp_path):
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    out = run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 2, extra=["--load", empty]))[0]
    assert [i for i, _ in out["losses"]] == [1, 2]
    with pytest.raises(AssertionError, match=r"no latest_checkpointed_iteration.txt; exiting "
                       r"\(--exit-on-missing-checkpoint\)"):
        run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 2, extra=[
            "--load", empty, "--exit-on-missing-checkpoint"]))


def test_unwritable_save_fails_at_start(corpus, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(AssertionError, match=r"--save .*a_file/ckpt is not writable"):
        run_on_ranks(run_pretrain, 1, gpt_flags(corpus, 2, extra=[
            "--save", str(blocker / "ckpt")]))


def _train_with_failing_save(flags, fail_rank):
    """Train; the save of iteration 4 fails on ``fail_rank`` (disk full, say)."""
    import torch.distributed as dist

    from megatron.training import checkpointing

    real_save = torch.save

    def flaky_save(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("iteration") == 4 and dist.get_rank() == fail_rank:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    torch.save = flaky_save
    try:
        return run_pretrain(flags)
    except checkpointing.CheckpointError as err:
        return str(err)
    finally:
        torch.save = real_save


def test_failed_save_keeps_previous_checkpoint(corpus, tmp_path):
    save = str(tmp_path / "ckpt")
    results = run_on_ranks(_train_with_failing_save, 2, gpt_flags(
        corpus, 6, tp=2, extra=["--save", save, "--save-interval", "2",
                                "--ckpt-format", "torch"]), 1)   # torch.save fails
    assert "saving iteration 4" in results[0] and "No space left on device" in results[1]
    assert sorted(os.listdir(save)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "2"
    # and the surviving checkpoint still loads and resumes
    out = run_on_ranks(run_pretrain, 2, gpt_flags(corpus, 6, tp=2, extra=["--load", save]))[0]
    assert [i for i, _ in out["losses"]] == [3, 4, 5, 6]
