"""Who am I in the job? Discover the world from the launcher's environment.

:func:`discover` reads the variables a launcher gives each process and returns
a :class:`WorldInfo`. The first launcher whose variables are present wins, in
this order:

==============  ===========================================================
HOROVOD_GLOO    ``horovodrun --gloo``: ``HOROVOD_RANK``, ``HOROVOD_SIZE``,
                ``HOROVOD_LOCAL_RANK/SIZE``, ``HOROVOD_CROSS_RANK/SIZE``,
                ``HOROVOD_HOSTNAME``, ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``
TORCHRUN        ``torchrun`` / ``torch.distributed.run``: ``RANK``,
                ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
                ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR/PORT``
OPEN_MPI        Open MPI's ``mpirun`` (also ``horovodrun`` in MPI mode):
                ``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``
MPICH           MPICH / Intel MPI (Hydra): ``PMI_RANK``, ``PMI_SIZE``,
                ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``
SLURM           ``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
                ``SLURM_NODEID``, ``SLURM_NNODES``, tasks per node
SINGLE          none of the above: one process
==============  ===========================================================

``cross_rank``/``cross_size`` are the node index and the node count (what
Horovod's ``cross_rank()``/``cross_size()`` return on uniform layouts). Where
the launcher does not give them (Open MPI, MPICH), they are derived as
``rank // local_size`` and ``ceil(size / local_size)``, which assumes ranks are
placed on nodes in blocks of equal size (mpirun's default ``--map-by slot``);
``WorldInfo.cross_derived`` says so and ``cgx.init()`` replaces them with the
layout measured from all ranks' host names when that differs.

The module also holds the small network helpers that find the address other
hosts reach this one at (:func:`advertised_address`); they use only the
standard library so that ``cgxrun`` and ``import cgx`` stay cheap.
"""

from __future__ import annotations

import dataclasses
import enum
import fcntl
import ipaddress
import os
import re
import socket
import struct
from typing import Iterable, Mapping, Optional, Sequence

from cgx.errors import CGXError, ConfigError


