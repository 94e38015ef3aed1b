"""``--save`` / ``--load msc://PROFILE/PATH`` with ``--enable-msc``: checkpoints through the
Multi-Storage Client, over a POSIX ``file`` profile on a temporary folder.

References: the files a run with a local ``--save`` writes (names and bytes), and the losses of
the run that never stopped (one process, fp32, dropout 0): a resume from the URL continues them
bit for bit. The saved ``args`` (``common.pt``) hold the run's ``--save``, so that one file is
compared by its contents with the paths set aside.
"""

import argparse
import os
import shutil
import sys

import pytest
import torch

from megatron.checkpoint.layout import TRACKER_FILENAME
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

pytest.importorskip("multistorageclient")

ITERS, SAVED_AT = 4, 2
ARGS_FILE = "common.pt"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("data") / "counting"))


@pytest.fixture
def storage(tmp_path, monkeypatch):
    """A profile ``p`` over ``tmp_path/bucket``; returns (bucket folder, cache folder). The
    client keeps each profile's storage for the life of a process: this process forgets the
    previous tests' (the ranks are processes of their own)."""
    import multistorageclient.shortcuts as shortcuts

    monkeypatch.setattr(shortcuts, "_STORAGE_CLIENT_CACHE", {})
    bucket, cache = tmp_path / "bucket", tmp_path / "cache"
    bucket.mkdir()
    config = tmp_path / "msc.yaml"
    config.write_text("profiles:\n  p:\n    storage_provider:\n      type: file\n"
                      f"      options:\n        base_path: {bucket}\n")
    monkeypatch.setenv("MSC_CONFIG", str(config))
    return str(bucket), str(cache)


def _flags(corpus, iters=ITERS, extra=()):
    return gpt_flags(corpus, iters, dropout=0.0, micro_batch=1, extra=list(extra))


def _msc(cache, extra=()):
    return ["--enable-msc", "--object-storage-cache-path", cache, "--ckpt-format",
            "torch_dist", *extra]


def _files(folder):
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def torch_load_file(path):
    from megatron.checkpoint.safe_unpickle import torch_load

    with open(path, "rb") as f:
        return torch_load(f.read(), path)


def _iterations(folder):
    return sorted({n.split(os.sep)[0] for n in _files(folder) if n.startswith("iter_")})


def _run(argv, ranks=1):
    return run_on_ranks(run_pretrain, ranks, argv)


