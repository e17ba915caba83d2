"""Background execution of collectives, in submission order, with a watchdog.

Adapters start a bucket's reduction while backward is still running
(wait-free backpropagation) by submitting it here; one worker thread runs
the submissions strictly first-in first-out. So as long as every rank
submits in the same order, every rank issues the same collectives in the
same order, which torch.distributed, MPI and Horovod all require.

The compression kernels release the GIL (C via ctypes, torch ops, Triton
launches), so the worker overlaps with the training thread.

Failures. A submission that raises ``ValueError``/``TypeError`` (bad
arguments, found before any byte moves) or a
:class:`~cgx.errors.CollectiveMismatchError` (every rank found the same
mismatch) fails only its own handle. Any other error means the ranks'
sequences of collectives may have diverged: the engine is then *failed for
good*: the queued submissions and every later one fail at once with the
first error, instead of hanging on a half-finished exchange.

The watchdog thread posts this rank's progress to a
:class:`~cgx.comm.progress.ProgressBoard` (when the transport has one),
warns after ``stall_warning_s`` while a collective waits, naming the ranks
that have not submitted it, and fails the engine after ``timeout_s``.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
from typing import Any, Callable, Optional

import torch

from cgx.comm.progress import HEARTBEAT_S, STALE_S, describe_missing
from cgx.errors import CGXError, CollectiveMismatchError, CommunicationError

JOIN_FAILED_S = 5.0  # at shutdown, how long to wait for a worker stuck in a dead collective


class Handle:
    """Result of an asynchronous submission: ``poll()``, ``wait()``."""

    __slots__ = ("_event", "_result", "_error", "name", "_engine")

    def __init__(self, name: str = "", engine: Optional["Engine"] = None):
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.name = name
        self._engine = engine

    def poll(self) -> bool:
        """True when done (successfully or not); never blocks."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done and return the result, or raise what the work raised.

        The engine's watchdog fails a stuck collective after ``timeout_s``; the
        ``timeout`` here is a backstop for engines without one.

        Raises:
            CGXError: when ``timeout`` seconds pass first (the engine is then failed).
        """
        if not self._event.wait(timeout):
            err = CommunicationError(f"collective '{self.name}' did not finish within {timeout} s; a rank "
                           "may have died or issued different collectives (raise CGX_TIMEOUT_S "
                           "if the job is just slow)")
            if self._engine is not None:
                self._engine._fail(err)
            raise err
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> bool:
        """Complete the handle once; False if it was already complete."""
        if self._event.is_set():
            return False
        self._result, self._error = result, error
        self._event.set()
        return True


class CompletedHandle(Handle):
    def __init__(self, result: Any = None, name: str = ""):
        super().__init__(name)
        self._finish(result)


def _is_clean(exc: BaseException) -> bool:
    """Errors raised before any communication, or agreed by every rank: the job can go on."""
    if isinstance(exc, CollectiveMismatchError):
        return exc.recoverable
    return isinstance(exc, (ValueError, TypeError))


WORLD_CHECK_S = 1.0  # a submission running this long asks whether its world still stands


class Engine:
    """One worker thread running submitted callables FIFO, and its watchdog.

    Args:
        device: CUDA device the worker makes current (None for CPU work).
        board: where this rank posts its progress (None: no board).
        stall_warning_s: warn while one submission runs this long (0: never).
        timeout_s: fail the engine when one submission runs this long (None: never).
        rank: this rank, for messages.
        timeline: records queue and run times per submission (optional).
        world_gone: ``fn() -> reason or None``: asked while a submission has run
            ``WORLD_CHECK_S``; a reason fails the engine at once (an elastic world that
            ranks have left, so the collective can only wait for Gloo's timeout).
    """

    def __init__(self, device: Optional[torch.device] = None, *, board=None,
                 stall_warning_s: float = 0.0, timeout_s: Optional[float] = None,
                 rank: int = 0, timeline=None, world_gone=None):
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._device = device
        self._failed: Optional[BaseException] = None
        self._board = board
        self._world_gone = world_gone
        self._stall_s = float(stall_warning_s)
        self._timeout_s = timeout_s
        self._rank = rank
        self._timeline = timeline
        self._lock = threading.Lock()
        self._submitted = 0
        self._last_label = ""
        # (seq, label, handle, start time) of the submission running now.
        self._current: Optional[tuple[int, str, Handle, float]] = None
        self._pending: "collections.deque[Handle]" = collections.deque()
        self._stop = threading.Event()
        self.stall_warnings: list[str] = []  # what the watchdog printed (tests, summaries)
        self._thread = threading.Thread(target=self._loop, name="cgx-engine", daemon=True)
        self._thread.start()
        self._watchdog: Optional[threading.Thread] = None
        if board is not None or stall_warning_s or timeout_s or world_gone is not None:
            self._watchdog = threading.Thread(target=self._watch, name="cgx-watchdog",
                                              daemon=True)
            self._watchdog.start()

    @property
    def failed(self) -> Optional[BaseException]:
        """The error that failed the engine for good (None while healthy)."""
        return self._failed

    def submit(self, fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None,
               label: str = "") -> Handle:
        """Queue ``fn(*args, **kwargs)``; the handle's ``wait()`` returns its result."""
        self._raise_if_failed()
        if not self._thread.is_alive():
            raise CGXError("the cgx engine has been shut down (cgx.shutdown() was called)")
        handle = Handle(label, self)
        with self._lock:
            self._submitted += 1
            self._last_label = label
            seq = self._submitted
            self._pending.append(handle)
        self._queue.put((seq, handle, fn, args, kwargs or {}, time.perf_counter()))
        return handle

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            # After a failed collective the ranks' sequences have diverged; refusing
            # further work turns a later hang into this clear error.
            kind = CommunicationError if isinstance(self._failed, CommunicationError) \
                else CGXError
            raise kind(f"cgx cannot communicate any more: an earlier collective failed "
                       f"({self._failed})") from self._failed

    def _fail(self, exc: BaseException) -> None:
        """Fail for good: remember the first error, fail every pending handle with it."""
        with self._lock:
            if self._failed is None:
                self._failed = exc
            pending, self._pending = list(self._pending), collections.deque()
        for h in pending:
            h._finish(error=self._failed)

    def _loop(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            try:
                torch.cuda.set_device(self._device)
            except BaseException as exc:  # fail every collective, never hang on a dead thread
                self._fail(CGXError(f"cgx's engine could not use {self._device} ({exc}); "
                                    f"pass a device with its index, e.g. 'cuda:0'"))
        while True:
            item = self._queue.get()
            if item is None:
                return
            seq, handle, fn, args, kwargs, queued = item
            if self._failed is not None:
                handle._finish(error=self._failed)
                continue
            start = time.perf_counter()
            with self._lock:
                self._current = (seq, handle.name, handle, start)
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as exc:  # delivered to whoever waits on the handle
                result, error = None, exc
            with self._lock:
                self._current = None
                # FIFO: the running handle is the oldest pending one (unless _fail cleared it).
                if self._pending and self._pending[0] is handle:
                    self._pending.popleft()
            if error is not None and not _is_clean(error):
                if self._failed is None:
                    error = self._explain(error, seq, handle.name)
                self._fail(error)
            handle._finish(result, error)
            if self._timeline is not None and self._timeline.enabled:
                self._timeline.add("queued", queued, start - queued, cat="engine",
                                   row=handle.name or "engine", args={"seq": seq})
                self._timeline.add("run", start, time.perf_counter() - start, cat="engine",
                                   row=handle.name or "engine",
                                   args={"error": repr(error)} if error is not None else None)

    def _explain(self, exc: BaseException, seq: int, label: str) -> BaseException:
        """A transport error, completed with what the progress board knows."""
        if isinstance(exc, CGXError):
            return exc
        # The engines' own errors (Gloo, NCCL, MPI: RuntimeError) are failures to
        # communicate; anything else is cgx's or the program's.
        kind = CommunicationError if isinstance(exc, RuntimeError) else CGXError
        if self._board is None:  # nothing to add
            err = kind(f"collective '{label}' failed on rank {self._rank}: "
                       f"{type(exc).__name__}: {exc}")
            err.__cause__ = exc
            return err
        # A dead peer's heartbeat goes stale within a few seconds: wait for it.
        # (Not after a timeout: the ranks that kept us waiting are known already.)
        deadline = time.monotonic() + STALE_S + HEARTBEAT_S
        why = describe_missing(self._board, seq, label)
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        while not timed_out and "stopped responding" not in why and "unreachable" not in why \
                and time.monotonic() < deadline:
            time.sleep(0.5)
            why = describe_missing(self._board, seq, label)
        err = kind(f"collective '{label}' failed on rank {self._rank}: "
                   f"{type(exc).__name__}: {exc}; {why}")
        err.__cause__ = exc
        return err

    # -- watchdog ---------------------------------------------------------------------

    def _watch(self) -> None:
        warned_at = 0.0
        warned_seq = -1
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                submitted, last, current = self._submitted, self._last_label, self._current
            if self._board is not None:
                try:
                    self._board.publish(submitted, last)
                except Exception:  # noqa: BLE001 - the store host may be gone; keep watching
                    pass
            if current is None or self._failed is not None:
                continue
            seq, label, handle, start = current
            waited = time.perf_counter() - start
            if self._world_gone is not None and waited > WORLD_CHECK_S:
                reason = self._world_gone()
                if reason:
                    self._fail(CommunicationError(
                        f"collective '{label}' (#{seq}) cannot finish on rank {self._rank}: "
                        f"{reason}"))
                    continue
            if self._timeout_s and waited > self._timeout_s:
                why = describe_missing(self._board, seq, label)
                self._fail(CommunicationError(
                    f"collective '{label}' (#{seq}) did not finish within CGX_TIMEOUT_S="
                    f"{self._timeout_s:g} s on rank {self._rank}; {why}. Raise CGX_TIMEOUT_S "
                    "if the job is just slow"))
                continue
            if self._stall_s and waited > self._stall_s and (
                    seq != warned_seq or waited - warned_at >= self._stall_s):
                warned_seq, warned_at = seq, waited
                msg = (f"[cgx rank {self._rank}] WARNING: collective '{label}' (#{seq}) has "
                       f"waited {waited:.0f} s for the other ranks; "
                       f"{describe_missing(self._board, seq, label)}. It fails after "
                       f"CGX_TIMEOUT_S={self._timeout_s:g} s")
                self.stall_warnings.append(msg)
                print(msg, file=sys.stderr, flush=True)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker after what is queued (a failed engine: at once, never hanging),
        and the watchdog; ``wait``: until both have left."""
        self._stop.set()
        if self._thread.is_alive():
            self._queue.put(None)
        if wait:
            self._join_worker()
            self._join_watchdog()

    def _join_worker(self) -> None:
        # A worker stuck in a collective with a dead rank may never return (until the
        # watchdog fails it): once failed, give it a few seconds, then go on; the thread
        # is a daemon, so exit does not wait for it.
        failed_at = None
        while self._thread.is_alive():
            self._thread.join(0.2)
            if self._failed is not None:
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > JOIN_FAILED_S:
                    break

    def _join_watchdog(self) -> None:
        """Wait for the watchdog to leave (it wakes at once; a store call ends within seconds).

        A daemon thread still inside a torch.distributed store call when the interpreter
        finalizes aborts the process ("terminate called without an active exception"),
        so a job that trained to the end would exit with SIGABRT.
        """
        dog = self._watchdog
        if dog is not None and dog is not threading.current_thread():
            dog.join(JOIN_FAILED_S + HEARTBEAT_S)
