"""--verify-integrity: every save writes integrity.json (SHA-256 of each file, Megatron-Core's
manifest), and a load re-hashes the files and stops with one line naming each altered file."""

import hashlib
import json
import os
import shutil

import pytest

from tests.functional.gpt_runs import gpt_flags, run_pretrain, write_counting_corpus
from tests.multiprocess import run_on_ranks

pytestmark = pytest.mark.slow  # spawned training runs, about half a minute in all


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, iters, extra):
    """The tiny run, resuming with the saved schedule (a longer run keeps it)."""
    return gpt_flags(corpus, iters, extra=["--use-checkpoint-opt_param-scheduler"] + extra)


def _saved(corpus, root, fmt):
    save = str(root / f"save_{fmt}")
    run_on_ranks(run_pretrain, 1, _flags(corpus, 2, [
        "--save", save, "--ckpt-format", fmt, "--verify-integrity"]))
    return save


@pytest.fixture(scope="module", params=["torch", "torch_dist"])
def saved(request, corpus, tmp_path_factory):
    return _saved(corpus, tmp_path_factory.mktemp("ckpt"), request.param)


def _every_file(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if rel != "integrity.json":
                out[rel] = hashlib.sha256(open(os.path.join(root, name), "rb").read()).hexdigest()
    return out


def test_manifest_lists_every_file_with_its_sha256(saved):
    """Reference: hashlib over the files on disk, walked independently."""
    folder = os.path.join(saved, "iter_0000002")
    manifest = json.load(open(os.path.join(folder, "integrity.json")))
    assert manifest["algorithm"] == "sha256"
    assert manifest["files"] == _every_file(folder)
    assert len(manifest["files"]) >= 1


def test_intact_checkpoint_loads(corpus, saved, tmp_path):
    out = run_on_ranks(run_pretrain, 1, _flags(corpus, 3, [
        "--load", saved, "--verify-integrity"]))[0]
    assert out["iteration"] == 3


def _biggest_file(folder):
    files = _every_file(folder)
    return max(files, key=lambda rel: os.path.getsize(os.path.join(folder, rel)))


def test_altered_file_is_named_in_one_line(corpus, saved, tmp_path):
    """One byte changed in the largest file: the load stops naming that file; without the
    flag nothing checks (the torch format's zip CRC may still object, so only the flagged
    message is asserted)."""
    copy = shutil.copytree(saved, str(tmp_path / "altered"))
    folder = os.path.join(copy, "iter_0000002")
    victim = _biggest_file(folder)
    path = os.path.join(folder, victim)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(AssertionError) as err:
        run_on_ranks(run_pretrain, 1, _flags(corpus, 3, [
            "--load", copy, "--verify-integrity"]))
    lines = [line for line in str(err.value).splitlines()
             if "integrity check failed" in line and "CheckpointError" in line]
    assert len(lines) == 1, str(err.value)[-3000:]
    assert f"{victim}: sha256 mismatch" in lines[0]
    assert "1 file(s)" in lines[0]


def test_missing_file_and_missing_manifest(corpus, saved, tmp_path):
    copy = shutil.copytree(saved, str(tmp_path / "missing"))
    folder = os.path.join(copy, "iter_0000002")
    victim = _biggest_file(folder)
    os.remove(os.path.join(folder, victim))
    with pytest.raises(AssertionError, match=rf"{victim}: missing or unreadable"):
        run_on_ranks(run_pretrain, 1, _flags(corpus, 3, [
            "--load", copy, "--verify-integrity"]))
    bare = shutil.copytree(saved, str(tmp_path / "bare"))
    os.remove(os.path.join(bare, "iter_0000002", "integrity.json"))
    with pytest.raises(AssertionError, match=r"integrity.json: missing; --verify-integrity "
                       r"needs a checkpoint saved with --verify-integrity"):
        run_on_ranks(run_pretrain, 1, _flags(corpus, 3, [
            "--load", bare, "--verify-integrity"]))


def test_no_manifest_without_the_flag(corpus, tmp_path):
    save = str(tmp_path / "plain")
    run_on_ranks(run_pretrain, 1, _flags(corpus, 2, ["--save", save]))
    assert not os.path.exists(os.path.join(save, "iter_0000002", "integrity.json"))
