"""Several machines: torchrun across two real network hosts, made from Linux network namespaces.

Each "node" is a network namespace with one end of a veth pair (10.213.0.1/30 and 10.213.0.2/30,
private to this test's namespaces; their ``lo`` is up too). One ``torchrun`` runs in each, started
by ``examples/pretrain_gpt_distributed.sh`` with only the host variables set (NNODES, NODE_RANK,
MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE, SOCKET_IFNAME), so every byte between the nodes crosses
the veth link. The files are shared, as on a cluster with a shared file system. The single-host
reference is the same script with NNODES=1 and 4 processes, run inside the first namespace, so
no traffic leaves the test's namespaces.

Cases: the two hosts train exactly as one host does (default suite, about 35 s on 2 busy cores);
one host's processes are killed mid-run, the other names it and exits, and the last checkpoint
resumes on one host (slow); the link goes down mid-run and the other host gives up after
--distributed-timeout-seconds-after-init (slow). The node-layout logic itself is tested without
namespaces.

The namespace cases need Linux, root and ``ip``; they are skipped where namespaces cannot be made.
Every namespace is deleted (its processes killed first) whatever happens, also at interpreter exit.
"""

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.functional.gpt_runs import gpt_flags, write_counting_corpus

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "examples", "pretrain_gpt_distributed.sh")
ADDRESSES = ("10.213.0.1", "10.213.0.2")
TRAIN_ITERS = 1000  # the schedule's length; runs stop earlier through --exit-interval or a kill
REFERENCE_ITERS = 8
RUN_TIMEOUT_S = 240
TIMEOUT_MINUTES = 1  # --distributed-timeout-minutes of the two-node runs
AFTER_INIT_TIMEOUT_S = 10  # --distributed-timeout-seconds-after-init of the unreachable host
ITERATION = re.compile(rf"^ iteration +(\d+)/ +{TRAIN_ITERS} \| .*\| lm loss: ([-+.\dE]+) \|")


def _namespaces_possible() -> bool:
    return (sys.platform.startswith("linux") and hasattr(os, "geteuid") and os.geteuid() == 0
            and shutil.which("ip") is not None)


needs_namespaces = pytest.mark.skipif(not _namespaces_possible(),
                                      reason="network namespaces need Linux, root and `ip`")


# ---------------------------------------------------------------------------------------------
# Two hosts in network namespaces


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _namespace_pids(ns):
    proc = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _kill_namespace_processes(ns):
    """SIGKILL every process in ``ns`` (only this test starts processes there)."""
    for pid in _namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class TwoHosts:
    """Two network namespaces joined by a veth pair; deleted by :meth:`close`."""

    def __init__(self):
        tag = f"mh{os.getpid()}"
        self.namespaces = (f"{tag}a", f"{tag}b")
        self.interfaces = (f"{tag}va", f"{tag}vb")  # under Linux's 15-character limit
        self.closed = False
        atexit.register(self.close)
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            _ip("link", "add", self.interfaces[0], "type", "veth", "peer", "name",
                self.interfaces[1])
            for ns, ifname, address in zip(self.namespaces, self.interfaces, ADDRESSES):
                _ip("link", "set", ifname, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{address}/30", "dev", ifname)
                _ip("-n", ns, "link", "set", ifname, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as err:
            self.close()
            detail = getattr(err, "stderr", "") or err
            pytest.skip(f"cannot make network namespaces here: {detail}")

    def close(self):
        if self.closed:
            return
        self.closed = True
        for ns in self.namespaces:
            _kill_namespace_processes(ns)
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)  # takes its veth end and the peer with it
        _ip("link", "del", self.interfaces[0], check=False)  # if never moved into a namespace


@pytest.fixture(scope="module")
def hosts():
    pair = TwoHosts()
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_counting_corpus(str(tmp_path_factory.mktemp("corpus") / "count_document"))


def _flags(corpus, cache_dir, *extra):
    """The tiny GPT, TP = 2 and a global batch of 8 (2 micro-batches of 2 per DP rank).

    A constant LR after warm-up and a long --train-iters keep the schedule and the data order
    identical however early a run stops.
    """
    return gpt_flags(corpus, TRAIN_ITERS, tp=2, global_batch=8, extra=[
        "--lr-decay-style", "constant", "--data-cache-path", cache_dir,
        "--distributed-timeout-minutes", str(TIMEOUT_MINUTES), *extra])


def _data_path(flags):
    return flags[flags.index("--data-path") + 1]


# torchrun's variables and the script's, which the test sets itself when it needs them.
INHERITED_NOT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "TORCHELASTIC_RUN_ID", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NNODES",
                 "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "RDZV", "RDZV_ID",
                 "SOCKET_IFNAME", "LOCAL_ADDR", "DATA", "CHECKPOINTS", "VOCAB", "MERGES", "TP",
                 "PP", "NUM_LAYERS", "HIDDEN", "HEADS", "SEQ", "MICRO_BATCH", "GLOBAL_BATCH",
                 "TRAIN_ITERS")


