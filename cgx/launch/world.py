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
layout measured from all ranks' host names when that differs
(:mod:`cgx.launch.layout`). The address other hosts reach this one at is found
by :mod:`cgx.launch.addresses`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import socket
from typing import Mapping, Optional, Sequence

from cgx.errors import ConfigError


class Launcher(enum.Enum):
    """The launcher whose environment :func:`discover` recognized."""

    HOROVOD_GLOO = "horovod_gloo"  # horovodrun --gloo (HTTP key-value rendezvous)
    TORCHRUN = "torchrun"  # torchrun / python -m torch.distributed.run
    OPEN_MPI = "open_mpi"  # Open MPI mpirun, also horovodrun's MPI mode
    MPICH = "mpich"  # MPICH / Intel MPI Hydra (mpiexec)
    SLURM = "slurm"  # srun without an MPI launcher in between
    SINGLE = "single"  # no launcher: a world of one process
    ELASTIC = "elastic"  # cgxrun --min-np/--max-np: each world from cgx.elastic's rendezvous


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


def horovod_env(world: WorldInfo) -> dict[str, str]:
    """horovodrun's worker variables for ``world`` (what :func:`discover` reads back)."""
    n = _HOROVOD
    return {n.hostname: world.hostname, n.rank: str(world.rank), n.size: str(world.size),
            n.local_rank: str(world.local_rank), n.local_size: str(world.local_size),
            n.cross[0]: str(world.cross_rank), n.cross[1]: str(world.cross_size)}


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