def _same(a, b) -> bool:
    """Equal values, tensors compared exactly (bit for bit, dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, argparse.Namespace):
        return isinstance(b, argparse.Namespace) and _same(vars(a), vars(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _without_paths(state: dict, save: str) -> dict:
    """A common state with its recorded ``--save`` checked and the flags that differ between
    the two runs set aside."""
    state = dict(state)
    args = vars(state["args"]).copy()
    assert args.pop("save") == save
    for key in ("enable_msc", "object_storage_cache_path"):
        args.pop(key)
    state["args"] = args
    return state


def _same_checkpoint(have: str, want: str, have_save: str, want_save: str) -> None:
    """Two torch_dist folders hold the same tensors and objects, the recorded --save aside."""
    from megatron.checkpoint.dist import DistCheckpointReader
    from megatron.checkpoint.dist.reader import COMMON_STATE_FQN

    a, b = DistCheckpointReader(have), DistCheckpointReader(want)
    assert a.tensor_keys() == b.tensor_keys() and a.byte_keys() == b.byte_keys()
    for key in a.tensor_keys():
        assert _same(a.read(key), b.read(key)), key
    for key in a.byte_keys():
        if key != COMMON_STATE_FQN:
            assert _same(a.read_object(key), b.read_object(key)), key
    assert _same(_without_paths(a.common_state(), have_save),
                 _without_paths(b.common_state(), want_save))


def test_an_msc_save_writes_the_files_of_a_local_save(corpus, storage, tmp_path):
    """Same names; the same bytes as the published mirror (the upload adds and loses
    nothing); the same bytes as a local save except where the run's --save is recorded (the
    saved args, and so the data file and index that hold them), whose contents are compared."""
    bucket, cache = storage
    local, url = str(tmp_path / "local"), "msc://p/runs/ckpt"
    save = ["--save-interval", str(SAVED_AT), "--enable-msc", "--object-storage-cache-path",
            cache]
    _run(_flags(corpus, extra=["--save", local, *save]))
    _run(_flags(corpus, extra=["--save", url, *save]))
    remote = os.path.join(bucket, "runs", "ckpt")
    want, have = _files(local), _files(remote)
    assert sorted(have) == sorted(want)
    assert have[TRACKER_FILENAME] == want[TRACKER_FILENAME] == str(ITERS).encode()
    mirror = _files(os.path.join(cache, "checkpoints", "p", "runs", "ckpt"))
    recording = {ARGS_FILE, "__0_0.distcp", ".metadata"}
    for name in want:
        assert have[name] == mirror[name], name
        if os.path.basename(name) not in recording:
            assert have[name] == want[name], name
    for it in (SAVED_AT, ITERS):
        name = f"iter_{it:07d}"
        _same_checkpoint(os.path.join(remote, name), os.path.join(local, name), url, local)
        assert _same(_without_paths(torch_load_file(os.path.join(remote, name, ARGS_FILE)), url),
                     _without_paths(torch_load_file(os.path.join(local, name, ARGS_FILE)),
                                    local))


@pytest.mark.parametrize("ranks, extra", [(1, []), (2, ["--async-save"])])
def test_a_resume_from_an_msc_url_continues_the_losses_bit_for_bit(corpus, storage, ranks,
                                                                   extra):
    """Stopped by --exit-interval (its exit save is uploaded), resumed from the URL with an
    empty mirror; --save-retain-interval's pruning reaches the remote copy too."""
    bucket, cache = storage
    url = "msc://p/ckpt"
    full = _run(_flags(corpus), ranks)[0]
    _run(_flags(corpus, extra=["--save", url, "--exit-interval", str(SAVED_AT), *extra,
                               *_msc(cache)]), ranks)
    shutil.rmtree(cache)   # the resume must read what the URL holds
    resumed = _run(_flags(corpus, extra=["--load", url, "--save", url, "--save-interval", "1",
                                         "--save-retain-interval", str(ITERS), *extra,
                                         *_msc(cache)]), ranks)
    losses = dict(resumed[0]["losses"])
    assert min(losses) == SAVED_AT + 1
    for it in range(SAVED_AT + 1, ITERS + 1):
        assert losses[it] == dict(full["losses"])[it], it
    remote = os.path.join(bucket, "ckpt")
    with open(os.path.join(remote, TRACKER_FILENAME)) as f:
        assert f.read() == str(ITERS)
    mirror = os.path.join(cache, "checkpoints", "p", "ckpt")
    # Iterations with files (object storage has no folders; a POSIX profile keeps empty ones).
    iterations = _iterations(remote)
    assert iterations == _iterations(mirror)
    assert f"iter_{SAVED_AT:07d}" not in iterations and f"iter_{ITERS:07d}" in iterations


def test_an_msc_load_without_a_remote_tracker_starts_from_scratch(corpus, storage):
    bucket, cache = storage
    stale = os.path.join(cache, "checkpoints", "p", "empty")
    os.makedirs(stale)
    with open(os.path.join(stale, TRACKER_FILENAME), "w") as f:
        f.write("7")   # a mirror the URL does not hold must not be resumed
    out = _run(_flags(corpus, iters=2, extra=["--load", "msc://p/empty", *_msc(cache)]))[0]
    assert out["iteration"] == 2 and not os.path.exists(os.path.join(stale, TRACKER_FILENAME))


def test_ckpt_step_fetches_the_iteration_it_names_and_replaces_a_stale_copy(storage):
    from megatron.checkpoint import object_storage

    bucket, cache = storage
    for it in (2, 4):
        os.makedirs(os.path.join(bucket, "ck", f"iter_{it:07d}", "sub"))
        with open(os.path.join(bucket, "ck", f"iter_{it:07d}", "sub", "x"), "w") as f:
            f.write(str(it))
    with open(os.path.join(bucket, "ck", TRACKER_FILENAME), "w") as f:
        f.write("4")
    mirror = object_storage.mirror_dir(cache, "msc://p/ck")
    os.makedirs(os.path.join(mirror, "iter_0000002"))
    with open(os.path.join(mirror, "iter_0000002", "stale"), "w") as f:
        f.write("old")
    object_storage._fetch("msc://p/ck", mirror, 2)
    assert _files(mirror) == {TRACKER_FILENAME: b"4", os.path.join("iter_0000002", "sub", "x"):
                              b"2"}


def _validate(argv):
    args = parse_args(None, argv=argv)
    args.world_size = 1
    return validate_args(args)


def _base(tmp_path):
    return _flags(str(tmp_path / "data"), extra=["--mock-data"])


