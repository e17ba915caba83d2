"""The global state of a cgx job: who we are, the config, and the transports.

``cgx.init()`` discovers the world from the launcher (:mod:`cgx.launcher`),
reads the config (:mod:`cgx.config`) and connects the ranks through an existing
engine:

========================  ==================================================
transport                 engine
========================  ==================================================
``torch`` (default)       torch.distributed: Gloo on CPU, NCCL on
                          ``cuda:local_rank`` when CUDA is available and chosen
                          (``CGX_BACKEND``, or ``device=``). A process group the
                          user already initialized is reused (cgx's own
                          traffic runs on a separate group of the same ranks).
``mpi``                   mpi4py's ``COMM_WORLD`` (:class:`cgx.comm.mpi.MPITransport`)
``horovod``               Horovod's collectives; ``auto`` picks it under
                          ``horovodrun --gloo`` when ``horovod.torch`` imports.
                          (horovodrun's MPI mode looks like plain mpirun: set
                          ``CGX_TRANSPORT=horovod`` there.)
========================  ==================================================

Rank 0's address (where torch.distributed's store listens) is never
hard-coded:

* torchrun: its ``MASTER_ADDR``/``MASTER_PORT`` (and its agent's store).
* ``MASTER_ADDR``/``MASTER_PORT`` set by the user, any launcher: used as given.
* mpirun (Open MPI, MPICH): rank 0 opens the store on a free port, picks the
  address the others reach it at (:func:`cgx.launcher.advertised_address`:
  the interface named by ``GLOO_SOCKET_IFNAME``; ``127.0.0.1`` when the
  gathered host names show a single host; else the route to a peer host) and
  broadcasts both with mpi4py.
* horovodrun ``--gloo``: the same choice, published through horovodrun's HTTP
  key-value server (``PUT``/``GET /cgx/<key>``); the others poll until it is
  there (``CGX_START_TIMEOUT_S``).
* Slurm: the first node of the node list, a port derived from the job id.

With several nodes, ``init`` also splits the world transport into a
node-local one and a cross-node one (:func:`local_transport`,
:func:`cross_transport`), in the same order on every rank, for hierarchical
reduction. The node layout comes from the launcher; where the launcher did not
say (Open MPI, MPICH), it is measured from all ranks' host names.

Under an MPI launcher, cgx makes an uncaught exception abort the whole MPI job
(``mpi4py.run.set_abort_status``): otherwise Open MPI waits for the remaining
ranks, which are stuck in a collective with the dead one.

Example::

    import cgx
    cgx.init()
    print(cgx.rank(), cgx.size())
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional, Union

from cgx.config import Config, TorchBackend, TransportKind
from cgx.errors import CGXError, ConfigError, NotInitializedError
from cgx.launcher import Launcher, WorldInfo, discover
from cgx.rendezvous import exit_failing, install_mpi_abort_hook, make_store

if TYPE_CHECKING:  # torch is imported by init(), not by importing this module
    import torch

    from cgx.comm.base import Transport


@dataclasses.dataclass
class _State:
    world: WorldInfo
    config: Config
    kind: TransportKind  # resolved engine; AUTO when the caller passed a Transport object
    transport: "Transport"
    local: "Transport"
    cross: "Transport"
    owns_process_group: bool  # cgx created torch.distributed's group: destroy it at shutdown
    board: object = None  # ProgressBoard on the rendezvous store (None: not available)


_lock = threading.RLock()
_state: Optional[_State] = None
_atexit_registered = False
_inits = 0  # completed init() calls: names each init's rendezvous key (same on all ranks)


# -- public API ---------------------------------------------------------------------

def init(config: Optional[Config] = None, *,
         transport: Union[None, str, TransportKind, "Transport"] = None,
         device: Union[None, str, "torch.device"] = None) -> None:
    """Join the job: discover the world and connect the ranks.

    Calling it again is a no-op (with arguments that disagree with the running
    state it raises instead); :func:`shutdown` runs at exit.

    Args:
        config: settings (default ``Config.from_env()``).
        transport: ``"auto"``, ``"torch"``, ``"mpi"``, ``"horovod"`` (a
            :class:`~cgx.config.TransportKind`), or a ready
            :class:`~cgx.comm.base.Transport` to use as the world transport.
            Default: ``config.transport`` (``CGX_TRANSPORT``).
        device: device of the tensors handed to the transport. Default:
            ``cuda:local_rank`` for NCCL, else ``cpu``.

    Raises:
        ConfigError: inconsistent launcher variables, or a transport/backend/
            device combination that cannot work (the message says what to change).
        MissingDependencyError: the chosen engine is not installed.
        CGXError: rank 0's address could not be found or published in time.

    Example:
        >>> import cgx
        >>> cgx.init()                     # 1 rank when not launched by a launcher
        >>> cgx.size()
        1
    """
    global _state, _atexit_registered, _inits
    with _lock:
        if _state is not None:
            _check_same(_state, config, transport, device)
            return
        if config is None:
            config = Config.from_env()
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a cgx.Config, got {type(config).__name__}")
        kind, given = _resolve_transport_arg(transport, config)
        world = discover()
        owns = False
        if given is not None:
            tr = given
        else:
            explicit = kind is not TransportKind.AUTO
            if not explicit:
                kind = _auto_kind(world, config)
            if kind is TransportKind.TORCH:
                tr, owns = _make_torch(world, config, device, explicit)
            elif kind is TransportKind.MPI:
                tr = _make_mpi(world, device)
            else:
                tr = _make_horovod(device)
        try:
            world, adopted = _world_for(world, tr)
            world, local_groups, cross_groups = _layout(world, tr, adopted)
            if world.size > 1:  # unconditional: CGX_CHECK_CONSISTENCY itself must match
                from cgx.comm.consistency import agree_config
                agree_config(tr, config)
            local, cross = _sub_transports(tr, local_groups, cross_groups)
        except BaseException:
            if given is None:  # a transport the caller made stays the caller's
                _close(tr, owns)
            raise
        _state = _State(world=world, config=config, kind=kind, transport=tr, local=local,
                        cross=cross, owns_process_group=owns,
                        board=_make_board(world, tr, config))
        _inits += 1
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
            if os.environ.get(EXIT_RECORD_VAR):
                _note_exit_status()
        _log(config, world, f"initialized: rank {world.rank}/{world.size} (local "
                            f"{world.local_rank}/{world.local_size}, node {world.cross_rank}/"
                            f"{world.cross_size}), launcher {world.launcher.value}, "
                            f"transport {tr.name} on {tr.device}"
                            + "".join(f"; {n}" for n in world.notes))


def shutdown() -> None:
    """Leave the job: close the transports (and the process group cgx created).

    Safe to call several times, and when :func:`init` was never called. It
    also runs at interpreter exit, except under MPI launchers (see ``_at_exit``).
    """
    global _state
    with _lock:
        st, _state = _state, None
        if st is None:
            return
        _store_address[0] = None
        for sub in (st.cross, st.local):
            if sub is not st.transport:
                try:
                    sub.close()
                except Exception:  # noqa: BLE001 - shutdown goes on; the world is closed next
                    pass
        _close(st.transport, st.owns_process_group)


# cgxrun (--gloo) sets this: each rank notes here when it starts to exit, so that
# cgxrun can tell which failed rank went first (see cgx.run).
EXIT_RECORD_VAR = "CGXRUN_EXIT_DIR"
_exit_status = None  # what the program exits with, once known (sys.exit, uncaught error)


def _note_exit_status() -> None:
    """Under cgxrun: learn the exit status before the exit handlers run.

    A rank that calls ``sys.exit(3)`` closes its connections in its exit handler; a
    peer blocked in a collective with it then fails, and the launcher may stop this
    rank (SIGTERM) before it has finished exiting. cgxrun reports the first failure,
    and this makes it report 3, not the signal.
    """
    real_exit, previous_hook = sys.exit, sys.excepthook

    def exit_(status=None):
        global _exit_status
        _exit_status = status
        real_exit(status)

    def hook(exc_type, exc, tb):
        global _exit_status
        if _exit_status is None:
            _exit_status = 1
        previous_hook(exc_type, exc, tb)

    sys.exit, sys.excepthook = exit_, hook


def _status_code(status) -> int:
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def _at_exit() -> None:
    """Interpreter exit: note the time for cgxrun, then shut down.

    Under MPI launchers, when this rank exits because of a failure, only the
    state is dropped: closing the Gloo sockets here would wake peers blocked in
    a collective with this rank, and a peer that fails and calls ``MPI_Abort``
    before this rank does would make mpirun report the peer's exit code.
    MPI_Abort and the process end release everything. A normal exit shuts
    down cleanly everywhere: Gloo's worker threads must be joined before the
    interpreter finalizes, or a thread releasing a tensor then aborts the
    process ("terminate called without an active exception").
    """
    global _state
    with _lock:
        st = _state
        if st is None:
            return
        record_dir = os.environ.get(EXIT_RECORD_VAR)
        if record_dir:
            try:
                with open(os.path.join(record_dir, f"atexit.rank{st.world.rank}"), "w") as f:
                    f.write(str(time.time_ns()))
                    if _exit_status is not None:
                        f.write(f" {_status_code(_exit_status)}")
            except OSError:
                pass
        under_mpi = st.world.launcher in (Launcher.OPEN_MPI, Launcher.MPICH) or \
            st.transport.name == "mpi"
        if under_mpi and exit_failing():
            _state = None
        else:
            shutdown()


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _state is not None


def _get(what: str) -> _State:
    st = _state
    if st is None:
        raise NotInitializedError(f"cgx.{what}()")
    return st


def size() -> int:
    """Number of ranks in the job."""
    return _get("size").world.size


def rank() -> int:
    """This process's rank, 0..size()-1."""
    return _get("rank").world.rank


