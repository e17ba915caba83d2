"""The one reducer and engine every adapter (PyTorch, TensorFlow) shares.

Every collective of ``cgx.torch`` and ``cgx.tensorflow`` (synchronous or not, optimizer or
functional) runs on the reducer's engine thread, in submission order. A
synchronous call is a submission plus a wait; this keeps the order of
collectives identical on all ranks even while gradient buckets are in flight.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any, Callable, Optional

from cgx import process_sets as process_sets_
from cgx import runtime
from cgx.collectives import Reducer
from cgx.collectives.engine import Engine, Handle
from cgx.timeline import Timeline

_lock = threading.Lock()
_atexit_registered = False
_reducer: Optional[Reducer] = None
_owner: Any = None  # the transport the reducer was built for
_init_args: dict = {}  # the last init()'s arguments: an elastic job's next world uses them


def init(config=None, *, transport=None, device=None, comm=None, process_sets=None) -> None:
    """Join the job (every adapter's ``hvd.init()``); see :func:`cgx.runtime.init`.

    Args:
        process_sets: Horovod's: a list of :class:`cgx.process_sets.ProcessSet` to
            register (every rank passes the same list), or ``"dynamic"``.
        comm: Horovod's MPI communicator argument; accepted only as None or
            ``MPI.COMM_WORLD`` (cgx's world is the launcher's).
    """
    global _atexit_registered, _init_args
    if comm is not None:
        _check_comm(comm)
    runtime.init(config, transport=transport, device=device)
    _init_args = {"config": config, "device": device, "process_sets": process_sets}
    if not _atexit_registered:
        # Registered after the runtime's own exit handler, so it runs first
        # (atexit is last-in first-out): the engine stops before the transport.
        atexit.register(close)
        _atexit_registered = True
    process_sets_.init_sets(process_sets, add_process_set)


def reinit() -> None:
    """Leave this world and join the next with the last :func:`init`'s arguments (an
    elastic job's reset: the same config, device and process sets in every world)."""
    args = dict(_init_args)
    shutdown()
    init(**args)


def _check_comm(comm) -> None:
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover - mpi4py is a dependency
        MPI = None
    if isinstance(comm, (list, tuple)) and not comm:
        return
    if MPI is not None and isinstance(comm, MPI.Comm) and \
            MPI.Comm.Compare(comm, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
        return
    raise NotImplementedError(
        "hvd.init(comm=...) with a sub-communicator is not supported by cgx: start the job "
        "with the ranks you need, or create a process set (hvd.add_process_set) for them")


def add_process_set(process_set):
    """Register a process set on every rank; returns it (Horovod's ``hvd.add_process_set``).

    Every rank calls it with the same ranks, in the same order of registrations; unlike
    Horovod, no ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` is needed. See :mod:`cgx.process_sets`.

    Raises:
        ValueError: ranks out of range or repeated, or a set with these ranks exists.
        CollectiveMismatchError: ranks passed different sets (on every rank).
    """
    ps = process_sets_.checked(process_set)
    pid = run(lambda: process_sets_.add(ps.ranks, reducer().transport), label="add_process_set")
    if pid is None:
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    ps.process_set_id = pid
    return ps


def remove_process_set(process_set) -> bool:
    """Unregister a process set on every rank (Horovod's ``hvd.remove_process_set``).

    Returns False for the global set and for a set that is not registered.
    """
    pid = process_set.process_set_id
    if pid is None or pid == 0:
        return False
    process_set.process_set_id = None
    return run(lambda: process_sets_.discard(pid), label="remove_process_set")


def reducer_of(group) -> Reducer:
    """The Reducer of a resolved process set (:func:`cgx.process_sets.resolve`): the
    world's for None; a set's own is built on first use, over its sub-transport, with the
    world's configuration and timeline. Engine thread."""
    world = reducer()
    if group is None:
        return world
    if group.reducer is None:
        group.reducer = Reducer(group.transport, world.config, timeline=world.timeline)
    return group.reducer



def shutdown() -> None:
    """Stop the engine, write the timeline, close the transport."""
    close()
    runtime.shutdown()


def mpi_threads_supported() -> bool:
    """Horovod's query; cgx never hands MPI to the user's threads."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline to ``file_path`` (Horovod's ``hvd.start_timeline``).

    Each rank writes its own file (``.rank<r>`` before the extension for ranks > 0).
    ``mark_cycles`` is accepted for compatibility (cgx has no negotiation cycles).
    """
    if not isinstance(file_path, (str, os.PathLike)) or not str(file_path):
        raise ValueError(f"file_path must be a non-empty path, got {file_path!r}")
    reducer().timeline.start(os.fspath(file_path))


def stop_timeline() -> None:
    """Finish the timeline file (Horovod's ``hvd.stop_timeline``)."""
    reducer().timeline.close()


def stats():
    """Totals so far, as a consistent copy (a ``ReduceStats``): bytes sent, seconds per
    phase, optimizer steps, exposed communication, per-layer compression error.
    Safe to call from any thread while reductions run."""
    return reducer().snapshot()


def reducer() -> Reducer:
    """The reducer over the current world (created on first use after ``init()``)."""
    global _reducer, _owner
    tr = runtime.transport()  # raises NotInitializedError before init()
    with _lock:
        if _reducer is None or _owner is not tr:
            if _reducer is not None:
                _reducer.close()
            cfg = runtime.config()
            local = cross = None
            if runtime.cross_size() > 1 and runtime.local_size() > 1:
                local, cross = runtime.local_transport(), runtime.cross_transport()
            _reducer = Reducer(tr, cfg, local=local, cross=cross,
                               timeline=Timeline(cfg.timeline, runtime.rank()),
                               board=runtime.progress_board(), world_gone=_world_gone())
            _owner = tr
        return _reducer


def _world_gone():
    """An elastic job's probe of its world (None outside one): see Engine's world_gone."""
    from cgx.launch.membership import membership
    from cgx.launch.world import Launcher
    member = membership() if runtime.world().launcher is Launcher.ELASTIC else None
    return None if member is None else member.left


def engine() -> Engine:
    return reducer().engine()


def submit(fn: Callable[..., Any], *args, label: str = "", **kwargs) -> Handle:
    """Run ``fn(*args, **kwargs)`` on the engine thread, after everything submitted before."""
    return engine().submit(fn, args, kwargs, label=label)


def run(fn: Callable[..., Any], *args, label: str = "", **kwargs) -> Any:
    """Submit and wait (the synchronous form of every collective)."""
    return submit(fn, *args, label=label, **kwargs).wait(wait_timeout())


def wait_timeout() -> float:
    """How long a caller waits on a handle: the watchdog fails a stuck collective after
    ``CGX_TIMEOUT_S``; this backstop only matters if the watchdog itself is stuck."""
    return runtime.config().timeout_s + 30.0


def close() -> None:
    """Stop the engine and write the timeline (called by the adapters' ``shutdown()``).

    With ``CGX_VERBOSE=1``, each rank prints a one-screen summary of its communication.
    """
    global _reducer, _owner
    with _lock:
        red = _reducer
    if red is not None:
        engine = red.started_engine
        # Not under the lock: work still queued on the engine may ask for reducer().
        red.close()
        red.timeline.close()
        if red.config.verbose and (red.totals.calls or engine is not None):
            from cgx.stats import summary
            print(summary(red.snapshot(), red.transport.rank,
                          stalls=len(engine.stall_warnings) if engine else 0,
                          failed=engine.failed if engine else None),
                  file=sys.stderr, flush=True)
    with _lock:
        if _reducer is red:
            _reducer, _owner = None, None
