"""Readiness negotiation: collectives that become ready in any order on each rank run in
one order that every rank agrees on (what Horovod's coordinator does).

The engine runs its submissions first-in first-out, which keeps ranks in step as long as
each rank submits in program order. A TensorFlow graph run by a ``tf.compat.v1``
session gives no such order: its executor starts independent ops in whatever order its
threads pick them, differently on each rank. Such collectives are announced here by name
(:meth:`Negotiator.ready`, from any thread, never blocking) instead. One engine task then
negotiates in rounds, each round one exchange of the names ready on every rank:

* the names ready on every rank run now, in the order in which the lowest rank announced
  them, on the engine thread;
* while any rank still has an announced name that another rank lacks, every rank goes on
  to the next round (after waiting up to a few milliseconds for new names of its own);
  all ranks see the same exchanged lists, so they all decide alike;
* when no announced name is left, the task ends on every rank; a rank that has new names
  by then submits the next task, which meets the other ranks' next task.

A name announced twice while the first is still waiting is refused, as in Horovod. A
rank whose program never makes a name ready leaves the others in their rounds: the
engine's stall warning and ``CGX_TIMEOUT_S`` name it as for any other collective.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from cgx.errors import CollectiveMismatchError

# Horovod's sentence for a name that is still in flight.
DUPLICATE_NAME = ("Requested to collective operation of a tensor with the same name as another "
                  "tensor that is currently being processed: {!r}. If you want to request "
                  "another tensor, use a different tensor name.")

FIRST_WAIT_S = 0.001  # wait between rounds that made no progress (Horovod's cycle: 1 ms) ...
LAST_WAIT_S = 0.02    # ... doubling up to this


class Negotiator:
    """Runs announced collectives on the engine in an order every rank of a group agrees on.

    Args:
        transport: called on the engine thread, returns the group's transport (its
            ``allgather_object`` carries the names).
        submit: queues a callable on the engine (``cgx.session.submit``).
    """

    __slots__ = ("_transport", "_submit", "_cv", "_pending", "_active")

    def __init__(self, transport: Callable[[], Any], submit: Callable[..., Any]):
        self._transport = transport
        self._submit = submit
        self._cv = threading.Condition()
        # name -> (run, done), in the order this rank announced them
        self._pending: dict = {}
        self._active = False  # a negotiation task is queued or running

    def ready(self, name: str, run: Callable[[], Any],
              done: Callable[[Any, Optional[BaseException]], None]) -> None:
        """Announce ``name``: ``run()`` (engine thread) executes it once every rank has
        announced it; ``done(result, error)`` receives the outcome, on the engine thread.

        Raises:
            ValueError: ``name`` is already waiting on this rank.
        """
        with self._cv:
            if name in self._pending:
                raise ValueError(DUPLICATE_NAME.format(name))
            self._pending[name] = (run, done)
            self._cv.notify_all()
            start, self._active = not self._active, True
        if start:
            self._start()

    def _start(self) -> None:
        try:
            self._submit(self._negotiate, label="negotiation")
        except BaseException as exc:  # the engine is gone: fail what waits, never hang
            with self._cv:
                waiting, self._pending, self._active = list(self._pending.values()), {}, False
            for _, done in waiting:
                done(None, exc)

    def _negotiate(self) -> None:
        """Engine thread: rounds until no rank has an announced name left (see above)."""
        try:
            self._rounds()
        except BaseException as exc:  # the ranks are out of step: fail every waiting op
            with self._cv:
                waiting, self._pending, self._active = list(self._pending.values()), {}, False
            for _, done in waiting:
                done(None, exc)
            raise
        with self._cv:
            self._active = bool(self._pending)
            again = self._active
        if again:
            self._start()

    def _rounds(self) -> None:
        wait = FIRST_WAIT_S
        while True:
            with self._cv:
                mine = list(self._pending)
            lists = self._transport().allgather_object(mine)
            every = set(lists[0]).intersection(*lists[1:])
            agreed = [n for n in lists[0] if n in every]  # the lowest rank's order
            for name in agreed:
                self._run(name)
            if not any(set(ls) - every for ls in lists):
                break
            if agreed:
                wait = FIRST_WAIT_S
                continue
            with self._cv:  # nothing in common yet: give this rank's executor a moment
                self._cv.wait_for(lambda: len(self._pending) > len(mine), timeout=wait)
            wait = min(2 * wait, LAST_WAIT_S)

    def _run(self, name: str) -> None:
        with self._cv:
            run, done = self._pending.pop(name)
        try:
            result, error = run(), None
        except BaseException as exc:  # delivered to the op that waits for it
            result, error = None, exc
        done(result, error)
        if error is not None and not _recoverable(error):
            raise error  # the engine fails for good, as for any broken collective


def _recoverable(exc: BaseException) -> bool:
    """The engine's rule: errors found before any byte moved, or agreed by every rank."""
    if isinstance(exc, CollectiveMismatchError):
        return exc.recoverable
    return isinstance(exc, (ValueError, TypeError))
