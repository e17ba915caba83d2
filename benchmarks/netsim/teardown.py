"""Teardown that survives the end of the process: atexit, SIGINT and SIGTERM.

:class:`TeardownHooks` runs a network's quiet close at interpreter exit and on
SIGINT/SIGTERM, then hands the signal to the handler that was there before
(Python's SIGINT handler raises KeyboardInterrupt; the default one ends the
process). :func:`signals_held` keeps a second Ctrl-C from interrupting a
half-done teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from typing import Any, Callable, Iterator

TEARDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM (on the main thread) until the block is done; they arrive right after."""
    on_main = threading.current_thread() is threading.main_thread()
    if on_main:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, TEARDOWN_SIGNALS)
    try:
        yield
    finally:
        if on_main:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class TeardownHooks:
    """Calls ``close_quietly`` at exit and on SIGINT/SIGTERM while installed.

    ``close_quietly`` must not raise and should :meth:`uninstall` these hooks
    (the signal handler reads the previous handler first, then calls it).
    """

    def __init__(self, close_quietly: Callable[[], None]):
        self._close_quietly = close_quietly
        self._prev_handlers: dict[int, Any] = {}

    def install(self) -> None:
        atexit.register(self._close_quietly)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in TEARDOWN_SIGNALS:
            self._prev_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        atexit.unregister(self._close_quietly)
        for sig, prev in self._prev_handlers.items():
            if signal.getsignal(sig) == self._on_signal:  # do not clobber a later owner's handler
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        prev = self._prev_handlers.get(signum, signal.SIG_DFL)
        self._close_quietly()  # also restores the previous handlers
        if callable(prev):
            prev(signum, frame)  # e.g. Python's SIGINT handler raises KeyboardInterrupt
        elif prev != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