class Launcher(enum.Enum):
    """The launcher whose environment :func:`discover` recognized."""

    HOROVOD_GLOO = "horovod_gloo"  # horovodrun --gloo (HTTP key-value rendezvous)
    TORCHRUN = "torchrun"  # torchrun / python -m torch.distributed.run
    OPEN_MPI = "open_mpi"  # Open MPI mpirun, also horovodrun's MPI mode
    MPICH = "mpich"  # MPICH / Intel MPI Hydra (mpiexec)
    SLURM = "slurm"  # srun without an MPI launcher in between
    SINGLE = "single"  # no launcher: a world of one process


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """This process's place in the job, as the launcher describes it.

    Attributes:
        rank, size: global rank and number of ranks.
        local_rank, local_size: rank on this node and ranks on this node.
        cross_rank, cross_size: index of this node and number of nodes.
        hostname: this node's name (``HOROVOD_HOSTNAME`` under horovodrun).
        launcher: which launcher's variables were found.
        master_addr, master_port: rank 0's rendezvous endpoint when the
            environment names it (torchrun, ``MASTER_ADDR``/``MASTER_PORT`` set
            by the user, Slurm); None when ``cgx.init()`` must find it.
        rendezvous_addr, rendezvous_port: horovodrun's HTTP key-value server.
        cross_derived: True when cross_rank/cross_size were computed from a
            uniform-layout assumption rather than given by the launcher.
        notes: human-readable assumptions made while discovering.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    launcher: Launcher
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rendezvous_addr: Optional[str] = None
    rendezvous_port: Optional[int] = None
    cross_derived: bool = False
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        """Plain JSON-ready dict (the launcher as its string value)."""
        d = dataclasses.asdict(self)
        d["launcher"] = self.launcher.value
        d["notes"] = list(self.notes)
        return d


# -- parsing helpers ---------------------------------------------------------

def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw.strip()


def _int(env: Mapping[str, str], name: str, launcher: str) -> Optional[int]:
    raw = _get(env, name)
    if raw is None:
        return None
    try:
        return int(raw, 10)
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is not an integer; {launcher} should set it "
                          f"to a whole number (unset it if it is left over from another job)"
                          ) from None


def _need(env: Mapping[str, str], name: str, launcher: str, because: str) -> int:
    value = _int(env, name, launcher)
    if value is None:
        raise ConfigError(f"{name} is not set although {because}; a {launcher} launch sets both "
                          f"(unset the stray variables, or launch with {launcher})")
    return value


def _port(env: Mapping[str, str], name: str, launcher: str) -> Optional[int]:
    port = _int(env, name, launcher)
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"{name}={port} is not a TCP port; expected 1..65535")
    return port


def _check_pair(rank: int, size: int, rank_var: str, size_var: str) -> None:
    if size < 1:
        raise ConfigError(f"{size_var}={size} is not a valid size; expected at least 1")
    if not 0 <= rank < size:
        raise ConfigError(f"{rank_var}={rank} is out of range for {size_var}={size}; "
                          f"expected 0 <= {rank_var} < {size_var}")


def _finish(launcher: Launcher, env: Mapping[str, str], *, rank: int, size: int,
            names: tuple[str, str, str, str], local_rank: Optional[int],
            local_size: Optional[int], cross_rank: Optional[int] = None,
            cross_size: Optional[int] = None, cross_names: tuple[str, str] = ("", ""),
            hostname: Optional[str] = None, notes: Sequence[str] = (), **extra) -> WorldInfo:
    """Validate the numbers, fill in what the launcher left out, build the WorldInfo."""
    rank_var, size_var, lrank_var, lsize_var = names
    _check_pair(rank, size, rank_var, size_var)
    notes = list(notes)
    if local_rank is None or local_size is None:
        if size > 1 and (local_rank is not None or local_size is not None):
            missing = lsize_var if local_size is None else lrank_var
            raise ConfigError(f"{missing} is not set although "
                              f"{lrank_var if local_size is None else lsize_var} is; "
                              f"{launcher.value} sets both")
        # No per-node information at all: one node holds every rank.
        local_rank, local_size = rank, size
        if size > 1:
            notes.append(f"{lrank_var}/{lsize_var} not set: assumed all ranks on one node")
    _check_pair(local_rank, local_size, lrank_var, lsize_var)
    if local_size > size:
        raise ConfigError(f"{lsize_var}={local_size} is larger than {size_var}={size}; "
                          f"a node cannot hold more ranks than the job")
    derived = cross_rank is None or cross_size is None
    if derived:
        # Uniform block layout (mpirun --map-by slot): node k holds ranks
        # k*local_size .. (k+1)*local_size - 1. Checked against host names at init.
        cross_rank, cross_size = rank // local_size, -(-size // local_size)
        if cross_size > 1:
            notes.append("cross_rank/cross_size derived as rank // local_size (assumes every node "
                         "holds local_size consecutive ranks)")
    else:
        _check_pair(cross_rank, cross_size, *cross_names)
        if cross_size > size:
            raise ConfigError(f"{cross_names[1]}={cross_size} is larger than {size_var}={size}; "
                              f"there cannot be more nodes than ranks")
    master_addr = extra.pop("master_addr", None)
    master_port = extra.pop("master_port", None)
    if master_addr is None and master_port is None:
        # A user may name rank 0's endpoint for any launcher.
        master_addr = _get(env, "MASTER_ADDR")
        master_port = _port(env, "MASTER_PORT", "the user")
        if (master_addr is None) != (master_port is None):
            master_addr = master_port = None
            notes.append("only one of MASTER_ADDR/MASTER_PORT is set: both ignored")
    return WorldInfo(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                     cross_rank=cross_rank, cross_size=cross_size,
                     hostname=hostname or socket.gethostname(), launcher=launcher,
                     master_addr=master_addr, master_port=master_port,
                     cross_derived=derived and cross_size > 1, notes=tuple(notes), **extra)


# -- one reader per launcher ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Names:
    """The variables one launcher sets, and how its messages name it."""

    who: str
    rank: str
    size: str
    local_rank: str
    local_size: str
    cross: tuple[str, str] = ("", "")  # node index and node count, where given
    hostname: str = ""


def _read(launcher: Launcher, names: _Names, env: Mapping[str, str], **extra) -> WorldInfo:
    """The common reading: rank and size (size required), local and cross pairs."""
    rank = _int(env, names.rank, names.who)
    size = _need(env, names.size, names.who, f"{names.rank}={rank} is")
    cross_rank, cross_size = (_int(env, v, names.who) if v else None for v in names.cross)
    return _finish(launcher, env, rank=rank, size=size,
                   names=(names.rank, names.size, names.local_rank, names.local_size),
                   local_rank=_int(env, names.local_rank, names.who),
                   local_size=_int(env, names.local_size, names.who),
                   cross_rank=cross_rank, cross_size=cross_size, cross_names=names.cross,
                   hostname=_get(env, names.hostname) if names.hostname else None, **extra)


_HOROVOD = _Names("horovodrun --gloo", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                  "HOROVOD_LOCAL_SIZE", ("HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"),
                  "HOROVOD_HOSTNAME")
_TORCHRUN = _Names("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                   ("GROUP_RANK", "GROUP_WORLD_SIZE"))
_OPEN_MPI = _Names("Open MPI's mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
_MPICH = _Names("MPICH's mpiexec (Hydra)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                "MPI_LOCALNRANKS")


def _horovod_gloo(env):
    addr = _get(env, "HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = _port(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", _HOROVOD.who)
    size = _int(env, "HOROVOD_SIZE", _HOROVOD.who)
    if size is not None and size > 1 and (addr is None or port is None):
        raise ConfigError("HOROVOD_GLOO_RENDEZVOUS_ADDR/HOROVOD_GLOO_RENDEZVOUS_PORT are not set "
                          f"although HOROVOD_SIZE={size}; horovodrun --gloo sets them (launch "
                          "with horovodrun, or unset the HOROVOD_* variables)")
    return _read(Launcher.HOROVOD_GLOO, _HOROVOD, env, rendezvous_addr=addr,
                 rendezvous_port=port)


def _torchrun(env):
    return _read(Launcher.TORCHRUN, _TORCHRUN, env, master_addr=_get(env, "MASTER_ADDR"),
                 master_port=_port(env, "MASTER_PORT", _TORCHRUN.who))


def _open_mpi(env):
    return _read(Launcher.OPEN_MPI, _OPEN_MPI, env)


def _mpich(env):
    return _read(Launcher.MPICH, _MPICH, env)


def parse_slurm_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's compressed tasks-per-node list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for item in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ConfigError(f"tasks per node {value!r} is not in Slurm's format, e.g. '2(x3),1'")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if m is None or not m.group(1).strip():
        raise ConfigError(f"node list {nodelist!r} is not in Slurm's format, e.g. 'node[01-04]'")
    prefix, ranges = m.group(1).strip(), m.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0].strip()


# Port of rank 0's store under Slurm when MASTER_PORT is not set: derived from
# the job id so that concurrent jobs on one node rarely collide.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 20000


def _slurm(env):
    who = "Slurm's srun"
    rank = _int(env, "SLURM_PROCID", who)
    size_var = "SLURM_STEP_NUM_TASKS" if _get(env, "SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    size = _need(env, size_var, who, f"SLURM_PROCID={rank} is")
    nodes_var = next((v for v in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
                      if _get(env, v)), "SLURM_NNODES")
    node = _int(env, "SLURM_NODEID", who)
    nodes = _int(env, nodes_var, who)
    notes = []
    local_size = None
    per_node_var = next((v for v in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
                                     "SLURM_TASKS_PER_NODE") if _get(env, v)), None)
    if per_node_var is not None:
        counts = parse_slurm_tasks_per_node(env[per_node_var])
        if node is not None and len(counts) > 1:
            if not 0 <= node < len(counts):
                raise ConfigError(f"SLURM_NODEID={node} is out of range for "
                                  f"{per_node_var}={env[per_node_var]!r} ({len(counts)} nodes)")
            local_size = counts[node]
        else:
            local_size = counts[0]
    master_addr = _get(env, "MASTER_ADDR")
    master_port = _port(env, "MASTER_PORT", "the user")
    if master_addr is None:
        nodelist = next((env[v] for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
                                          "SLURM_NODELIST") if _get(env, v)), None)
        if nodelist is not None:
            master_addr = first_slurm_host(nodelist)
            notes.append("master address: first node of the Slurm node list (rank 0 runs there "
                         "with srun's default block distribution)")
    if master_addr is not None and master_port is None:
        job = _int(env, "SLURM_JOB_ID", who) or 0
        master_port = SLURM_PORT_BASE + job % SLURM_PORT_SPAN
        notes.append(f"master port {master_port} derived from SLURM_JOB_ID (set MASTER_PORT to "
                     f"choose it)")
    return _finish(Launcher.SLURM, env, rank=rank, size=size,
                   names=("SLURM_PROCID", size_var, "SLURM_LOCALID", per_node_var or
                          "SLURM_NTASKS_PER_NODE"),
                   local_rank=_int(env, "SLURM_LOCALID", who), local_size=local_size,
                   cross_rank=node, cross_size=nodes,
                   cross_names=("SLURM_NODEID", nodes_var),
                   hostname=_get(env, "SLURMD_NODENAME"), notes=notes,
                   master_addr=master_addr, master_port=master_port)


# (variable that marks the launcher, parser), in precedence order.
_LAUNCHERS = (
    ("HOROVOD_RANK", _horovod_gloo),
    ("RANK", _torchrun),
    ("OMPI_COMM_WORLD_RANK", _open_mpi),
    ("PMI_RANK", _mpich),
    ("SLURM_PROCID", _slurm),
)


def discover(env: Optional[Mapping[str, str]] = None) -> WorldInfo:
    """Describe this process's place in the job from the launcher's variables.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        The :class:`WorldInfo` of the first launcher found (see the module
        docstring for the order); a 1-rank world when there is none.

    Raises:
        ConfigError (a ValueError): a variable is not an integer, a rank is
            out of range of its size, or a launcher's variables are incomplete.
            The message names the variable and its value.

    Example:
        >>> discover({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...           "LOCAL_WORLD_SIZE": "2"}).cross_size
        1
    """
    env = os.environ if env is None else env
    for marker, parse in _LAUNCHERS:
        if _get(env, marker) is not None:
            return parse(env)
    return _finish(Launcher.SINGLE, env, rank=0, size=1,
                   names=("rank", "size", "local_rank", "local_size"),
                   local_rank=0, local_size=1, cross_rank=0, cross_size=1)


# -- network helpers -------------------------------------------------------------

_SIOCGIFADDR = 0x8915  # Linux ioctl: IPv4 address of an interface


def interface_address(ifname: str) -> str:
    """IPv4 address of network interface ``ifname`` (Linux).

    Raises:
        ConfigError: no such interface, or it has no IPv4 address.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", ifname.encode()[:15]))
    except OSError as e:
        names = ", ".join(name for _, name in socket.if_nameindex())
        raise ConfigError(f"network interface {ifname!r} has no IPv4 address ({e.strerror}); "
                          f"interfaces here: {names}. Fix GLOO_SOCKET_IFNAME / "
                          f"--network-interface") from None
    return socket.inet_ntoa(packed[20:24])