def local_rank() -> int:
    """This process's rank on its node."""
    return _get("local_rank").world.local_rank


def local_size() -> int:
    """Number of ranks on this node."""
    return _get("local_size").world.local_size


def cross_rank() -> int:
    """Index of this node, 0..cross_size()-1."""
    return _get("cross_rank").world.cross_rank


def cross_size() -> int:
    """Number of nodes."""
    return _get("cross_size").world.cross_size


def world() -> WorldInfo:
    """The full :class:`~cgx.launcher.WorldInfo` (with the measured node layout)."""
    return _get("world").world


def config() -> Config:
    """The :class:`~cgx.config.Config` the job runs with."""
    return _get("config").config


def transport() -> "Transport":
    """The transport over all ranks."""
    return _get("transport").transport


def local_transport() -> "Transport":
    """The transport over the ranks of this node (the world transport on one node)."""
    return _get("local_transport").local


def progress_board():
    """This job's :class:`~cgx.comm.progress.ProgressBoard`, or None where there is none
    (one rank, or a transport without a torch.distributed store)."""
    return _get("progress_board").board


def cross_transport() -> "Transport":
    """The transport over the ranks with this local rank, one per node
    (a 1-rank transport on one node)."""
    return _get("cross_transport").cross


# -- init helpers ------------------------------------------------------------------------

