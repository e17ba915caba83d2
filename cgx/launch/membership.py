"""This process's membership of an elastic job, on torch.distributed.elastic's rendezvous.

Membership is torch's dynamic rendezvous (``DynamicRendezvousHandler`` on a
``C10dRendezvousBackend``), the one torchrun's agents use, here run by the ranks
themselves so that a failure or a new rank forms a new world *without restarting the
survivors*. Its state lives in the TCPStore that ``cgxrun``'s driver hosts (the
driver outlives every rank). Each round of the rendezvous is one world: its ranks,
its size, and a store of its own (a prefix of the driver's) on which
:func:`cgx.runtime.init` builds the process group.

* A rank that dies stops sending heartbeats; after ``KEEP_ALIVE_S * KEEP_ALIVE_MISSES``
  seconds the others' next rendezvous drops it, and the new round completes
  ``LAST_CALL_S`` after the last survivor joins (or at once with ``max_np`` ranks).
* A rank that starts later waits on the rendezvous' wait list; the ranks in the world
  see it at their next ``state.commit()`` (:meth:`Membership.changed`) and form a new
  world with it.
* A rank whose heartbeats were late (a stalled machine) may be dropped from its round
  while it still trains; :meth:`Membership.changed` also sees that the rendezvous has
  moved on without this world, and the world forms again.

:meth:`Membership.changed` reads the rendezvous state of torch's handler, which torch
does not document (``_state_holder``); torch is pinned, and where that attribute is
missing it falls back to the public count of waiting ranks.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
from typing import Any, Optional

from cgx.launch.elastic_env import ElasticEnv
from cgx.launch.world import Launcher, WorldInfo

KEEP_ALIVE_S = 0.25  # a rank's heartbeat period (torch writes one every 0.25-0.5 s)
KEEP_ALIVE_MISSES = 6  # periods without a heartbeat before a rank counts as dead (1.5 s)
LAST_CALL_S = 0.25  # how long a round that could complete waits for more ranks


@dataclasses.dataclass(frozen=True)
class Round:
    """One world of the job: this rank's place in it and the store it connects on."""

    world: WorldInfo
    store: Any  # torch.distributed.Store, private to this round


