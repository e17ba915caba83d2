"""Background execution of collectives, in submission order.

Adapters start a bucket's reduction while backward is still running
(wait-free backpropagation) by submitting it here; one worker thread runs
the submissions strictly first-in first-out. So as long as every rank
submits in the same order, every rank issues the same collectives in the
same order, which torch.distributed, MPI and Horovod all require.

The compression kernels release the GIL (C via ctypes, torch ops, Triton
launches), so the worker overlaps with the training thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import torch

from cgx.errors import CGXError


class Handle:
    """Result of an asynchronous submission: ``poll()``, ``wait()``."""

    __slots__ = ("_event", "_result", "_error", "name")

    def __init__(self, name: str = ""):
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.name = name

    def poll(self) -> bool:
        """True when done (successfully or not); never blocks."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done and return the result, or raise what the work raised.

        Raises:
            CGXError: when ``timeout`` seconds pass first.
        """
        if not self._event.wait(timeout):
            raise CGXError(f"collective '{self.name}' did not finish within {timeout} s; "
                           "a rank may have died or issued different collectives "
                           "(raise CGX_TIMEOUT_S if the job is just slow)")
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._event.set()


class CompletedHandle(Handle):
    def __init__(self, result: Any = None, name: str = ""):
        super().__init__(name)
        self._finish(result)


class Engine:
    """One worker thread running submitted callables FIFO.

    Args:
        device: CUDA device the worker makes current (None for CPU work).
    """

    def __init__(self, device: Optional[torch.device] = None):
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._device = device
        self._failed: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="cgx-engine", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], args: tuple = (), kwargs: Optional[dict] = None,
               label: str = "") -> Handle:
        """Queue ``fn(*args, **kwargs)``; the handle's ``wait()`` returns its result."""
        if self._failed is not None:
            # After a failed collective the ranks' sequences have diverged; refusing
            # further work turns a later hang into this clear error.
            raise CGXError(f"an earlier collective failed ({self._failed!r}); cgx cannot "
                           "continue this job's communication") from self._failed
        if not self._thread.is_alive():
            raise CGXError("the cgx engine has been shut down (cgx.shutdown() was called)")
        handle = Handle(label)
        self._queue.put((handle, fn, args, kwargs or {}))
        return handle

    def _loop(self) -> None:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, fn, args, kwargs = item
            try:
                handle._finish(fn(*args, **kwargs))
            except BaseException as exc:  # delivered to whoever waits on the handle
                self._failed = exc
                handle._finish(error=exc)

    def shutdown(self, wait: bool = True) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            if wait:
                self._thread.join()