def _env(**host_vars):
    """This environment without torchrun's or the script's variables, plus ``host_vars``."""
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_NOT}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(OMP_NUM_THREADS="1", PRECISION="fp32", TOKENIZER="NullTokenizer",
               TENSORBOARD_DIR="")
    env.update({k: str(v) for k, v in host_vars.items()})
    return env


class Launch:
    """``examples/pretrain_gpt_distributed.sh`` inside one namespace, output to a log file."""

    def __init__(self, ns, log_path, env, flags):
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(["ip", "netns", "exec", ns, "bash", SCRIPT, *flags],
                                         cwd=REPO_ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout):
        return self.proc.wait(timeout=timeout)

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def losses(self):
        found = [ITERATION.match(line) for line in self.log().splitlines()]
        return {int(m[1]): m[2] for m in found if m}


def _run_all(launches, timeout=RUN_TIMEOUT_S):
    """Wait for every launch; on failure or timeout report each one's log tail."""
    deadline = time.monotonic() + timeout
    try:
        for launch in launches:
            launch.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    for launch in launches:
        if launch.proc.poll() is None:
            os.killpg(launch.proc.pid, signal.SIGKILL)
            launch.proc.wait()
    bad = [(launch, launch.proc.returncode) for launch in launches if launch.proc.returncode]
    assert not bad, "\n".join(f"--- {launch.log_path} exited {code}:\n{launch.log()[-4000:]}"
                              for launch, code in bad)


def _two_node_launches(hosts, tmp_path, name, flags, port, **extra_vars):
    """One launch per host; ``LOCAL_ADDR=1`` in ``extra_vars`` gives each its own address."""
    launches = []
    for i, (ns, ifname) in enumerate(zip(hosts.namespaces, hosts.interfaces)):
        host_vars = dict(DATA=_data_path(flags), NNODES=2, NODE_RANK=i,
                         MASTER_ADDR=ADDRESSES[0], MASTER_PORT=port, GPUS_PER_NODE=2,
                         SOCKET_IFNAME=ifname, CHECKPOINTS=tmp_path / f"{name}_checkpoints")
        host_vars.update(extra_vars)
        if host_vars.get("LOCAL_ADDR"):
            host_vars["LOCAL_ADDR"] = ADDRESSES[i]
        launches.append(Launch(ns, str(tmp_path / f"{name}_node{i}.log"), _env(**host_vars),
                               flags))
    return launches


def _single_host_launch(hosts, log_path, checkpoints, flags):
    """Four processes on one host (the first namespace), talking over its loopback only."""
    return Launch(hosts.namespaces[0], log_path,
                  _env(DATA=_data_path(flags), NNODES=1, NODE_RANK=0, MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=29500, GPUS_PER_NODE=4, CHECKPOINTS=checkpoints), flags)