def local_addresses() -> set[str]:
    """IPv4 addresses of this host's interfaces (plus what its host name resolves to)."""
    found = {"127.0.0.1"}
    for _, name in socket.if_nameindex():
        try:
            found.add(interface_address(name))
        except ConfigError:
            pass
    try:
        found.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return found


def is_local_host(host: str) -> bool:
    """True if ``host`` (name or address) is this machine."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return True
    me = socket.gethostname()
    if host in (me, me.split(".")[0], socket.getfqdn()):
        return True
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
    return bool(addrs & local_addresses())


def route_source_address(target: str) -> Optional[str]:
    """The local IPv4 address this host sends from to reach ``target``, or None.

    Uses a UDP ``connect``, which only consults the routing table: no packet
    is sent.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


# Probed for "the interface that leads outside" when nothing better is known;
# route_source_address() sends nothing to it.
_OUTSIDE_PROBE = "8.8.8.8"


def advertised_address(env: Mapping[str, str], *, all_local: bool,
                       peers: Iterable[str] = ()) -> str:
    """The address other ranks should use to reach this host (rank 0's store).

    In order: the IPv4 address of the interface named by ``GLOO_SOCKET_IFNAME``
    (or ``HOROVOD_GLOO_IFACE``, ``NCCL_SOCKET_IFNAME``); ``127.0.0.1`` when every
    rank runs on this host; the source address of the route to a peer host
    (``peers``: other ranks' host names or horovodrun's rendezvous address);
    the source address of the route to the outside; what this host's name
    resolves to.

    Raises:
        CGXError: only loopback addresses were found while ranks run on
            several hosts; the message says which variable to set.
    """
    for var in ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME"):
        value = _get(env, var)
        if value is None:
            continue
        # NCCL's syntax allows "^lo" (exclude) and "=eth0" (exact); only a plain
        # or exact name names one interface.
        first = value.split(",")[0].strip().lstrip("=")
        if first and not first.startswith("^"):
            return interface_address(first)
    if all_local:
        return "127.0.0.1"
    candidates = []
    for peer in peers:
        try:
            addr = socket.getaddrinfo(peer, None, socket.AF_INET)[0][4][0]
        except OSError:
            continue
        candidates.append(route_source_address(addr))
    candidates.append(route_source_address(_OUTSIDE_PROBE))
    try:
        candidates.append(socket.gethostbyname(socket.gethostname()))
    except OSError:
        pass
    for addr in candidates:
        if addr and not _is_loopback(addr):
            return addr
    raise CGXError(f"could not find an address of host {socket.gethostname()!r} that other hosts "
                   f"can reach (only loopback found); set GLOO_SOCKET_IFNAME to the interface "
                   f"to use (cgxrun --network-interface), or MASTER_ADDR and MASTER_PORT")


