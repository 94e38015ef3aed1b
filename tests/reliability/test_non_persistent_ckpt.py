"""Non-persistent checkpoints: a run killed between persistent saves resumes from the newest one.

Runs of 8 iterations save persistently at 4 and 8 (--save-interval 4) and non-persistently at
2 and 6 (--non-persistent-save-interval 2). A run killed with SIGKILL after iteration 7 resumes
with --load from the non-persistent checkpoint of iteration 6 and finishes with the losses, bit
for bit, of a run that was never interrupted and never saved non-persistently (dropout on, so a
wrong RNG state would show). Local checkpoints with --replication survive the loss of one
"node" (a rank's whole folder): its copy on the peer restores it. A non-persistent save killed
mid-file is never taken: the resumed run starts from the persistent checkpoint of iteration 4.
Only the newest non-persistent checkpoint is kept.
"""

import os
import shutil
import signal

import pytest

from megatron.checkpoint import non_persistent
from megatron.training.arguments import ArgumentsError, parse_args, validate_args
from megatron.training.checkpointing import CRASH_ENV, TRACKER_FILENAME, read_tracker
from tests.functional.gpt_runs import gpt_flags, write_counting_corpus
from tests.reliability import launch

ITERS = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, save, world_size, extra=()):
    return gpt_flags(corpus, ITERS, tp=world_size,
                     extra=["--save", save, "--save-interval", "4"] + list(extra))


def _np_global():
    return ["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"]


def _np_local(local, replication=True):
    flags = ["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local",
             "--non-persistent-local-ckpt-dir", local]
    return flags + (["--replication"] if replication else [])


# Every rank its own "node": --replication-jump defaults to LOCAL_WORLD_SIZE.
ONE_RANK_PER_NODE = {"LOCAL_WORLD_SIZE": "1"}


def _reference(corpus, root, world_size):
    """The uninterrupted run, persistent saves only: its losses."""
    group = launch.start(launch.train_runs, world_size,
                         [{"name": "ref", "argv": _flags(corpus, str(root / "save"),
                                                         world_size)}],
                         log_dir=str(root / "logs"))
    assert group.wait() == [0] * world_size, group.log(0)[-3000:]
    return group.results(world_size - 1)["ref"]["losses"]


@pytest.fixture(scope="module")
def reference_1(corpus, tmp_path_factory):
    return _reference(corpus, tmp_path_factory.mktemp("reference_1"), 1)


@pytest.fixture(scope="module")
def reference_2(corpus, tmp_path_factory):
    return _reference(corpus, tmp_path_factory.mktemp("reference_2"), 2)


def _kill_after_7(tmp_path, argv, world_size, env):
    """Run until every rank finished iteration 7 (the non-persistent save of 6 done, the
    persistent one of 8 not begun), then SIGKILL all of them."""
    group = launch.start(launch.train_runs, world_size,
                         [{"name": "crash", "argv": argv, "env": env,
                           "pause_after": (7, list(range(world_size)))}],
                         log_dir=str(tmp_path / "crash"), with_events=True)
    for _ in range(world_size):
        group.next_event()
    group.kill()
    assert group.wait() == [-signal.SIGKILL] * world_size


def _resume(tmp_path, argv, world_size, env, name="resume"):
    group = launch.start(launch.train_runs, world_size,
                         [{"name": name, "argv": argv, "env": env}],
                         log_dir=str(tmp_path / name))
    assert group.wait() == [0] * world_size, group.log(0)[-3000:]
    return group


# -- layout and flags, no training ----------------------------------------------------------------

def test_replication_cliques_match_the_worked_table():
    """Four ranks on two nodes of two: each rank's copy sits on the other node; eight ranks in
    nodes of two with factor 2: blocks of four."""
    assert [non_persistent.clique(r, 4, True, 2, 2) for r in range(4)] == \
        [[0, 2], [1, 3], [2, 0], [3, 1]]
    assert [non_persistent.clique(r, 8, True, 2, 2)[1] for r in range(8)] == \
        [2, 3, 0, 1, 6, 7, 4, 5]
    assert non_persistent.clique(5, 6, True, 1, 3) == [5, 3, 4]
    assert non_persistent.clique(3, 4, False, None, 2) == [3]
    assert non_persistent.replication_error(6, True, 2, 2) == (
        "--replication: the world size 6 must be a multiple of --replication-jump 2 x "
        "--replication-factor 2; with one node, pass --replication-jump (the processes per "
        "node) to place the copies")
    assert non_persistent.replication_error(4, True, 2, 1).startswith(
        "--replication needs --replication-factor >= 2")


