"""``hvd.elastic.run``: run a training function until it returns, across changes of world.

The loop (Horovod's semantics)::

    sync the state from the senior rank
    call func(state)
      a collective failed (a rank died)  -> state.restore(): back to the last commit
      HostsUpdatedInterrupt (ranks wait) -> nothing to undo (the commit just saved)
    reset: leave the world, join the next one (cgx.launch.membership), then the
    state's reset callbacks; and again from the top

A failure is a :class:`~cgx.errors.CommunicationError`: a collective that failed or did
not finish. Every other error (a wrong program, ranks that disagree on a collective) is
raised, as is any error outside an elastic job (``cgxrun --min-np/--max-np``), where
there is no next world to join. When the function returns, the job's rendezvous is
closed: a rank still waiting to join is told the job is over.

``cgxrun --reset-limit N`` counts the rendezvous' rounds, which every rank of a world
sees alike (a rank that joined late included): the world that would be round N+1 stops.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Callable

from cgx.launch.membership import membership
from cgx.elastic.state import HostsUpdatedInterrupt
from cgx.errors import CGXError, CommunicationError

RESET_TRIES = 5  # attempts at forming the next world when ranks keep failing meanwhile


class ResetLimitError(CGXError):
    """The job changed world more often than ``cgxrun --reset-limit`` allows."""


def is_failure(exc: BaseException) -> bool:
    """Did a collective fail (a rank gone, a link broken), as opposed to a wrong program?"""
    return isinstance(exc, CommunicationError)


def run_fn(func: Callable, reset: Callable[[], None], rank: Callable[[], int],
           size: Callable[[], int]) -> Callable:
    """``func(state, ...)`` made elastic; ``reset`` leaves the world and joins the next."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        while True:
            _check_limit("")
            try:
                state.sync()
                out = func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                why = "ranks are waiting to join"
            except CGXError as e:
                if membership() is None or not is_failure(e):
                    raise
                state.restore()
                why = f"a collective failed ({_first_line(e)}); rolled back to commit " \
                      f"{state.commits}"
            else:
                if membership() is not None:
                    membership().close()
                return out
            _reset(reset, state, why, rank, size)

    return wrapper


def _check_limit(why: str) -> None:
    member = membership()
    limit = None if member is None else member.spec.reset_limit
    if limit is not None and member.round > limit:
        raise ResetLimitError(f"the world changed {member.round} times, more than cgxrun's "
                              f"--reset-limit {limit}" + (f"; the last change: {why}"
                                                          if why else ""))


def _reset(reset: Callable[[], None], state, why: str, rank, size) -> None:
    start, old = time.perf_counter(), (rank(), size())
    for attempt in range(1, RESET_TRIES + 1):
        try:
            reset()
            break
        except RuntimeError as e:  # a rank lost while the world formed: form it again
            if attempt == RESET_TRIES or (isinstance(e, CGXError) and not is_failure(e)):
                raise
            print(f"[cgx] elastic: forming the next world failed ({_first_line(e)}); "
                  f"trying again", file=sys.stderr, flush=True)
    _check_limit(why)
    state.on_reset()
    print(f"[cgx rank {rank()}] elastic: {why}; rank {old[0]} of {old[1]} is now rank "
          f"{rank()} of {size()} (new world in {time.perf_counter() - start:.1f} s)",
          file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