# -- the node layout, agreed once the ranks are connected ------------------------------

def adopt_group(world: WorldInfo, rank: int, size: int) -> tuple[WorldInfo, bool]:
    """Check the transport's group (this ``rank`` of ``size``) against the launcher's world.

    Returns (world, adopted): adopted when no known launcher started the ranks
    and the world comes from the transport's group.
    """
    if size == world.size and rank == world.rank:
        return world, False
    if world.launcher is Launcher.SINGLE:
        # A group the user made without a launcher we know: the group is the world;
        # node_layout() measures the nodes from host names.
        return dataclasses.replace(
            world, rank=rank, size=size, local_rank=0, local_size=1, cross_rank=0,
            cross_size=1, cross_derived=True,
            notes=world.notes + ("world taken from the transport's group",)), True
    raise ConfigError(f"the transport's group has rank {rank} of {size}, but "
                      f"{world.launcher.value} started this process as rank {world.rank} of "
                      f"{world.size}; pass a transport over all ranks of the job")


def layout_from_hosts(hosts: list[str]) -> list[tuple[int, int, int]]:
    """(node index, local rank, local size) of every rank, from their host names.

    Nodes are numbered in the order of their lowest rank; local ranks follow
    global rank order on each node.
    """
    nodes: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        nodes.setdefault(h, []).append(r)
    index = {h: i for i, h in enumerate(nodes)}
    return [(index[h], nodes[h].index(r), len(nodes[h])) for r, h in enumerate(hosts)]