def test_newest_complete_iteration_needs_every_rank_file_somewhere():
    """Iteration 6 lacks rank 2's file everywhere (its save was torn): 4 is taken, where rank
    1's own file is gone and rank 3 holds its copy; a rank's own file wins over a copy."""
    inventories = [{4: [0, 2], 6: [0]},         # rank 0 holds its own and rank 2's (of 4)
                   {6: [1, 3]},                 # rank 1 lost iteration 4
                   {4: [0, 2], 6: [0]},         # rank 2 died writing its own file of 6
                   {4: [3, 1], 6: [3, 1]}]
    assert non_persistent.newest_complete(inventories) == (4, {0: 0, 1: 3, 2: 2, 3: 3})
    inventories[2][6] = [0, 2]
    assert non_persistent.newest_complete(inventories) == (6, {0: 0, 1: 1, 2: 2, 3: 3})
    assert non_persistent.newest_complete([{}, {2: [1]}]) == (-1, {})


@pytest.mark.parametrize("extra, message", [
    (["--non-persistent-ckpt-type", "in_memory"],
     "--non-persistent-ckpt-type in_memory is not implemented in Megatron-LM either: its "
     "flag lists it as to be done (a local checkpoint that avoids serialization), its argument "
     "check accepts only global and local, and its save raises NotImplementedError"),
    (["--non-persistent-save-interval", "2"],
     "--non-persistent-save-interval needs --non-persistent-ckpt-type global or local"),
    (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"],
     "--non-persistent-ckpt-type global needs --save"),
    (["--non-persistent-ckpt-type", "local"],
     "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "x",
      "--use-distributed-optimizer"],
     "--non-persistent-ckpt-type local with --use-distributed-optimizer is not built"),
    (["--non-persistent-save-interval", "0"], "--non-persistent-save-interval must be >= 1"),
])
def test_bad_flag_combinations_are_refused_in_one_line(tmp_path, extra, message):
    argv = gpt_flags(str(tmp_path / "data"), 4, extra=extra)
    with pytest.raises(ArgumentsError) as err:
        validate_args(parse_args(argv=argv))
    assert str(err.value).startswith(message)


# -- killed between persistent saves -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_global_resumes_from_newest_non_persistent(tmp_path, corpus, reference_1, ckpt_format):
    """Killed after iteration 7: the persistent tracker names 4, SAVE/non_persistent holds only
    iteration 6 (2 was removed), and the resumed run takes 6 and matches the reference (whose
    checkpoints were in the torch format: resume is exact in either)."""
    save = str(tmp_path / "ckpt")
    argv = _flags(corpus, save, 1, _np_global() + ["--ckpt-format", ckpt_format])
    _kill_after_7(tmp_path, argv, 1, {})
    np_dir = os.path.join(save, "non_persistent")
    assert read_tracker(save) == (4, False)
    assert sorted(os.listdir(np_dir)) == ["iter_0000006", TRACKER_FILENAME]
    resume = _resume(tmp_path, argv + ["--load", save], 1, {})
    log = resume.log(0)
    assert (f"NOTE: resuming from the global non-persistent checkpoint in {np_dir} at "
            f"iteration 6 (persistent checkpoint in --load {save}: iteration 4)") in log
    assert f"successfully loaded checkpoint from {np_dir} at iteration 6" in log
    assert resume.results(0)["resume"]["losses"] == reference_1[6:]
    assert sorted(os.listdir(np_dir)) == ["iter_0000006", TRACKER_FILENAME]


@pytest.mark.slow
def test_local_with_a_lost_node_restores_from_the_replica(tmp_path, corpus, reference_2):
    """Two ranks, each its own node, local checkpoints with --replication: after the kill each
    rank's folder holds iteration 6 only, its own file and its peer's. Rank 1's folder is then
    removed (its node is lost); the resumed pair agrees on iteration 6, rank 1 receives its
    file from rank 0's copy, and the losses match the reference."""
    save, local = str(tmp_path / "ckpt"), str(tmp_path / "local")
    argv = _flags(corpus, save, 2, _np_local(local))
    _kill_after_7(tmp_path, argv, 2, ONE_RANK_PER_NODE)
    for rank in range(2):
        assert os.listdir(os.path.join(local, str(rank))) == ["iter_0000006"]
        assert sorted(os.listdir(os.path.join(local, str(rank), "iter_0000006"))) == \
            ["rank_00000.pt", "rank_00001.pt"]
    shutil.rmtree(os.path.join(local, "1"))
    resume = _resume(tmp_path, argv + ["--load", save], 2, ONE_RANK_PER_NODE)
    assert (f"NOTE: resuming from the local non-persistent checkpoint in {local} at "
            f"iteration 6 (persistent checkpoint in --load {save}: iteration 4)") in resume.log(0)
    assert ("NOTE: rank 1: no local checkpoint file of iteration 6; restored it from the copy "
            "held by rank 0") in resume.log(1)
    assert resume.results(1)["resume"]["losses"] == reference_2[6:]


