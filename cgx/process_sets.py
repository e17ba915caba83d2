"""Process sets: collectives over a subset of the ranks (Horovod's ``hvd.ProcessSet``).

Example (every rank runs the same lines)::

    even = hvd.add_process_set([0, 2])          # or hvd.init(process_sets=[ProcessSet([0, 2])])
    if even.included():
        hvd.allreduce(t, process_set=even)      # averaged over ranks 0 and 2
    hvd.remove_process_set(even)

Semantics follow Horovod 0.28.1:

* A set is registered by every rank, in the same order (``init(process_sets=...)`` or
  ``add_process_set``); cgx checks that all ranks passed the same ranks and raises
  ``CollectiveMismatchError`` on every rank if not. Unlike Horovod, no
  ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` is needed to add sets after ``init()``.
* Ranks are global ranks: ``root_rank`` of a broadcast is ``hvd.rank()`` of the root,
  not its rank in the set; ``allgather`` concatenates in the order of the set's ranks.
* A collective on a set this rank is not part of raises ``ValueError`` at once.
* Each set gets its own sub-transport (``Transport.split``: a torch.distributed group, an
  MPI communicator, or a Horovod process set); its collectives run on the shared engine
  thread, in submission order, like every other collective.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Iterable, Optional, Sequence, Union

from cgx import runtime
from cgx.comm.consistency import agree, signature

_lock = threading.Lock()


def _is_iterable(x) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return not isinstance(x, (str, bytes))


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Build it from a list of global ranks (or an mpi4py communicator), then pass it to
    ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set``; ``process_set_id`` is
    set once it is registered, None before and after removal.
    """

    process_set_id: Optional[int] = None
    ranks: Optional[list] = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Union[Sequence[int], "object"]):
        if _is_iterable(ranks_or_comm):
            ranks = sorted(ranks_or_comm)
            if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of process ranks "
                                 "or an mpi4py Comm object")
            self.ranks = ranks
        else:
            try:
                from mpi4py import MPI
            except ImportError:  # pragma: no cover - mpi4py is a dependency
                MPI = None
            if MPI is None or not isinstance(ranks_or_comm, MPI.Comm):
                raise ValueError("ProcessSet should be initialized with a list of process ranks "
                                 "or an mpi4py Comm object")
            self.mpi_comm = ranks_or_comm

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None if it is not registered."""
        if self.process_set_id is None:
            return None
        return len(_entry(self).ranks)

    def rank(self) -> Optional[int]:
        """This rank's position in the set; None if not registered.

        Collectives still take global ranks (e.g. ``root_rank``); this one is for
        reading the result of ``allgather``.

        Raises:
            ValueError: this rank is not part of the set (as Horovod).
        """
        if self.process_set_id is None:
            return None
        ranks = _entry(self).ranks
        me = runtime.rank()
        if me not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this rank is in the set; None if its ranks are not known yet."""
        if self.ranks is None:
            return None
        return runtime.rank() in self.ranks

    def __str__(self) -> str:
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


@dataclasses.dataclass
class _Entry:
    ranks: list
    transport: object = None   # this rank's sub-transport (of the other ranks if not a member)
    member: bool = True
    reducer: object = None     # a Reducer over it (built by the session on first use)


_entries: dict = {}
_next_id = 1
_world = None  # the world transport the registered sets were split from


def _current() -> dict:
    """The registry of the current world (emptied when the world changes)."""
    global _world, _next_id
    tr = runtime.transport()  # raises NotInitializedError before init()
    if _world is not tr:
        for e in _entries.values():
            _close(e)
        _entries.clear()
        _next_id = 1
        _world = tr
        global_process_set.ranks = list(range(runtime.size()))
    return _entries


def _entry(ps: ProcessSet) -> _Entry:
    if ps.process_set_id == 0:
        with _lock:
            _current()
        return _Entry(list(range(runtime.size())))
    entry = _current().get(ps.process_set_id)
    if entry is None:
        raise ValueError(f"{ps} is not registered (it was removed, or the job was "
                         "re-initialized); add it again with hvd.add_process_set")
    return entry


def _close(entry: _Entry) -> None:
    if entry.reducer is not None:
        entry.reducer.close()
    if entry.transport is not None:
        entry.transport.close()
    entry.transport = entry.reducer = None


def _ranks_of(ps: ProcessSet) -> list:
    if ps.ranks is None and ps.mpi_comm is not None:
        from mpi4py import MPI
        # The communicator's members as ranks of MPI_COMM_WORLD (cgx's world under mpirun).
        group = ps.mpi_comm.Get_group()
        world = MPI.COMM_WORLD.Get_group()
        ps.ranks = sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())),
                                                    world))
    return ps.ranks