def layout_row(world: WorldInfo) -> tuple:
    """What each rank tells the others for :func:`node_layout` (one allgather)."""
    return (world.hostname, world.local_rank, world.local_size, world.cross_rank)


def node_layout(world: WorldInfo, rows: list, adopted: bool = False):
    """The node layout from every rank's :func:`layout_row`: (world, local groups, cross groups).

    Launcher values are kept when the launcher gave them; derived node indices
    (and, for an adopted group, everything) come from the host names.
    """
    if world.cross_derived:
        measured = layout_from_hosts([row[0] for row in rows])
        if adopted or all((m[1], m[2]) == (row[1], row[2]) for m, row in zip(measured, rows)):
            node, lrank, lsize = measured[world.rank]
            nodes = max(m[0] for m in measured) + 1
            world = dataclasses.replace(
                world, local_rank=lrank, local_size=lsize, cross_rank=node, cross_size=nodes,
                cross_derived=False,
                notes=tuple(n for n in world.notes if not n.startswith("cross_rank/cross_size"))
                + ("node layout measured from host names",))
            rows = [(h, m[1], m[2], m[0]) for (h, *_), m in zip(rows, measured)]
        else:
            world = dataclasses.replace(world, notes=world.notes + (
                "host names disagree with the launcher's local ranks: kept rank // local_size",))
    node_of = [row[3] for row in rows]
    local_groups: dict[int, list[int]] = {}
    for r, n in enumerate(node_of):
        local_groups.setdefault(n, []).append(r)
    for r, (_, lrank, lsize, node) in enumerate(rows):
        members = local_groups[node]
        if len(members) != lsize or members.index(r) != lrank:
            raise ConfigError(
                f"the launcher's node layout is inconsistent: rank {r} says it is local rank "
                f"{lrank} of {lsize} on node {node}, but the ranks on node {node} are {members}; "
                f"check the launcher's LOCAL_* and node variables")
    cross_groups: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        cross_groups.setdefault(row[1], []).append(r)
    return (world, [local_groups[n] for n in sorted(local_groups)],
            [cross_groups[lr] for lr in sorted(cross_groups)])