def _log(cfg: Config, world: WorldInfo, msg: str) -> None:
    if cfg.verbose:
        print(f"[cgx rank {world.rank}] {msg}", file=sys.stderr, flush=True)


def _resolve_transport_arg(transport, cfg: Config):
    """(kind, ready transport or None) from init's ``transport`` argument."""
    if transport is None:
        return cfg.transport, None
    if isinstance(transport, TransportKind):
        return transport, None
    if isinstance(transport, str):
        try:
            return TransportKind(transport.strip().lower()), None
        except ValueError:
            allowed = ", ".join(k.value for k in TransportKind)
            raise ValueError(f"transport={transport!r} is not valid; expected one of: {allowed}, "
                             f"or a cgx.comm.base.Transport") from None
    from cgx.comm.base import Transport
    if isinstance(transport, Transport):
        return TransportKind.AUTO, transport
    raise TypeError(f"transport must be a string, a cgx.TransportKind or a "
                    f"cgx.comm.base.Transport, got {type(transport).__name__}")


def _check_same(st: _State, config, transport, device) -> None:
    """A repeated init() is a no-op; one that asks for something else is an error."""
    problems = []
    if config is not None and config != st.config:
        problems.append("a different config")
    if transport is not None:
        kind, given = _resolve_transport_arg(transport, st.config)
        if given is not None and given is not st.transport:
            problems.append("a different transport object")
        elif given is None and kind not in (TransportKind.AUTO, st.kind):
            problems.append(f"transport={kind.value!r}")
    if device is not None:
        import torch
        if torch.device(device) != st.transport.device:
            problems.append(f"device={str(device)!r}")
    if problems:
        raise ValueError(f"cgx is already initialized (transport {st.kind.value} on "
                         f"{st.transport.device}); init() was called again with "
                         f"{', '.join(problems)}. Call cgx.shutdown() first to change it")