@pytest.mark.parametrize("extra, expected", [
    (["--save", "msc://p/ckpt"], "--save msc://p/ckpt: msc:// URLs need --enable-msc"),
    (["--load", "msc://p/ckpt", "--enable-msc", "--ckpt-format", "torch"],
     "Megatron supports only --ckpt-format torch_dist"),
    (["--save", "msc://p/ckpt", "--enable-msc"], "need --object-storage-cache-path"),
    (["--save", "msc://p", "--enable-msc", "--object-storage-cache-path", "c"],
     "expected msc://PROFILE/PATH"),
    (["--pretrained-checkpoint", "msc://p/ckpt", "--enable-msc"],
     "--pretrained-checkpoint msc://p/ckpt: msc:// URLs are supported for --save and --load"),
])
def test_msc_checkpoint_flags_are_refused_in_one_line(tmp_path, extra, expected):
    with pytest.raises(ArgumentsError) as err:
        _validate(_base(tmp_path) + extra)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_missing_client_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "multistorageclient", None)
    with pytest.raises(ArgumentsError) as err:
        _validate(_base(tmp_path) + ["--save", "msc://p/ckpt", "--enable-msc",
                                     "--object-storage-cache-path", str(tmp_path)])
    assert "pip install multi-storage-client" in str(err.value)


def test_an_msc_url_is_kept_and_points_at_its_mirror(tmp_path):
    args = _validate(_base(tmp_path) + ["--save", "msc://p/a/b", "--load", "msc://q/c",
                                        "--enable-msc", "--object-storage-cache-path",
                                        str(tmp_path)])
    assert args.save_msc_url == "msc://p/a/b" and args.load_msc_url == "msc://q/c"
    assert args.save == str(tmp_path / "checkpoints" / "p" / "a" / "b")
    assert args.load == str(tmp_path / "checkpoints" / "q" / "c")
    from megatron.training.configs import build_checkpoint_config

    assert build_checkpoint_config(args).save == args.save


def test_use_checkpoint_args_with_an_msc_load_is_refused(tmp_path):
    from megatron.checkpoint.layout import CheckpointError
    from megatron.training.checkpointing import load_args_from_checkpoint

    args = parse_args(None, argv=_base(tmp_path) + ["--load", "msc://p/ckpt",
                                                    "--use-checkpoint-args"])
    with pytest.raises(CheckpointError, match="--use-checkpoint-args with --load msc://p/ckpt"):
        load_args_from_checkpoint(args)


def test_null_tokenizer_ids_come_from_an_msc_checkpoint(corpus, storage):
    """The end-of-document id an msc:// checkpoint was written with is read before its mirror
    is filled (the model's vocabulary depends on it)."""
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args

    bucket, cache = storage
    url = "msc://p/null"
    _run(_flags(corpus, iters=2, extra=["--save", url, "--null-tokenizer-eod-id", "129",
                                        *_msc(cache)]))
    shutil.rmtree(cache)
    args = parse_args(argv=_flags(corpus, extra=["--load", url, *_msc(cache)]))
    assert args.null_tokenizer_eod_id is None
    assert checkpointing.null_tokenizer_eod_from_checkpoint(args).null_tokenizer_eod_id == 129
    fresh = parse_args(argv=_flags(corpus, extra=["--load", "msc://p/none", *_msc(cache)]))
    assert checkpointing.null_tokenizer_eod_from_checkpoint(fresh).null_tokenizer_eod_id is None


def _inference_logits(argv):
    """The tools' start-up (generation server, evaluation) on ``argv``: logits of one batch."""
    import pretrain_gpt
    from megatron import inference
    from megatron.training import global_vars

    try:
        args, pstate, _ = inference.initialize_for_inference(argv=argv)
        chunks, iteration = inference.load_model_for_inference(pretrain_gpt.model_provider,
                                                               args, pstate)
        tokens = torch.arange(16).remainder(120).unsqueeze(0)
        positions = torch.arange(16).unsqueeze(0)
        with torch.no_grad():
            logits = chunks[0](tokens, positions, None)
        return {"iteration": iteration, "logits": logits}
    finally:
        global_vars.unset_global_variables()


def test_the_inference_tools_load_an_msc_checkpoint(corpus, storage, tmp_path):
    """The generation server's and evaluation's loader fetches an msc:// --load into its mirror
    and gives the logits of the same checkpoint read from a local folder."""
    bucket, cache = storage
    _run(_flags(corpus, iters=2, extra=["--save", "msc://p/gen", *_msc(cache)]))
    local = tmp_path / "local_copy"
    shutil.copytree(os.path.join(bucket, "gen"), local)
    shutil.rmtree(cache)
    remote = run_on_ranks(_inference_logits, 1, _flags(corpus, extra=[
        "--load", "msc://p/gen", *_msc(cache)]))[0]
    plain = run_on_ranks(_inference_logits, 1, _flags(corpus, extra=[
        "--load", str(local), "--ckpt-format", "torch_dist"]))[0]
    assert remote["iteration"] == plain["iteration"] == 2
    assert torch.equal(remote["logits"], plain["logits"])
