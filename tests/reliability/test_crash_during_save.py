"""A training process killed (SIGKILL) anywhere inside a checkpoint save loses nothing.

Each scenario kills a real training process (forked rank processes, see launch.py) at a named
point of its second save (iteration 4 of 6, --save-interval 2) through the
``MEGATRON_TEST_CRASH_AT`` hook, and checks which checkpoint the tracker names. A second start
with ``--load`` then removes the leftovers, says so, and finishes with the losses, bit for bit,
and the final checkpoint (model, optimizer, scheduler, RNG states) of a run that was never
interrupted. Dropout is on, so a wrong RNG state would show. The same holds with --async-save,
whose writer thread is killed mid-file while training goes on.

Three representative points run by default; ``--runslow`` sweeps every point, both save modes,
one rank and two (tensor-parallel) ranks, the victim being either rank.
"""

import os
import signal

import pytest
import torch

from megatron.training import checkpointing
from megatron.checkpoint.layout import iteration_dir
from megatron.training.checkpointing import (CRASH_ENV, LOCK_FILENAME, TRACKER_FILENAME,
                                             read_tracker)
from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.reliability import launch

ITERS, INTERVAL = 6, 2
FINAL = ["iter_0000002", "iter_0000004", "iter_0000006", TRACKER_FILENAME]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, save, world_size, async_save=False):
    # The torch format's files, unless a test appends another --ckpt-format.
    extra = ["--save", save, "--save-interval", str(INTERVAL), "--ckpt-format", "torch"]
    return gpt_flags(corpus, ITERS, tp=world_size,
                     extra=extra + (["--async-save"] if async_save else []))


def _reference(corpus, root, world_size):
    """The uninterrupted run (synchronous saves): its losses and its save folder."""
    save = str(root / "save")
    group = launch.start(launch.train_runs, world_size,
                         [{"name": "ref", "argv": _flags(corpus, save, world_size)}],
                         log_dir=str(root / "logs"))
    assert group.wait() == [0] * world_size
    return {"losses": group.results(world_size - 1)["ref"]["losses"], "save": save}


@pytest.fixture(scope="module")
def reference_1(corpus, tmp_path_factory):
    return _reference(corpus, tmp_path_factory.mktemp("reference_1"), 1)


@pytest.fixture(scope="module")
def reference_2(corpus, tmp_path_factory):
    return _reference(corpus, tmp_path_factory.mktemp("reference_2"), 2)