def _auto_kind(world: WorldInfo, cfg: Config) -> TransportKind:
    if world.launcher is Launcher.HOROVOD_GLOO:
        from cgx.comm.horovod import HorovodMissingError, import_horovod
        try:
            import_horovod()
            return TransportKind.HOROVOD
        except HorovodMissingError as e:
            _log(cfg, world, f"horovod.torch is not usable ({e}); using torch.distributed")
    return TransportKind.TORCH


def _local_cuda(world: WorldInfo) -> "torch.device":
    import torch
    n = torch.cuda.device_count()
    if n == 1:
        return torch.device("cuda", 0)  # e.g. CUDA_VISIBLE_DEVICES gives each rank its GPU
    if world.local_rank < n:
        return torch.device("cuda", world.local_rank)
    raise ConfigError(f"local rank {world.local_rank} has no GPU: {n} CUDA devices are visible "
                      f"for {world.local_size} ranks on this node; start at most {n} ranks per "
                      f"node, or use CGX_BACKEND=gloo for CPU tensors")


def _torch_device_backend(world: WorldInfo, cfg: Config, device) -> tuple["torch.device", str]:
    import torch
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:
                dev = _local_cuda(world)
            return dev, ("gloo" if cfg.backend is TorchBackend.GLOO else "nccl")
        if cfg.backend is TorchBackend.NCCL:
            raise ConfigError(f"CGX_BACKEND=nccl needs a CUDA device, but cgx.init() got "
                              f"device={str(device)!r}; pass a cuda device or use CGX_BACKEND=gloo")
        return dev, "gloo"
    if cfg.backend is TorchBackend.GLOO:
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        if cfg.backend is TorchBackend.NCCL:
            raise ConfigError("CGX_BACKEND=nccl needs CUDA, but torch.cuda.is_available() is "
                              "False here; use CGX_BACKEND=gloo (or auto)")
        return torch.device("cpu"), "gloo"
    return _local_cuda(world), "nccl"


def _make_torch(world: WorldInfo, cfg: Config, device,
                explicit: bool) -> tuple["Transport", bool]:
    """TorchTransport on the user's process group, or on one cgx creates.

    Returns (transport, whether cgx created the process group).
    """
    import torch
    import torch.distributed as dist

    from cgx.comm.torch_dist import TorchTransport

    if not dist.is_available():
        raise CGXError("this torch build has no torch.distributed; install a build with it, "
                       "or use CGX_TRANSPORT=mpi")
    if dist.is_initialized():
        # A bare "cuda" becomes this rank's GPU, as when cgx creates the group itself.
        dev = None if device is None else _torch_device_backend(world, cfg, device)[0]
        return TorchTransport(_own_group(cfg), dev, owns_group=True,
                              timeout_s=cfg.timeout_s), False
    if world.size == 1 and not explicit:
        # Nothing to connect: collectives are copies. (transport="torch" still
        # creates a 1-rank group, for code that wants torch.distributed up.)
        from cgx.comm.base import SingleProcessTransport
        dev, _ = _torch_device_backend(world, cfg, device)
        return SingleProcessTransport(dev), False
    dev, backend = _torch_device_backend(world, cfg, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if world.launcher is Launcher.TORCHRUN and world.master_addr is not None:
        # torchrun's env:// (its agent's store when TORCHELASTIC_USE_AGENT_STORE is set).
        dist.init_process_group(backend, init_method="env://", rank=world.rank,
                                world_size=world.size, timeout=timeout)
    else:
        store = make_store(world, cfg, _inits)
        _store_address[0] = (store.host, store.port) if hasattr(store, "port") else None
        dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                                timeout=timeout)
    try:
        return TorchTransport(_own_group(cfg), dev, owns_group=True,
                              timeout_s=cfg.timeout_s), True
    except BaseException:
        dist.destroy_process_group()
        raise


_store_address: list = [None]  # (host, port) of the store cgx made for the running job