class Reference:
    """The single-host run, 4 processes, TP = 2 x DP = 2, stopped by --exit-interval.

    It starts when created and is waited for on first use, so it runs alongside the two-host run.
    """

    def __init__(self, hosts, corpus, tmp):
        self.launch = _single_host_launch(
            hosts, str(tmp / "reference.log"), tmp / "checkpoints",
            _flags(corpus, str(tmp / "cache"), "--exit-interval", str(REFERENCE_ITERS)))
        self._losses = None

    def losses(self):
        if self._losses is None:
            _run_all([self.launch])
            self._losses = self.launch.losses()
            assert sorted(self._losses) == list(range(1, REFERENCE_ITERS + 1)), \
                self.launch.log()[-3000:]
        return self._losses


@pytest.fixture(scope="module")
def reference(hosts, corpus, tmp_path_factory):
    ref = Reference(hosts, corpus, tmp_path_factory.mktemp("reference"))
    try:
        yield ref
    finally:
        if ref.launch.proc.poll() is None:
            os.killpg(ref.launch.proc.pid, signal.SIGKILL)
            ref.launch.proc.wait()


@pytest.mark.slow  # about 20 s: two namespaces of two ranks each
@needs_namespaces
def test_two_hosts_train_as_one_host(hosts, corpus, reference, tmp_path):
    """torchrun on two hosts (2 processes each, static --master_addr form) with TP = 2 inside
    each host and DP = 2 across them: the losses equal the single-host 4-process run's.

    Same layout and same reduction order, whatever carries the bytes, so the printed losses
    agree exactly (dropout on: each rank's RNG stream is the same too)."""
    flags = _flags(corpus, str(tmp_path / "cache"), "--exit-interval", str(REFERENCE_ITERS))
    launches = _two_node_launches(hosts, tmp_path, "two_hosts", flags, 29400)
    _run_all(launches)
    node0, node1 = (launch.log() for launch in launches)
    assert "world size 4 = tensor-model-parallel 2 x pipeline-model-parallel 1 x " \
           "data-parallel 2" in node0
    assert re.search(r"> 2 nodes: node 0: ranks 0-1 on [^;]*10\.213\.0\.1; "
                     r"node 1: ranks 2-3 on [^;]*10\.213\.0\.2", node0), node0[-3000:]
    assert "spans nodes" not in node0  # TP = 2 divides 2 processes per node
    assert launches[1].losses() == reference.losses(), (launches[1].losses(), reference.losses())
    assert not launches[0].losses()  # the last rank logs, and it lives on node 1


