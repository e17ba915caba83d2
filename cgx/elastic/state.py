"""Horovod's elastic state: what a rank keeps in memory, commits, restores and syncs.

:class:`State` and :class:`ObjectState` are framework-free: they communicate through
:mod:`cgx.ops`' object collectives over the current world, which every adapter shares
(``cgx.torch.elastic`` and ``cgx.tensorflow.elastic`` re-export them and build their
framework's states on them).

* ``commit()`` saves a copy of the state in host memory, then checks whether ranks are
  waiting to join (every rank sees the same answer: any rank's); if so it raises
  :class:`HostsUpdatedInterrupt` on every rank at that commit.
* ``restore()`` puts back the last commit (after a failed collective).
* ``sync()`` makes every rank's state the *senior* rank's: the rank that has committed
  most often, the lowest such rank on a tie. At the start that is rank 0, as in Horovod;
  after a change of world it is always a rank that holds the last commit, never one
  that has just joined (torch's rendezvous orders ranks by host and process id, not by
  age).

Only ``commit()`` and ``sync()`` communicate. A rank that joins runs neither its
constructor's nor the reset callbacks' code at the same point as the others, so neither
may hold a collective (Horovod's rule too).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Callable, Iterable, Optional

from cgx import ops, runtime
from cgx.launch.membership import membership


def member_id() -> str:
    """This process, as the ranks of any world can name it: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class HostsUpdatedInterrupt(RuntimeError):
    """Ranks are waiting to join: every rank leaves the training function at the same
    commit and the job forms a new world with them (Horovod's exception of this name).

    ``skip_sync``: accepted for Horovod's signature; cgx always syncs after a change."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("ranks are waiting to join the job: forming a new world")
        self.skip_sync = skip_sync


class State:
    """Tracked state of one training function (Horovod's ``hvd.elastic.State``).

    Args (tests and other runtimes may replace the collectives; the defaults are
    :mod:`cgx.ops`' over the current world):
        bcast_object: ``fn(obj, root_rank) -> obj``.
        get_rank: this rank in the current world.
        allgather_object: ``fn(obj) -> list``.

    Attributes:
        commits: commits this rank holds (its seniority; equal on all ranks after a sync).
        dropped_owed: what the ranks lost so far owed at their last commit (:meth:`owed`:
            error feedback's residuals, sum of absolute values in gradient units), which
            no rank will send; rank 0 prints it when a rank is lost.
        lost_ranks: ranks lost so far.
    """

    def __init__(self, bcast_object: Optional[Callable] = None,
                 get_rank: Optional[Callable[[], int]] = None,
                 allgather_object: Optional[Callable] = None) -> None:
        self._bcast_object = bcast_object or _broadcast_object
        self._rank = get_rank or runtime.rank
        self._allgather_object = allgather_object or ops.allgather_object
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commits = 0
        self.owed_at_commit: dict = {}  # process -> owed(), gathered at the last commit
        self.dropped_owed = 0.0
        self.lost_ranks = 0

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions called after every change of world (e.g. to rescale the learning rate
        by the new ``size()``), in the order registered; no collectives in them."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state in host memory, then raise :class:`HostsUpdatedInterrupt` if
        ranks wait to join. Commits copy the state: commit every few steps, not every
        step, trading the copy against the steps a failure costs."""
        self.save()
        self.commits += 1
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt`, on every rank alike, if ranks wait to join
        (or the rendezvous moved on without this world: ``Membership.changed``).

        One gather carries every rank's answer (a rank dropped from the rendezvous sees it
        itself) and every rank's :meth:`owed`, kept as :attr:`owed_at_commit`: what a rank
        lost later owed when it was last seen."""
        member = membership()
        if member is None:
            return
        rows = self._allgather_object((member_id(), self.owed(), member.changed()))
        self.owed_at_commit = {m: owed for m, owed, _ in rows}
        if any(changed for _, _, changed in rows):
            raise HostsUpdatedInterrupt()

    def owed(self) -> float:
        """What this rank's compression still owes the others, as one number (0.0 here;
        ``TorchState`` sums its optimizers' error-feedback residuals)."""
        return 0.0

    def sync(self) -> None:
        """Make every rank's state the senior rank's (which then counts for all), and
        count what the ranks lost since the last commit owed."""
        rows = self._allgather_object((self.commits, member_id()))
        counts = [c for c, _ in rows]
        root = counts.index(max(counts))
        here = {m for _, m in rows}
        lost = [m for m in self.owed_at_commit if m not in here]
        dropped = sum(self.owed_at_commit[m] for m in lost)
        self.dropped_owed += dropped
        self.lost_ranks += len(lost)
        self.owed_at_commit = {}
        if lost and self._rank() == 0:
            print(f"[cgx rank 0] elastic: {len(lost)} rank(s) lost; the error-feedback "
                  f"residual they owed at the last commit is dropped (sum |r| = "
                  f"{dropped:.4g})", file=sys.stderr, flush=True)
        self.sync_from(root)
        self.commits = self._bcast_object(self.commits, root)
        self.save()  # what a failure before the next commit rolls back to: what was synced

    def sync_from(self, root: int) -> None:
        """Make every rank's state ``root``'s."""
        raise NotImplementedError

    def save(self) -> None:
        """Copy the state to host memory (no collectives)."""
        raise NotImplementedError

    def restore(self) -> None:
        """Put back the last committed state, undoing what came after it (no collectives:
        the world it belonged to may be gone)."""
        raise NotImplementedError


def _broadcast_object(obj, root: int):
    return ops.broadcast_object(obj, root_rank=root)


class ObjectState(State):
    """Plain Python values, each a keyword argument and then an attribute (Horovod's
    ``ObjectState``): ``state = ObjectState(epoch=0, batch=0); state.epoch += 1``."""

    def __init__(self, bcast_object: Optional[Callable] = None,
                 get_rank: Optional[Callable[[], int]] = None,
                 allgather_object: Optional[Callable] = None, **kwargs) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object, get_rank, allgather_object)

    def save(self) -> None:
        self._saved_state = {attr: getattr(self, attr) for attr in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync_from(self, root: int) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, root)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in self._saved_state.items():
            setattr(self, attr, value)