def _make_board(world: WorldInfo, tr: "Transport", cfg: Config):
    """A progress board on the job's rendezvous store, when there is one (else None)."""
    if world.size == 1 or not tr.name.startswith("torch"):
        return None
    addr = _store_address[0]
    if addr is None and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if addr is None:
        return None
    from cgx.comm.progress import ProgressBoard
    scope = f"{_inits}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        return ProgressBoard(addr[0], addr[1], world.rank, world.size, scope)
    except Exception as e:  # noqa: BLE001 - the board only improves messages
        _log(cfg, world, f"no progress board ({e}); stalls will not name the missing ranks")
        return None


def _own_group(cfg: Config):
    """A process group for cgx's traffic alone, over the same ranks as the world.

    cgx reduces on a background thread; if it shared the default group with the
    user's own torch.distributed calls (DDP, a metric all_reduce), the two
    streams of collectives could interleave differently on different ranks and
    deadlock. A separate group keeps them apart. Every rank calls this once, in
    init(), so the group is created in the same order everywhere.
    """
    import torch.distributed as dist
    return dist.new_group(list(range(dist.get_world_size())),
                          timeout=datetime.timedelta(seconds=cfg.timeout_s))


def _make_mpi(world: WorldInfo, device) -> "Transport":
    from cgx.comm.mpi import MPITransport
    tr = MPITransport(None, "cpu" if device is None else device)
    if tr.size > 1 or world.size > 1:
        install_mpi_abort_hook()
    if world.size > 1 and tr.size != world.size:
        raise ConfigError(f"CGX_TRANSPORT=mpi needs ranks started by an MPI launcher (mpirun, "
                          f"cgxrun --mpi): {world.launcher.value} started {world.size} ranks "
                          f"but MPI sees {tr.size}; use CGX_TRANSPORT=torch with this launcher")
    return tr


def _make_horovod(device) -> "Transport":
    from cgx.comm.horovod import HorovodTransport
    if device is not None and str(device) != "cpu":
        raise ConfigError(f"cgx's Horovod transport moves CPU tensors; got device={str(device)!r}. "
                          f"Use CGX_TRANSPORT=torch for CUDA tensors (NCCL)")
    return HorovodTransport()


def _close(tr: "Transport", owns_process_group: bool) -> None:
    try:
        tr.close()
    finally:
        if owns_process_group:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


# -- node layout ---------------------------------------------------------------------------

def _world_for(world: WorldInfo, tr: "Transport") -> tuple[WorldInfo, bool]:
    """Check the transport's group against the launcher's world, or adopt the group.

    Returns (world, adopted): adopted when no known launcher started the ranks
    and the world comes from the transport's group.
    """
    if tr.size == world.size and tr.rank == world.rank:
        return world, False
    if world.launcher is Launcher.SINGLE:
        # A group the user made without a launcher we know: the group is the world;
        # _layout() measures the nodes from host names.
        return dataclasses.replace(
            world, rank=tr.rank, size=tr.size, local_rank=0, local_size=1, cross_rank=0,
            cross_size=1, cross_derived=True,
            notes=world.notes + ("world taken from the transport's group",)), True
    raise ConfigError(f"the transport's group has rank {tr.rank} of {tr.size}, but "
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


def _layout(world: WorldInfo, tr: "Transport", adopted: bool = False):
    """Agree on the node layout; return (world, local groups, cross groups).

    One allgather of every rank's (host, local rank, local size, node). Launcher
    values are kept when the launcher gave them; derived node indices (and, for
    an adopted group, everything) come from the host names.
    """
    if world.size == 1:
        return world, [[0]], [[0]]
    rows = tr.allgather_object((world.hostname, world.local_rank, world.local_size,
                                world.cross_rank))
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


def _sub_transports(tr: "Transport", local_groups, cross_groups):
    """(local, cross) transports; splits only when there are several nodes."""
    from cgx.comm.base import SingleProcessTransport
    if len(local_groups) == 1:
        return tr, SingleProcessTransport(tr.device)
    if all(len(g) == 1 for g in local_groups):
        return SingleProcessTransport(tr.device), tr
    # Same calls in the same order on every rank: local groups first, then cross.
    local = tr.split(local_groups)
    cross = tr.split(cross_groups)
    return local, cross