def _read_tracker(checkpoints):
    try:
        with open(os.path.join(checkpoints, "latest_checkpointed_iteration.txt")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _fail_second_host(hosts, launches, ready, fail):
    """Once ``ready()``, ``fail()`` the second host; returns the first host's exit code and the
    seconds it took to exit after the failure. Every launch is stopped before returning."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not ready():  # a condition poll, bounded by the deadline
            assert all(launch.proc.poll() is None for launch in launches), \
                "\n".join(launch.log()[-3000:] for launch in launches)
            assert time.monotonic() < deadline, "the two-host run did not get going in time"
            time.sleep(0.02)
        fail()
        failed_at = time.monotonic()
        code = launches[0].wait(TIMEOUT_MINUTES * 60 + 60)
        return code, time.monotonic() - failed_at
    finally:
        for launch in launches:
            if launch.proc.poll() is None:
                os.killpg(launch.proc.pid, signal.SIGKILL)
                launch.proc.wait()


@needs_namespaces
@pytest.mark.slow
def test_lost_host_is_named_and_last_checkpoint_resumes_on_one_host(hosts, corpus, reference,
                                                                   tmp_path):
    """Two hosts via the c10d rendezvous, checkpointing every iteration; the second host's
    processes are killed mid-run. The first host exits within --distributed-timeout-minutes
    naming node 1 and its ranks; the last checkpoint then resumes on one host and continues with
    the losses of the run that was never interrupted."""
    flags = _flags(corpus, str(tmp_path / "cache"), "--save-interval", "1")
    checkpoints = tmp_path / "lost_checkpoints"
    # Both hosts share one host name, so each announces its own address (LOCAL_ADDR).
    launches = _two_node_launches(hosts, tmp_path, "lost", flags, 29410, RDZV="c10d",
                                  RDZV_ID=f"lost{os.getpid()}", LOCAL_ADDR=1)
    code, survivor_s = _fail_second_host(
        hosts, launches, lambda: (_read_tracker(checkpoints) or 0) >= 2,
        lambda: _kill_namespace_processes(hosts.namespaces[1]))
    node0 = launches[0].log()
    assert code != 0, node0[-3000:]
    assert survivor_s < TIMEOUT_MINUTES * 60, survivor_s
    # The rendezvous numbers the nodes; the start-up line (printed by global rank 0, on either
    # host) says which node index and ranks the killed host had.
    both = node0 + launches[1].log()
    layout = re.search(r"> 2 nodes: node 0: (ranks \d-\d) on ([^;]*); node 1: (ranks \d-\d) on "
                       r"(.*)", both)
    assert layout, both[-4000:]
    lost_node = 0 if ADDRESSES[1] in layout[2] else 1
    lost_ranks = layout[1 + 2 * lost_node]
    assert re.search(rf"\[rank \d\] lost peer: node {lost_node} \({lost_ranks} on "
                     rf"[^)]*{re.escape(ADDRESSES[1])}\)", node0), node0[-4000:]

    last = _read_tracker(checkpoints)
    assert last is not None and 2 <= last <= REFERENCE_ITERS - 2, last
    resumed = _single_host_launch(  # one host, 4 processes: the same layout
        hosts, str(tmp_path / "resumed.log"), checkpoints,
        flags + ["--exit-interval", str(last + 2)])
    _run_all([resumed])
    log = resumed.log()
    assert re.search(rf"successfully loaded checkpoint from {re.escape(str(checkpoints))} "
                     rf"at iteration +{last}\b", log), log[-3000:]
    expected = {i: reference.losses()[i] for i in (last + 1, last + 2)}
    assert resumed.losses() == expected, (resumed.losses(), reference.losses())


# ---------------------------------------------------------------------------------------------
# Node layout logic, without namespaces


def _places(*specs):
    from megatron.core.node_layout import RankPlace

    return [RankPlace(node=node, hostname=host, addresses=tuple(addrs))
            for node, host, addrs in specs]


def test_tensor_parallel_groups_checked_against_nodes():
    """Megatron's layout keeps TP groups inside a node exactly when TP divides the processes per
    node; otherwise the warning names a spanning group, its nodes and the sizes involved."""
    from megatron.core import node_layout
    from megatron.core.parallel_state import compute_rank_layout

    def nodes(count, per_node):  # torchrun numbers ranks node by node
        return [r // per_node for r in range(count * per_node)]

    for tp in (1, 2, 4):
        layout = compute_rank_layout(8, tp)
        assert node_layout.tp_groups_spanning_nodes(layout.tp_groups, nodes(2, 4)) == []
        assert node_layout.tp_locality_warning(layout.tp_groups, tp, nodes(2, 4)) is None
    layout = compute_rank_layout(8, 4)  # 4 nodes x 2 processes: every TP group spans 2 nodes
    assert node_layout.tp_groups_spanning_nodes(layout.tp_groups, nodes(4, 2)) == [
        ([0, 1, 2, 3], [0, 1]), ([4, 5, 6, 7], [2, 3])]
    warning = node_layout.tp_locality_warning(layout.tp_groups, 4, nodes(4, 2))
    assert warning.startswith("WARNING: tensor-model-parallel group [0, 1, 2, 3] spans nodes "
                              "0, 1 (and 1 more)")
    assert "--tensor-model-parallel-size (now 4)" in warning
    assert "processes per node (2)" in warning
    uneven = node_layout.tp_locality_warning([[0, 1], [2, 3]], 2, [0, 0, 0, 1])
    assert "spans nodes 0, 1" in uneven and "uneven: 1, 3" in uneven


def test_node_index_follows_group_rank_then_slurm_then_host():
    from megatron.core import node_layout

    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert node_layout.local_place({**base, "GROUP_RANK": "3", "SLURM_NODEID": "1"}).node == \
        "group 3"
    assert node_layout.local_place({**base, "SLURM_NODEID": "1"}).node == "slurm 1"
    place = node_layout.local_place(base)
    assert place.node.startswith("host ") and place.addresses == ("127.0.0.1",)
    places = _places(("group 1", "a", ()), ("group 1", "a", ()), ("group 0", "b", ()),
                     ("group 0", "b", ()))
    assert node_layout.node_of_ranks(places) == [0, 0, 1, 1]  # numbered by lowest rank
    assert node_layout.interface_names("=eth0, ib0,^docker") == ["eth0", "ib0"]
    assert node_layout.interface_address("lo") == "127.0.0.1"
    assert node_layout.interface_address("no-such-if0") is None
    assert node_layout.missing_interfaces("GLOO_SOCKET_IFNAME",
                                          {"GLOO_SOCKET_IFNAME": "lo,no-such-if0"}) == \
        ["no-such-if0"]


GLOO_LOST = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
             "peer [10.0.0.2]:6296. This is typically caused by a remote worker crashing.")


def test_lost_peer_named_from_the_error_text():
    """gloo's error names the peer's address; the report turns it into node 1 and its ranks.
    Errors that are not from the communication library get no report."""
    from megatron.core import node_layout

    places = _places(("group 0", "n0", ("10.0.0.1",)), ("group 0", "n0", ("10.0.0.1",)),
                     ("group 1", "n1", ("10.0.0.2",)), ("group 1", "n1", ("10.0.0.2",)))
    message = node_layout.lost_peer_message(GLOO_LOST, places, 1)
    assert message.startswith("[rank 1] lost peer: node 1 (ranks 2-3 on n1, 10.0.0.2). "
                              "A collective with it failed: [/pytorch/")
    nccl = "NCCL error: remote process exited or there was a network error, host n1 died"
    assert "lost peer: node 1 (ranks 2-3 on n1, 10.0.0.2)" in \
        node_layout.lost_peer_message(nccl, places, 0)
    local = node_layout.lost_peer_message(GLOO_LOST.replace("10.0.0.2", "10.0.0.1"), places, 0)
    assert local.startswith("[rank 0] a process on this node, node 0 (ranks 0-1 on n0, "
                            "10.0.0.1), closed its connection: ") and "lost peer" not in local
    unnamed = node_layout.lost_peer_message("gloo: Timed out waiting 60000ms", places, 0)
    assert "without naming its peer" in unnamed and "node 1: ranks 2-3 on n1, 10.0.0.2" in unnamed
    own_host = node_layout.lost_peer_message("NCCL error on n0: unhandled system error", places, 0)
    assert "without naming its peer" in own_host  # its own host name names no peer
    typed = node_layout.lost_peer_message("Timed out after 60000ms, peer 10.0.0.2", places, 0,
                                          communication_error=True)
    assert "lost peer: node 1 (ranks 2-3 on n1, 10.0.0.2)" in typed
    assert node_layout.lost_peer_message("CUDA out of memory at 10.0.0.2", places, 0) is None
    single = _places(("group 0", "n0", ("10.0.0.1",)))
    assert node_layout.lost_peer_message("gloo: Timed out", single, 0) is None


def test_missing_gloo_interface_fails_early(monkeypatch):
    from megatron.training import initialize

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(RuntimeError, match=r"GLOO_SOCKET_IFNAME=no-such-if0 names interface\(s\) "
                                           r"no-such-if0 that this host .* expected one of: .*lo"):
        initialize._check_socket_ifname("gloo")
    initialize._check_socket_ifname("nccl")  # NCCL's prefix forms are NCCL's to judge


def test_startup_check_warns_once_when_tp_spans_nodes(monkeypatch, capsys):
    """Rank 0 alone lists the nodes and warns about the TP group [0, 1] spanning them; on one
    node nothing is printed. (The exchange itself runs for real in the two-host test.)"""
    from types import SimpleNamespace

    from megatron.training import initialize
    from megatron.core import node_layout
    from megatron.core.parallel_state import compute_rank_layout

    layout = compute_rank_layout(2, 2)
    split = _places(("group 0", "n0", ("10.0.0.1",)), ("group 1", "n1", ("10.0.0.2",)))
    one = _places(("group 0", "n0", ("10.0.0.1",)), ("group 0", "n0", ("10.0.0.1",)))
    monkeypatch.setattr(initialize, "_PLACES", None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    for places, rank, expected in (
            (split, 0, "> 2 nodes: node 0: rank 0 on n0, 10.0.0.1; node 1: rank 1 on n1, "
                       "10.0.0.2\nWARNING: tensor-model-parallel group [0, 1] spans nodes 0, 1: "),
            (split, 1, ""), (one, 0, "")):
        monkeypatch.setattr(node_layout, "gather_places", lambda group=None, p=places: p)
        pstate = SimpleNamespace(rank=rank, layout=layout, tp_size=2)
        assert initialize.check_node_layout(pstate) is places
        out = capsys.readouterr().out
        assert out.startswith(expected) and out.count("WARNING") == expected.count("WARNING")
        assert initialize._PLACES is places  # kept for the lost-peer report


def test_uncaught_collective_error_ends_with_the_lost_peer(monkeypatch, capsys):
    """The hook armed at start-up prints the usual traceback, then the line naming the node."""
    import torch.distributed as dist

    from megatron.training import initialize

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    places = _places(("group 0", "n0", ("10.0.0.1",)), ("group 1", "n1", ("10.0.0.2",)))
    monkeypatch.setattr(initialize, "_PLACES", places)
    initialize._install_lost_peer_report()
    initialize._install_lost_peer_report()  # armed once however often start-up runs
    try:
        raise ValueError("while saving") from RuntimeError(GLOO_LOST)
    except ValueError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
    lines = capsys.readouterr().err.strip().splitlines()
    assert "ValueError: while saving" in lines[-2]
    assert lines[-1].startswith("[rank 0] lost peer: node 1 (rank 1 on n1, 10.0.0.2). ")
    assert sum("lost peer" in line for line in lines) == 1


@needs_namespaces
@pytest.mark.slow
def test_unreachable_host_ends_the_run_within_the_timeout(hosts, corpus, tmp_path):
    """The veth link goes down mid-run, so no connection closes: the first host's collectives
    give up after --distributed-timeout-seconds-after-init (which every process group, not only
    the world group, takes after the first iteration; the link goes down later) and it exits,
    listing the nodes of the job. Exiting before --distributed-timeout-minutes (60 s) shows the
    shorter timeout ended it; waiting out the full minute took 68 s."""
    flags = _flags(corpus, str(tmp_path / "cache"), "--distributed-timeout-seconds-after-init",
                   str(AFTER_INIT_TIMEOUT_S))
    launches = _two_node_launches(hosts, tmp_path, "unreachable", flags, 29430)
    down = ("-n", hosts.namespaces[1], "link", "set", hosts.interfaces[1])
    try:
        code, survivor_s = _fail_second_host(
            hosts, launches, lambda: 2 in launches[1].losses(), lambda: _ip(*down, "down"))
    finally:
        _ip(*down, "up")
    node0 = launches[0].log()
    assert code != 0, node0[-3000:]
    # The timeout, then torchrun stopping the node's other processes.
    assert AFTER_INIT_TIMEOUT_S <= survivor_s < TIMEOUT_MINUTES * 60, survivor_s
    assert re.search(r"\[rank [01]\] a collective failed on node 0 without naming its peer "
                     r"\(.*Timed out.*\)\. Nodes in this job: node 0: ranks 0-1 on "
                     r"[^;]*10\.213\.0\.1; node 1: ranks 2-3 on [^;]*10\.213\.0\.2",
                     node0), node0[-4000:]