def checked(ps: Union[ProcessSet, Iterable[int]]) -> ProcessSet:
    """``ps`` (a ProcessSet, or its ranks) ready to register: its ranks known and valid
    (caller's thread; see :func:`cgx.session.add_process_set`).

    Raises:
        ValueError: ranks out of range or repeated.
        NotImplementedError: a set defined by an MPI communicator, added after ``init()``.
    """
    if not isinstance(ps, ProcessSet):
        ps = ProcessSet(ps)
    if ps.ranks is None and ps.mpi_comm is not None:
        raise NotImplementedError("Adding a process set defined by an MPI communicator after "
                                  "init() is not implemented; build it from a list of ranks")
    ranks = _ranks_of(ps)
    size = runtime.size()
    if not ranks or len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= size:
        raise ValueError(f"a process set needs distinct ranks in [0, {size}); got {ranks}")
    return ps


def add(ranks: list, world) -> Optional[int]:
    """Engine thread, every rank: agree on ``ranks`` (``CollectiveMismatchError`` on every
    rank if they differ), split ``world`` (the world's transport) and record the set.

    Returns:
        The new set's id; None if the world or a registered set has these ranks.
    """
    global _next_id
    size = runtime.size()
    if runtime.config().check_consistency and size > 1:
        agree(world, signature("add_process_set", "add_process_set", ranks=tuple(ranks)))
    with _lock:
        entries = _current()
        if ranks == list(range(size)) or any(e.ranks == ranks for e in entries.values()):
            return None
        others = [r for r in range(size) if r not in ranks]
        sub = world.split([ranks, others] if others else [ranks])
        # A non-member keeps its (unused) transport of the other ranks until the set is
        # removed: closing a torch.distributed group early desynchronizes the group
        # names of later splits across ranks.
        pid = _next_id
        _next_id += 1
        entries[pid] = _Entry(list(ranks), sub, member=runtime.rank() in ranks)
        return pid


def discard(process_set_id: int) -> bool:
    """Engine thread: forget the set with this id and close its transport and reducer;
    False if none is registered."""
    with _lock:
        entry = _current().pop(process_set_id, None)
    if entry is None:
        return False
    _close(entry)
    return True


def init_sets(process_sets, register: Callable[[ProcessSet], object]) -> None:
    """``hvd.init(process_sets=...)``: ``register`` each set in order
    (:func:`cgx.session.add_process_set`); a set equal to the world becomes the global
    set; duplicates in the list are invalidated (Horovod's rule). ``"dynamic"``
    (Horovod's switch for ``add_process_set``) needs nothing in cgx."""
    if process_sets is None or isinstance(process_sets, str):
        if isinstance(process_sets, str) and process_sets != "dynamic":
            raise ValueError(f"process_sets must be a list of ProcessSet or 'dynamic', "
                             f"got {process_sets!r}")
        return
    with _lock:
        _current()
    for ps in process_sets:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets must hold ProcessSet objects, got {ps!r}")
        ranks = _ranks_of(ps)
        if ranks == list(range(runtime.size())):
            ps.process_set_id = 0
            continue
        known = next((pid for pid, e in _entries.items() if e.ranks == ranks), None)
        if known is not None:
            ps._invalidate()
            continue
        register(ps)


def ranks_of_id(process_set_id: int) -> list:
    """The ranks of the registered set with this id (ValueError if there is none)."""
    with _lock:
        entry = _current().get(process_set_id)
    if entry is None:
        raise ValueError(f"no process set with id {process_set_id} is registered")
    return list(entry.ranks)


def resolve(process_set) -> Optional[_Entry]:
    """The registry entry of ``process_set`` for a collective on this rank; None for the
    global set (the world's reducer).

    Raises:
        ValueError: the set is not registered, or this rank is not part of it.
    """
    if process_set is None or process_set is global_process_set or \
            getattr(process_set, "process_set_id", None) == 0:
        return None
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a ProcessSet (from hvd.add_process_set), "
                         f"got {process_set!r}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered; pass it to hvd.init(process_sets=...) "
                         "or hvd.add_process_set first")
    with _lock:
        entry = _entry(process_set)
    if not entry.member:
        raise ValueError(f"rank {runtime.rank()} is not a part of {process_set}: only its ranks "
                         "may call collectives on it (check ps.included() first)")
    return entry


def global_rank_to_set_rank(entry: Optional[_Entry], root_rank: int) -> int:
    """A global ``root_rank`` as a rank of the set (ValueError if it is not a member)."""
    if entry is None:
        return root_rank
    if root_rank not in entry.ranks:
        raise ValueError(f"root_rank {root_rank} is not a part of the process set with ranks "
                         f"{entry.ranks}; pass the global rank of one of its members")
    return entry.ranks.index(root_rank)
