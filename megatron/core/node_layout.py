"""Which node each rank runs on: tensor-parallel locality, and naming the node a job lost.

torchrun gives each rank its node's index (``GROUP_RANK``) and numbers ranks node by node, so with
Megatron's layout (tensor-parallel rank fastest) a tensor-parallel group stays inside one node
whenever ``--tensor-model-parallel-size`` divides the processes per node. Two nodes with 2
processes each and TP = 2::

    node (GROUP_RANK):   0  0  1  1
    global rank:         0  1  2  3
    tensor-parallel:     [0, 1] [2, 3]     inside a node: the all-reduce of every layer stays local
    data-parallel:       [0, 2] [1, 3]     across nodes: one gradient all-reduce per step

With TP = 4 the one tensor-parallel group [0, 1, 2, 3] spans both nodes and every layer waits
for the network; :func:`tp_locality_warning` says so at start-up.

Every rank describes itself with a :class:`RankPlace` (node key, host name, the addresses its
collectives use); :func:`gather_places` shares them once. When a collective later fails, the
error text from gloo or NCCL usually names the peer's address ("Connection closed by peer
[10.0.0.2]:4120"); :func:`lost_peer_message` turns that back into a node and its ranks.
"""

import os
import re
import socket
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch.distributed as dist

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
_IPV4 = re.compile(r"(?<![\d.])(\d{1,3}(?:\.\d{1,3}){3})(?![\d.])")
_BRACKETED = re.compile(r"\[([0-9A-Za-z.:%-]+)\]")
# Words that mark an error raised by the communication library rather than by the model.
_COMMUNICATION_HINTS = ("gloo", "nccl", "c10d", "processgroup")


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs.

    Attributes:
        node: the node's key: torchrun's ``GROUP_RANK``, else SLURM's ``SLURM_NODEID``, else the
            host name (ranks with equal keys share a node).
        hostname: ``socket.gethostname()``.
        addresses: IP addresses this rank's collectives may use (those of the interfaces named
            by ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, and the one routed to
            ``MASTER_ADDR``).
    """

    node: str
    hostname: str
    addresses: Tuple[str, ...]


def interface_names(value: str) -> List[str]:
    """The exact interface names in a ``*_SOCKET_IFNAME`` value (``eth0,eth1``; ``=eth0``).

    NCCL's prefix forms (``^docker``, a bare prefix such as ``eth``) name no single interface;
    they are returned as given and simply match nothing in :func:`interface_address`.
    """
    names = []
    for part in value.split(","):
        part = part.strip().lstrip("=")
        if part and not part.startswith("^"):
            names.append(part)
    return names


def interface_address(ifname: str) -> Optional[str]:
    """IPv4 address of interface ``ifname`` here, or None (absent, no address, not Linux)."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except (ImportError, OSError):
        return None


def missing_interfaces(variable: str, env: Mapping[str, str] = os.environ) -> List[str]:
    """Interfaces named exactly by ``env[variable]`` that this host does not have."""
    value = env.get(variable, "")
    if not value:
        return []
    present = {name for _, name in socket.if_nameindex()}
    return [name for name in interface_names(value) if name not in present]


def _routed_address(host: Optional[str], port: Optional[str]) -> Optional[str]:
    """The local address the kernel would use to reach ``host`` (a UDP connect sends nothing)."""
    if not host:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, int(port or 29500)))
            return sock.getsockname()[0]
    except (OSError, ValueError):
        return None


def local_place(env: Mapping[str, str] = os.environ) -> RankPlace:
    """This process's :class:`RankPlace`, from torchrun's (or SLURM's) environment."""
    hostname = socket.gethostname()
    if env.get("GROUP_RANK") is not None:
        node = f"group {env['GROUP_RANK']}"
    elif env.get("SLURM_NODEID") is not None:
        node = f"slurm {env['SLURM_NODEID']}"
    else:
        node = f"host {hostname}"
    addresses = []
    for variable in SOCKET_IFNAME_VARIABLES:
        for name in interface_names(env.get(variable, "")):
            address = interface_address(name)
            if address and address not in addresses:
                addresses.append(address)
    routed = _routed_address(env.get("MASTER_ADDR"), env.get("MASTER_PORT"))
    if routed and routed not in addresses:
        addresses.append(routed)
    return RankPlace(node=node, hostname=hostname, addresses=tuple(addresses))


def gather_places() -> List[RankPlace]:
    """Every rank's :class:`RankPlace`, indexed by global rank: a collective over the whole
    world (named, not defaulted to, since "indexed by global rank" holds for it alone)."""
    world = dist.group.WORLD
    mine = local_place()
    if dist.get_world_size(world) == 1:
        return [mine]
    places: List[Optional[RankPlace]] = [None] * dist.get_world_size(world)
    dist.all_gather_object(places, mine, group=world)
    return places


def node_of_ranks(places: Sequence[RankPlace]) -> List[int]:
    """Node index of each rank, numbering nodes in order of their lowest rank.

    Under torchrun this equals ``GROUP_RANK``, since ranks are numbered node by node.
    """
    index: Dict[str, int] = {}
    return [index.setdefault(p.node, len(index)) for p in places]


