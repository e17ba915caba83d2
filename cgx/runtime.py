"""The global state of a cgx job: who we are, the config, and the transports.

``cgx.init()`` discovers the world from the launcher (:mod:`cgx.launch.world`),
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
  address the others reach it at (:func:`cgx.launch.addresses.advertised_address`:
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
import os
import sys
import threading
from typing import TYPE_CHECKING, Optional, Union

from cgx import console
from cgx.comm import factory
from cgx.config import Config, TransportKind
from cgx.errors import CGXError, ConfigError, NotInitializedError
from cgx.launch import exit_record
from cgx.launch.rendezvous import exit_failing
from cgx.launch.layout import adopt_group, layout_row, node_layout
from cgx.launch.world import Launcher, WorldInfo, discover

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
        ConfigError: a layer rules file (``config.layer_config``,
            ``CGX_COMPRESSION_CONFIG``) that is missing or not valid; inconsistent
            launcher variables, or a transport/backend/
            device combination that cannot work (the message says what to change).
        MissingDependencyError: the chosen engine is not installed.
        CGXError: rank 0's address could not be found or published in time.

    Example:
        >>> import cgx
        >>> cgx.init()                     # 1 rank when not launched by a launcher
        >>> cgx.size()
        1
    """
    global _state, _inits
    with _lock:
        if _state is not None:
            _check_same(_state, config, transport, device)
            return
        config = _config_arg(config)
        kind, given = _resolve_transport_arg(transport, config)
        world, kind, conn, local, cross = _join(config, kind, given, device)  # 1-4.
        log = lambda msg: _log(config, world, msg)  # noqa: E731
        _state = _State(world=world, config=config, kind=kind, transport=conn.transport,
                        local=local, cross=cross, owns_process_group=conn.owns_process_group,
                        board=factory.make_board(world, conn, _inits, log))
        _inits += 1
        _record_exits()                                                      # 5. for cgxrun
        _log(config, world, f"initialized: rank {world.rank}/{world.size} (local "
                            f"{world.local_rank}/{world.local_size}, node {world.cross_rank}/"
                            f"{world.cross_size}), launcher {world.launcher.value}, "
                            f"transport {conn.transport.name} on {conn.transport.device}"
                            + "".join(f"; {n}" for n in world.notes))


def _config_arg(config: Optional[Config]) -> Config:
    """``init``'s ``config`` argument (default ``Config.from_env()``)."""
    if config is None:
        config = Config.from_env()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a cgx.Config, got {type(config).__name__}")
    if config.layer_config is not None:  # a missing or bad rules file fails at start
        from cgx.rules import parse_rules
        parse_rules(config.layer_config)
    return config


ELASTIC_TRIES = 5  # worlds an elastic rank tries to connect in before it gives up


def _join(config: Config, kind: TransportKind, given, device):
    """(world, engine, Connection, local, cross). In an elastic job, a world whose groups
    cannot form or agree (a rank lost meanwhile) is left for the next one,
    ``ELASTIC_TRIES`` times at most."""
    for attempt in range(1, ELASTIC_TRIES + 1):
        world, store = _discover()                                          # 1. who
        try:
            kind_used, conn = _connect(world, config, kind, given, device, store)  # 2.
        except RuntimeError as e:
            if store is None or attempt == ELASTIC_TRIES:
                raise
            _next_world(world, e)
            continue
        try:
            world, local, cross = _settle(world, conn, config)              # 3-4.
            return world, kind_used, conn, local, cross
        except BaseException as e:
            if given is None:  # a transport the caller made stays the caller's
                factory.close(conn.transport, conn.owns_process_group)
            lost = isinstance(e, RuntimeError) and not isinstance(e, CGXError)
            if store is None or attempt == ELASTIC_TRIES or not lost:
                raise
            _next_world(world, e)
    raise AssertionError("unreachable")


def _settle(world: WorldInfo, conn, config: Config):
    """(world, local, cross): the node layout (3), and the same settings everywhere (4;
    ``CGX_CHECK_CONSISTENCY`` adds more)."""
    world, local, cross = _layout(world, conn.transport)
    if world.size > 1:
        from cgx.comm.consistency import agree_config
        agree_config(conn.transport, config)
    return world, local, cross


def _next_world(world: WorldInfo, e: BaseException) -> None:
    print(f"[cgx] elastic: the world of {world.size} did not form ({e}); joining the "
          f"next one", file=sys.stderr, flush=True)


def _discover() -> tuple[WorldInfo, object]:
    """(this rank's world, the store to connect on): the launcher's world, or in an
    elastic job (cgxrun --min-np) the next world of its rendezvous and that world's store."""
    from cgx.launch.membership import membership
    member = membership()
    if member is None:
        return discover(), None
    joined = member.join()
    return joined.world, joined.store


def _connect(world: WorldInfo, config: Config, kind: TransportKind, given, device,
             store=None):
    """(engine, Connection): the caller's transport, or one made by the chosen engine
    (``store``: an elastic world's own, which only torch.distributed can use)."""
    if given is not None:
        return kind, factory.Connection(given)
    explicit = kind is not TransportKind.AUTO
    if store is not None and explicit and kind is not TransportKind.TORCH:
        raise ConfigError(f"an elastic job (cgxrun --min-np/--max-np) connects through "
                          f"torch.distributed; unset CGX_TRANSPORT={kind.value} (or set torch)")
    if not explicit:
        kind = factory.auto_kind(world, config, lambda msg: _log(config, world, msg))
    if kind is TransportKind.TORCH:
        return kind, factory.connect_torch(world, config, device, explicit, _inits, store)
    if kind is TransportKind.MPI:
        return kind, factory.connect_mpi(world, device)
    return kind, factory.connect_horovod(device)


def _layout(world: WorldInfo, tr: "Transport"):
    """(world with its node layout, local transport, cross-node transport)."""
    world, adopted = adopt_group(world, tr.rank, tr.size)
    if world.size == 1:
        local_groups = cross_groups = [[0]]
    else:
        rows = tr.allgather_object(layout_row(world))
        world, local_groups, cross_groups = node_layout(world, rows, adopted)
    local, cross = factory.sub_transports(tr, local_groups, cross_groups)
    return world, local, cross


def _record_exits() -> None:
    """Once per process: shut down at exit and, under cgxrun, note when this rank exits."""
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_at_exit)
        _atexit_registered = True
        if os.environ.get(exit_record.EXIT_RECORD_VAR):
            exit_record.note_exit_status()


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
        for sub in (st.cross, st.local):
            if sub is not st.transport:
                try:
                    sub.close()
                except Exception:  # noqa: BLE001 - shutdown goes on; the world is closed next
                    pass
        factory.close(st.transport, st.owns_process_group)


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
        exit_record.write_atexit(st.world.rank)  # under cgxrun: when this rank began to exit
        under_mpi = st.world.launcher in (Launcher.OPEN_MPI, Launcher.MPICH) or \
            st.transport.name == "mpi"
        if under_mpi and exit_failing():
            _state = None
        else:
            shutdown()


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _state is not None


console.set_rank_source(lambda: _state.world.rank if _state is not None else None)


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
    """The full :class:`~cgx.launch.world.WorldInfo` (with the measured node layout)."""
    return _get("world").world


def config() -> Config:
    """The :class:`~cgx.config.Config` the job runs with."""
    return _get("config").config


def config_in_use() -> Config:
    """:func:`config` once the job has started, the environment's before."""
    return config() if is_initialized() else Config.from_env()


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