@pytest.mark.slow
def test_torn_global_save_is_never_taken(tmp_path, corpus, reference_1):
    """Killed mid-file in the non-persistent save of 6 (third file written: 2, then the
    persistent 4, then 6): the non-persistent tracker still names 2, older than the persistent
    4, so the resumed run takes 4, says why, and matches the reference."""
    save = str(tmp_path / "ckpt")
    # --ckpt-format torch: the crash point counts the torch format's files
    argv = _flags(corpus, save, 1, _np_global() + ["--ckpt-format", "torch"])
    crash = launch.start(launch.train_runs, 1, [{"name": "crash", "argv": argv,
                                                 "env": {CRASH_ENV: "during_file:3"}}],
                         log_dir=str(tmp_path / "crash"))
    assert crash.wait() == [-signal.SIGKILL]
    np_dir = os.path.join(save, "non_persistent")
    assert sorted(os.listdir(np_dir)) == [".tmp_iter_0000006", "iter_0000002", TRACKER_FILENAME]
    resume = _resume(tmp_path, argv + ["--load", save], 1, {})
    log = resume.log(0)
    assert (f"NOTE: the global non-persistent checkpoint in {np_dir} (iteration 2) is older "
            f"than the persistent one in --load {save} (iteration 4); resuming from the "
            "persistent one") in log
    assert f"successfully loaded checkpoint from {save} at iteration 4" in log
    assert resume.results(0)["resume"]["losses"] == reference_1[4:]
    assert sorted(os.listdir(np_dir)) == ["iter_0000006", TRACKER_FILENAME]


@pytest.mark.slow
def test_torn_local_save_is_never_taken(tmp_path, corpus, reference_2):
    """Local checkpoints without replication; rank 1 dies mid-file in its save of 6 while rank
    0's file of 6 is complete: iteration 6 is incomplete, so both ranks take the persistent 4
    (a rank alone never takes its own newer file), and the losses match the reference."""
    save, local = str(tmp_path / "ckpt"), str(tmp_path / "local")
    # --ckpt-format torch: the crash point counts the torch format's files
    argv = _flags(corpus, save, 2, _np_local(local, replication=False)
                  + ["--ckpt-format", "torch"])
    crash = launch.start(launch.train_runs, 2, [{"name": "crash", "argv": argv,
                                                 "env": {CRASH_ENV: "during_file:3@1"}}],
                         log_dir=str(tmp_path / "crash"))
    codes = crash.wait()
    assert codes[1] == -signal.SIGKILL, crash.log(1)[-3000:]
    assert "killing rank 1 at during_file:3" in crash.log(1)
    assert os.listdir(os.path.join(local, "1", "iter_0000006")) == [".tmp_rank_00001.pt"]
    resume = _resume(tmp_path, argv + ["--load", save], 2, {})
    log = resume.log(0)
    assert (f"NOTE: the local non-persistent checkpoint in {local} (iteration 2) is older "
            f"than the persistent one in --load {save} (iteration 4)") in log
    assert f"successfully loaded checkpoint from {save} at iteration 4" in log
    assert resume.results(1)["resume"]["losses"] == reference_2[4:]
    for rank in range(2):
        assert os.listdir(os.path.join(local, str(rank))) == ["iter_0000006"]


@pytest.mark.slow
def test_local_two_nodes_of_two_lose_a_node(tmp_path, corpus):
    """Four ranks (TP 2 x DP 2) on two "nodes" of two (LOCAL_WORLD_SIZE 2, so the copies go
    --replication-jump 2 ranks away, onto the other node): the folders of node 1 (ranks 2 and
    3) are removed after the kill; both ranks receive their files from node 0 and the losses
    match the uninterrupted run at this layout."""
    def flags(save, extra=()):
        return gpt_flags(corpus, ITERS, tp=2, extra=["--save", save, "--save-interval", "4"]
                         + list(extra))

    two_per_node = {"LOCAL_WORLD_SIZE": "2"}
    ref = launch.start(launch.train_runs, 4, [{"name": "ref", "argv": flags(
        str(tmp_path / "ref_save"))}], log_dir=str(tmp_path / "ref"))
    assert ref.wait() == [0] * 4, ref.log(0)[-3000:]
    save, local = str(tmp_path / "ckpt"), str(tmp_path / "local")
    argv = flags(save, _np_local(local))
    _kill_after_7(tmp_path, argv, 4, two_per_node)
    assert sorted(os.listdir(os.path.join(local, "1", "iter_0000006"))) == \
        ["rank_00001.pt", "rank_00003.pt"]
    for rank in (2, 3):
        shutil.rmtree(os.path.join(local, str(rank)))
    resume = _resume(tmp_path, argv + ["--load", save], 4, two_per_node)
    for rank, holder in ((2, 0), (3, 1)):
        assert (f"NOTE: rank {rank}: no local checkpoint file of iteration 6; restored it from "
                f"the copy held by rank {holder}") in resume.log(rank)
    assert resume.results(3)["resume"]["losses"] == ref.results(3)["ref"]["losses"][6:]
