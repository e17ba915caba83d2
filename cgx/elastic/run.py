"""``hvd.elastic.run``: run a training function until it returns, across changes of world.

The loop (Horovod's semantics)::

    sync the state from the senior rank
    call func(state)
      a collective failed (a rank died)  -> state.restore(): back to the last commit
      HostsUpdatedInterrupt (ranks wait) -> nothing to undo (the commit just saved)
    reset: leave the world, join the next one (cgx.elastic.membership), then the
    state's reset callbacks; and again from the top

A failure is a :class:`~cgx.errors.CGXError` from a collective. Errors that say the
program itself is wrong (ranks disagree on a collective, cgx not initialized) are not
failures of a machine and are raised, as is any error outside an elastic job
(``cgxrun --min-np/--max-np``), where there is no next world to join.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Callable

from cgx.elastic.membership import membership
from cgx.elastic.state import HostsUpdatedInterrupt
from cgx.errors import CGXError, CollectiveMismatchError, NotInitializedError


class ResetLimitError(CGXError):
    """The job changed world more often than ``cgxrun --reset-limit`` allows."""


def is_failure(exc: BaseException) -> bool:
    """Did a collective fail (a rank gone, a link broken), as opposed to a wrong program?"""
    return isinstance(exc, CGXError) and not isinstance(
        exc, (CollectiveMismatchError, NotInitializedError, ResetLimitError))


def run_fn(func: Callable, reset: Callable[[], None], rank: Callable[[], int],
           size: Callable[[], int]) -> Callable:
    """``func(state, ...)`` made elastic; ``reset`` leaves the world and joins the next."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        resets = 0
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                why = "ranks are waiting to join"
            except CGXError as e:
                if membership() is None or not is_failure(e):
                    raise
                state.restore()
                why = f"a collective failed ({_first_line(e)}); rolled back to commit " \
                      f"{state.commits}"
            resets += 1
            _reset(reset, state, resets, why, rank, size)

    return wrapper


def _reset(reset: Callable[[], None], state, resets: int, why: str, rank, size) -> None:
    limit = membership().spec.reset_limit
    if limit is not None and resets > limit:
        raise ResetLimitError(f"the world changed {resets} times, more than cgxrun's "
                              f"--reset-limit {limit}; the last change: {why}")
    start, old = time.perf_counter(), (rank(), size())
    reset()
    state.on_reset()
    print(f"[cgx rank {rank()}] elastic: {why}; rank {old[0]} of {old[1]} is now rank "
          f"{rank()} of {size()} (new world in {time.perf_counter() - start:.1f} s)",
          file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]