def ranks_by_node(node_of: Sequence[int]) -> Dict[int, List[int]]:
    """``{node index: [global ranks on it]}``."""
    nodes: Dict[int, List[int]] = {}
    for rank, node in enumerate(node_of):
        nodes.setdefault(node, []).append(rank)
    return nodes


def _rank_span(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-7`` or ``ranks 0, 2, 5``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks[-1] - ranks[0] == len(ranks) - 1:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _where(place: RankPlace) -> str:
    return ", ".join((place.hostname,) + place.addresses)


def describe_nodes(places: Sequence[RankPlace]) -> str:
    """One line listing every node with its ranks and addresses, for the start-up log."""
    nodes = ranks_by_node(node_of_ranks(places))
    return "; ".join(f"node {node}: {_rank_span(ranks)} on {_where(places[ranks[0]])}"
                     for node, ranks in nodes.items())


def tp_groups_spanning_nodes(tp_groups: Sequence[Sequence[int]],
                             node_of: Sequence[int]) -> List[Tuple[List[int], List[int]]]:
    """``[(tp group, its nodes)]`` for every tensor-parallel group on more than one node."""
    spanning = []
    for group in tp_groups:
        nodes = sorted({node_of[r] for r in group})
        if len(nodes) > 1:
            spanning.append((list(group), nodes))
    return spanning


def tp_locality_warning(tp_groups: Sequence[Sequence[int]], tp_size: int,
                        node_of: Sequence[int]) -> Optional[str]:
    """A warning naming the tensor-parallel groups that cross nodes, or None if none do."""
    spanning = tp_groups_spanning_nodes(tp_groups, node_of)
    if not spanning:
        return None
    per_node = sorted({len(r) for r in ranks_by_node(node_of).values()})
    group, nodes = spanning[0]
    more = f" (and {len(spanning) - 1} more)" if len(spanning) > 1 else ""
    per_node_text = str(per_node[0]) if len(per_node) == 1 else \
        f"uneven: {', '.join(map(str, per_node))}"
    return (f"WARNING: tensor-model-parallel group {group} spans nodes "
            f"{', '.join(map(str, nodes))}{more}: its all-reduces in every layer will run at "
            f"network speed. Use a --tensor-model-parallel-size (now {tp_size}) that divides the "
            f"processes per node ({per_node_text}), and launch every node with the same "
            f"--nproc_per_node.")


def _error_addresses(error_text: str) -> List[str]:
    found = _IPV4.findall(error_text) + _BRACKETED.findall(error_text)
    return list(dict.fromkeys(found))


def lost_peer_message(error_text: str, places: Sequence[RankPlace], rank: int,
                      communication_error: bool = False) -> Optional[str]:
    """Name the node a failed collective lost, from the error's text; None if not a comms error.

    Args:
        error_text: the exception's message (and its causes').
        places: every rank's place, from :func:`gather_places`.
        rank: this process's global rank.
        communication_error: the caller knows the error came from torch.distributed (its type);
            otherwise the text must mention gloo, NCCL or c10d.
    """
    lowered = error_text.lower()
    if not communication_error and not any(h in lowered for h in _COMMUNICATION_HINTS):
        return None
    node_of = node_of_ranks(places)
    nodes = ranks_by_node(node_of)
    mine = node_of[rank]
    named = set()
    for address in _error_addresses(error_text):
        named.update(node_of[r] for r, p in enumerate(places) if address in p.addresses)
    if len({p.hostname for p in places}) == len(nodes) > 1:  # host names tell nodes apart
        for r, p in enumerate(places):
            # A message may carry this host's own name (NCCL's do); only others' names count.
            if node_of[r] != mine and re.search(
                    rf"(?<![\w.-]){re.escape(p.hostname)}(?![\w-])", error_text):
                named.add(node_of[r])
    first_line = error_text.strip().splitlines()[0] if error_text.strip() else ""

    def node_text(node):
        return f"node {node} ({_rank_span(nodes[node])} on {_where(places[nodes[node][0]])})"

    if not named:
        if len(nodes) < 2:
            return None
        return (f"[rank {rank}] a collective failed on node {mine} without naming its peer "
                f"({first_line[:200]}). Nodes in this job: {describe_nodes(places)}; another "
                "node stopped or became unreachable: see each node's log, then restart every "
                "node with --load to resume from the last checkpoint.")
    if named == {mine}:
        # A process of this node left first, typically after an error of its own (whose
        # message names the remote node when the network is to blame).
        return (f"[rank {rank}] a process on this node, {node_text(mine)}, closed its "
                f"connection: {first_line[:300]} See that process's own error above.")
    lost = "; ".join(node_text(node) for node in sorted(named - {mine}))
    return (f"[rank {rank}] lost peer: {lost}. A collective with it failed: "
            f"{first_line[:300]} Its processes stopped or its network went down; see that "
            "node's log, then restart every node with --load to resume from the last "
            "checkpoint.")