class Membership:
    """This process's node in the job's dynamic rendezvous (one per process)."""

    def __init__(self, spec: ElasticEnv) -> None:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend)
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler, RendezvousTimeout)

        # Rank 0 of each round would otherwise start a TCPStore server of its own for
        # torchrun's workers; cgx connects on the round's prefix of the driver's store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        self.spec = spec
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        self._store = dist.TCPStore(spec.addr, spec.port, is_master=False, timeout=timeout)
        backend = C10dRendezvousBackend(self._store, spec.run_id)
        self._handler = DynamicRendezvousHandler.from_backend(
            spec.run_id, self._store, backend, min_nodes=spec.min_np, max_nodes=spec.max_np,
            timeout=RendezvousTimeout(join=timeout,
                                      last_call=datetime.timedelta(seconds=LAST_CALL_S),
                                      close=datetime.timedelta(seconds=10)),
            keep_alive_interval=KEEP_ALIVE_S,  # type: ignore[arg-type] - seconds, a float
            keep_alive_max_attempt=KEEP_ALIVE_MISSES)
        # One of the job's first ranks: its first world waits for all of them (within the
        # join timeout), so that a rank that starts late is waited for, not formed around
        # and then joined at the next commit. torch's settings are one frozen object that
        # the handler, its executor and its state holder share; set back after that world.
        self._first = min(max(spec.first_np or 0, spec.min_np), spec.max_np)
        self._settings = self._handler._settings
        self._set_min_nodes(self._first)
        self.rounds = 0  # worlds this process has been part of
        self.round = 0  # the rendezvous round of this process's world (0: the first)
        self._members: set = set()  # the world's nodes in the rendezvous

    def join(self) -> Round:
        """Wait for the next world (``spec.timeout_s`` at most) and take a place in it.

        Raises:
            CGXError: no world of ``min_np`` ranks formed in time, or the job ended.
        """
        from torch.distributed.elastic.rendezvous.api import (RendezvousClosedError,
                                                              RendezvousError)

        from cgx.errors import CGXError, CommunicationError
        try:
            info = self._handler.next_rendezvous()
            for _ in range(5):  # a rank lost just as the round completed: torch's rendezvous
                if 0 <= info.rank < info.world_size and info.world_size >= self.spec.min_np:
                    break  # (then counts the world without it, on some ranks only)
                info = self._handler.next_rendezvous()
            else:
                raise CommunicationError(
                    f"the rendezvous gave rank {info.rank} of {info.world_size} five times "
                    f"(--min-np {self.spec.min_np}): ranks keep failing as worlds form")
        except RendezvousClosedError:
            print(f"[cgx] elastic: the job has finished; this rank has no world to join",
                  file=sys.stderr, flush=True)
            raise SystemExit(0) from None
        except RendezvousError as e:
            raise CGXError(
                f"no world of at least {self.spec.min_np} ranks formed within "
                f"{self.spec.timeout_s:g} s ({type(e).__name__}: {e}). A rank that joins waits "
                f"for the others' next commit: commit more often or raise cgxrun's "
                f"--start-timeout; a world short of ranks needs more slots or a lower "
                f"--min-np") from e
        self.rounds += 1
        self._set_min_nodes(self.spec.min_np)
        state = self._state()
        self.round = state.round if state is not None else self.rounds - 1
        self._members = set(state.participants) if state is not None else set()
        return Round(world=_world(info.rank, info.world_size, self.spec), store=info.store)

    def _set_min_nodes(self, n: int) -> None:
        if self._settings.min_nodes != n:
            object.__setattr__(self._settings, "min_nodes", n)

    def waiting(self) -> int:
        """Ranks waiting to join the next world (read from the store)."""
        return self._handler.num_nodes_waiting()

    def changed(self) -> bool:
        """Must this world form again: ranks wait to join, or the rendezvous has moved on
        to a round this process is not part of (read from the store)?"""
        if self.waiting():
            return True
        state = self._state()
        if state is None:
            return False
        return state.round != self.round or self._handler._this_node not in state.participants

    def left(self) -> Optional[str]:
        """Why this process's world cannot go on (None: it stands): a rank of it left the
        rendezvous (it failed a collective and is forming the next world, or it died and
        its heartbeats stopped). Read from the store; any thread."""
        try:
            self.waiting()  # syncs the state (under the handler's lock)
        except Exception:  # noqa: BLE001 - the driver's store gone: the job is ending
            return None
        state = self._state()
        if state is None:
            return None
        if state.round != self.round:
            return "the job's rendezvous has formed a new world without this one"
        gone = self._members - set(state.participants)
        if gone:
            return f"{len(gone)} rank(s) of this world left it (a rank failed or died)"
        return None

    def _state(self):
        """The handler's last synced rendezvous state (None where torch has no such field)."""
        holder = getattr(self._handler, "_state_holder", None)
        return getattr(holder, "state", None)

    def close(self) -> None:
        """The job is over: no more worlds (ranks still waiting are told so)."""
        try:
            self._handler.shutdown()
        except Exception:  # noqa: BLE001 - the driver's store may be gone already
            pass


_membership: Optional[Membership] = None


def membership() -> Optional[Membership]:
    """This process's membership, made on first use; None outside an elastic job."""
    global _membership
    if _membership is None:
        spec = ElasticEnv.from_env()
        if spec is None:
            return None
        _membership = Membership(spec)
    return _membership


def _world(rank: int, size: int, spec: ElasticEnv) -> WorldInfo:
    # The node layout is measured from the ranks' host names at init (cross_derived).
    return WorldInfo(rank=rank, size=size, local_rank=rank, local_size=size, cross_rank=0,
                     cross_size=1, hostname=socket.gethostname(), launcher=Launcher.ELASTIC,
                     cross_derived=True,
                     notes=(f"elastic world of {size} (cgxrun --min-np {spec.min_np} "
                            f"--max-np {spec.max_np})",))