def _assert_equal(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _assert_same_checkpoint(root, reference_root, iteration, world_size):
    """Every rank's file of ``iteration`` holds the same training state, bit for bit."""
    for tp_rank in range(world_size):
        path = checkpointing.checkpoint_file(root, iteration, tp_rank, 0, 1)
        got = torch.load(path, weights_only=False)
        want = torch.load(checkpointing.checkpoint_file(reference_root, iteration, tp_rank, 0, 1),
                          weights_only=False)
        for key in ("iteration", "checkpoint_version", "model", "optimizer",
                    "opt_param_scheduler", "rng_state"):
            _assert_equal(got[key], want[key], f"{path}:{key}")
        assert got["args"].consumed_train_samples == want["args"].consumed_train_samples


def crash_and_resume(tmp_path, corpus, reference, world_size, point, async_save=False):
    """Kill at ``point`` (``POINT:COUNT[@RANK]``), check the tracker, resume, compare.

    Returns the save folder's listing right after the kill, less the killed run's lock.
    """
    save = str(tmp_path / "ckpt")
    argv = _flags(corpus, save, world_size, async_save)
    victim = int(point.split("@")[1]) if "@" in point else 0
    name = point.split(":")[0]
    crash = launch.start(launch.train_runs, world_size,
                         [{"name": "crash", "argv": argv, "env": {CRASH_ENV: point}}],
                         log_dir=str(tmp_path / "crash"))
    codes = crash.wait()
    assert codes[victim] == -signal.SIGKILL, (codes, crash.log(victim)[-3000:])
    assert f"killing rank {victim} at {name}:2" in crash.log(victim)
    assert crash.results(victim) == {}  # it never got to the end of its run
    resumes_from = 4 if name == "after_tracker" else 2
    assert read_tracker(save) == (resumes_from, False)
    left = sorted(os.listdir(save))
    # Rank 0's lock on --save: left when rank 0 was killed, removed when it left by an error
    # (a peer gone) first; a lock left behind is taken over by the resumed run.
    lock_left = LOCK_FILENAME in left
    if lock_left:
        left.remove(LOCK_FILENAME)

    resume = launch.start(launch.train_runs, world_size,
                          [{"name": "resume", "argv": argv + ["--load", save]}],
                          log_dir=str(tmp_path / "resume"))
    assert resume.wait() == [0] * world_size, resume.log(0)[-3000:]
    log = resume.log(0)
    assert f"successfully loaded checkpoint from {save} at iteration {resumes_from}" in log
    assert (f"NOTE: --save {save}: took over {LOCK_FILENAME}, left by a run that is gone"
            in log) == lock_left
    for leftover in (n for n in left if n.startswith(".") or n.endswith(".tmp")):
        assert f"NOTE: --save {save}: removed {leftover}, left by an interrupted save" in log
    assert resume.results(world_size - 1)["resume"]["losses"] == \
        reference["losses"][resumes_from:]
    assert sorted(os.listdir(save)) == FINAL
    assert read_tracker(save) == (ITERS, False)
    _assert_same_checkpoint(save, reference["save"], ITERS, world_size)
    return left


# -- default suite: three representative points ---------------------------------------------

def test_kill_mid_file_single_rank(tmp_path, corpus, reference_1):
    """Killed with half of its file written: the staging folder holds a truncated file, the
    tracker still names iteration 2, and the resumed run matches the uninterrupted one."""
    left = crash_and_resume(tmp_path, corpus, reference_1, 1, "during_file:2")
    assert left == [".tmp_iter_0000004", "iter_0000002", TRACKER_FILENAME]
    assert FINAL[0] in left


def test_kill_before_tracker_two_ranks(tmp_path, corpus, reference_2):
    """Rank 0 of two dies after moving iteration 4 into place and writing the new tracker to its
    temporary name, before the rename: the tracker names 2, rank 1 is stopped (by the launcher,
    as torchrun would), and the resumed pair saves iteration 4 again over the orphan."""
    left = crash_and_resume(tmp_path, corpus, reference_2, 2, "before_tracker:2@0")
    assert left == ["iter_0000002", "iter_0000004", TRACKER_FILENAME, TRACKER_FILENAME + ".tmp"]


def test_async_save_killed_in_writer_thread(tmp_path, corpus, reference_1):
    """--async-save: the background writer of iteration 4 dies mid-file while the main thread
    trains on. Nothing was published, so the tracker names 2; the resumed run (also
    --async-save) matches the uninterrupted run with synchronous saves."""
    left = crash_and_resume(tmp_path, corpus, reference_1, 1, "during_file:2", async_save=True)
    assert left == [".tmp_iter_0000004", "iter_0000002", TRACKER_FILENAME]


def _fail_rank1_save_of_4(rank):
    """Patch for train_runs: on rank 1, writing the file of iteration 4 fails (disk full)."""
    real = torch.save

    def flaky(obj, f, *a, **k):
        if rank == 1 and isinstance(obj, dict) and obj.get("iteration") == 4:
            raise OSError(28, "No space left on device")
        return real(obj, f, *a, **k)

    torch.save = flaky
    return (lambda: setattr(torch, "save", real)), {}


def test_async_writer_error_reaches_every_rank(tmp_path, corpus):
    """A background writer's error is raised on the main thread of every rank (not only the
    rank that failed), naming the rank and the file; iteration 2 stays the tracked checkpoint
    and the unfinished staging folder is removed."""
    save = str(tmp_path / "ckpt")
    group = launch.start(launch.train_runs, 2, [{
        "name": "failing", "argv": _flags(corpus, save, 2, async_save=True),
        "patch": _fail_rank1_save_of_4, "catch": True}], log_dir=str(tmp_path / "logs"))
    assert group.wait() == [0, 0]
    path = os.path.join(save, ".tmp_iter_0000004", "iter_0000004", "mp_rank_01",
                        "model_optim_rng.pt")
    for rank in range(2):
        error = group.results(rank)["failing"]["error"]
        assert error == (f"CheckpointError: saving iteration 4 to {save} failed: rank 1: {path}: "
                         "No space left on device")
    assert sorted(os.listdir(save)) == ["iter_0000002", TRACKER_FILENAME]
    assert read_tracker(save) == (2, False)


# -- the start-up clean-up and the hook, without training ---------------------------------------

def _touch(path, text="x"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_clean_interrupted_saves_restores_a_replaced_folder(tmp_path):
    """A save of an iteration that already existed, killed between its two renames, leaves the
    tracker naming a folder that is only there as ``.old``: --load reads the ``.old`` copy, and
    the next start puts it back; staging folders, the tracker's temporary file and a ``.old``
    whose replacement is in place are removed."""
    save = str(tmp_path)
    _touch(os.path.join(save, TRACKER_FILENAME), "6")
    _touch(os.path.join(save, "iter_0000006.old", "mp_rank_00", "model_optim_rng.pt"), "six")
    _touch(os.path.join(save, "iter_0000004", "mp_rank_00", "model_optim_rng.pt"), "new four")
    _touch(os.path.join(save, "iter_0000004.old", "mp_rank_00", "model_optim_rng.pt"), "old")
    _touch(os.path.join(save, ".tmp_iter_0000008", "iter_0000008", "mp_rank_00",
                        "model_optim_rng.pt"))
    _touch(os.path.join(save, TRACKER_FILENAME + ".tmp"), "8")
    _touch(os.path.join(save, ".tmp_convert_abc", "kept"))  # the converter's, not ours

    assert iteration_dir(save, 6, False) == os.path.join(save, "iter_0000006.old")
    changes = checkpointing.clean_interrupted_saves(save)
    assert changes == [
        "removed .tmp_iter_0000008, left by an interrupted save",
        "removed iter_0000004.old, already replaced by iter_0000004",
        "restored iter_0000006 from iter_0000006.old (the save replacing it was interrupted)",
        f"removed {TRACKER_FILENAME}.tmp, left by an interrupted save",
    ]
    assert sorted(os.listdir(save)) == [".tmp_convert_abc", "iter_0000004", "iter_0000006",
                                        TRACKER_FILENAME]
    with open(os.path.join(save, "iter_0000006", "mp_rank_00", "model_optim_rng.pt")) as f:
        assert f.read() == "six"
    assert checkpointing.clean_interrupted_saves(save) == []


def test_crash_hook_is_inert_unless_named_and_rejects_bad_specs(monkeypatch):
    monkeypatch.delenv(CRASH_ENV, raising=False)
    for point in checkpointing.CRASH_POINTS:
        checkpointing.crash_point(point)  # unset: nothing happens
    monkeypatch.setenv(CRASH_ENV, "after_file:3@5")  # another rank, another point
    checkpointing.crash_point("after_file")
    checkpointing.crash_point("before_rename")
    monkeypatch.setenv(CRASH_ENV, "after_flie:2")
    with pytest.raises(checkpointing.CheckpointError,
                       match=r"MEGATRON_TEST_CRASH_AT='after_flie:2': expected "
                             r"POINT\[:COUNT\]\[@RANK\] with POINT one of before_files, "
                             r"during_file, after_file, before_rename, replacing_old"):
        checkpointing.crash_point("after_file")


# -- the full sweep ---------------------------------------------------------------------------

SWEEP_POINTS = [p for p in checkpointing.CRASH_POINTS if p != "replacing_old"]
FILE_POINTS = ("before_files", "during_file", "after_file")


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("point", SWEEP_POINTS)
def test_sweep_single_rank(tmp_path, corpus, reference_1, point, async_save):
    crash_and_resume(tmp_path, corpus, reference_1, 1, f"{point}:2", async_save)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("point", SWEEP_POINTS)
def test_sweep_two_ranks(tmp_path, corpus, reference_2, point, async_save):
    """Rank 1 dies at the file points (its own file); rank 0, which alone renames, at the rest."""
    victim = 1 if point in FILE_POINTS else 0
    crash_and_resume(tmp_path, corpus, reference_2, 2, f"{point}:2@{victim}", async_save)


@pytest.mark.slow
def test_kill_while_replacing_the_tracked_iteration(tmp_path, corpus, reference_1):
    """A run resumed with --ckpt-step 4 into the same folder saves iteration 6 again while the
    tracker names 6; killed between moving the old iteration 6 aside and moving the new one in,
    it leaves ``iter_0000006.old`` and the staged new copy. The next start restores the old one
    (the tracked checkpoint, complete) and has nothing left to train."""
    save = str(tmp_path / "ckpt")
    argv = _flags(corpus, save, 1)
    first = launch.start(launch.train_runs, 1, [{"name": "full", "argv": argv}],
                         log_dir=str(tmp_path / "full"))
    assert first.wait() == [0]
    again = launch.start(launch.train_runs, 1, [{
        "name": "again", "argv": argv + ["--load", save, "--ckpt-step", "4"],
        "env": {CRASH_ENV: "replacing_old:1"}}], log_dir=str(tmp_path / "again"))
    assert again.wait() == [-signal.SIGKILL]
    assert sorted(os.listdir(save)) == [LOCK_FILENAME, ".tmp_iter_0000006", "iter_0000002",
                                        "iter_0000004", "iter_0000006.old", TRACKER_FILENAME]
    assert read_tracker(save) == (6, False)
    last = launch.start(launch.train_runs, 1, [{"name": "last", "argv": argv + ["--load", save]}],
                        log_dir=str(tmp_path / "last"))
    assert last.wait() == [0]
    assert "restored iter_0000006 from iter_0000006.old" in last.log(0)
    assert "removed .tmp_iter_0000006, left by an interrupted save" in last.log(0)
    assert last.results(0)["last"]["losses"] == []
    assert sorted(os.listdir(save)) == FINAL
    _assert_same_checkpoint(save, reference_1["save"], ITERS, 1)


# -- --ckpt-format torch_dist -----------------------------------------------------------------

DIST_POINTS = ("before_files", "after_file", "before_rename", "before_tracker", "after_tracker")


def _dist_tensors(iter_dir):
    from megatron.checkpoint.dist import DistCheckpointReader

    reader = DistCheckpointReader(iter_dir)
    return reader, {key: reader.read(key) for key in reader.tensor_keys()}


@pytest.fixture(scope="module")
def reference_dist(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_dist")
    save = str(root / "save")
    argv = _flags(corpus, save, 2) + ["--ckpt-format", "torch_dist"]
    group = launch.start(launch.train_runs, 2, [{"name": "ref", "argv": argv}],
                         log_dir=str(root / "logs"))
    assert group.wait() == [0, 0]
    return {"losses": group.results(1)["ref"]["losses"], "save": save}


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("point", DIST_POINTS)
def test_torch_dist_save_killed_anywhere_loses_nothing(tmp_path, corpus, reference_dist, point,
                                                       async_save):
    """A torch_dist save (two ranks, each writing its own shards) killed at any point leaves
    the tracker on a complete checkpoint; the resumed run finishes with the uninterrupted
    run's losses and the same final tensors, bit for bit."""
    save = str(tmp_path / "ckpt")
    argv = _flags(corpus, save, 2, async_save) + ["--ckpt-format", "torch_dist"]
    crash = launch.start(launch.train_runs, 2, [{"name": "crash", "argv": argv,
                                                 "env": {CRASH_ENV: f"{point}:2@0"}}],
                         log_dir=str(tmp_path / "crash"))
    codes = crash.wait()
    assert codes[0] == -signal.SIGKILL, (codes, crash.log(0)[-3000:])
    resumes_from = 4 if point == "after_tracker" else 2
    assert read_tracker(save) == (resumes_from, False)
    resume = launch.start(launch.train_runs, 2, [{"name": "resume", "argv": argv + ["--load",
                                                                                    save]}],
                          log_dir=str(tmp_path / "resume"))
    assert resume.wait() == [0, 0], resume.log(0)[-3000:]
    assert resume.results(1)["resume"]["losses"] == reference_dist["losses"][resumes_from:]
    assert sorted(os.listdir(save)) == FINAL
    got_reader, got = _dist_tensors(os.path.join(save, "iter_0000006"))
    want_reader, want = _dist_tensors(os.path.join(reference_dist["save"], "iter_0000006"))
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert got_reader.common_state()["iteration"] == 6


# -- the distributed optimizer's distrib_optim.pt ----------------------------------------------

def _distrib_optim_flags(corpus, save, async_save=False):
    """DP 2 with the distributed optimizer: DP rank 0 writes distrib_optim.pt, then its
    model_optim_rng.pt, so its third file is the distrib_optim.pt of iteration 4."""
    return gpt_flags(corpus, ITERS, extra=["--save", save, "--save-interval", str(INTERVAL),
                                           "--use-distributed-optimizer",
                                           "--ckpt-format", "torch"]
                     + (["--async-save"] if async_save else []))


@pytest.fixture(scope="module")
def reference_distrib_optim(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_distrib_optim")
    save = str(root / "save")
    group = launch.start(launch.train_runs, 2, [{"name": "ref", "argv": _distrib_optim_flags(
        corpus, save)}], log_dir=str(root / "logs"))
    assert group.wait() == [0, 0]
    return {"losses": group.results(1)["ref"]["losses"], "save": save}


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_kill_mid_distrib_optim_file(tmp_path, corpus, reference_distrib_optim, async_save):
    """Killed with half of iteration 4's distrib_optim.pt written: nothing is published, the
    tracker names 2, and the resumed run ends with the uninterrupted run's losses and files
    (both of them), bit for bit."""
    save = str(tmp_path / "ckpt")
    argv = _distrib_optim_flags(corpus, save, async_save)
    crash = launch.start(launch.train_runs, 2, [{"name": "crash", "argv": argv,
                                                 "env": {CRASH_ENV: "during_file:3@0"}}],
                         log_dir=str(tmp_path / "crash"))
    codes = crash.wait()
    assert codes[0] == -signal.SIGKILL, (codes, crash.log(0)[-3000:])
    assert read_tracker(save) == (2, False)
    staged = os.path.join(save, ".tmp_iter_0000004", "iter_0000004", "mp_rank_00")
    assert os.listdir(staged) == ["distrib_optim.pt"]
    assert os.path.getsize(os.path.join(staged, "distrib_optim.pt")) < os.path.getsize(
        os.path.join(save, "iter_0000002", "mp_rank_00", "distrib_optim.pt"))
    resume = launch.start(launch.train_runs, 2, [{"name": "resume",
                                                  "argv": argv + ["--load", save]}],
                          log_dir=str(tmp_path / "resume"))
    assert resume.wait() == [0, 0], resume.log(0)[-3000:]
    assert resume.results(1)["resume"]["losses"] == reference_distrib_optim["losses"][2:]
    assert sorted(n for n in os.listdir(save) if n != LOCK_FILENAME) == FINAL
    _assert_same_checkpoint(save, reference_distrib_optim["save"], ITERS, 1)
    final = os.path.join(iteration_dir(save, ITERS, False), "mp_rank_00", "distrib_optim.pt")
    want = os.path.join(iteration_dir(reference_distrib_optim["save"], ITERS, False),
                        "mp_rank_00", "distrib_optim.pt")
    _assert_equal(torch.load(final, weights_only=False), torch.load(want, weights_only=False),
                  final)
