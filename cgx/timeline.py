"""Chrome-trace timeline of what cgx does (``CGX_TIMELINE`` / ``HOROVOD_TIMELINE``).

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Each rank
writes its own file: ``path`` for rank 0, and ``path`` with ``.rank<r>``
inserted before the extension for the others (or ``{rank}`` in the path is
replaced), so several ranks never write the same file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional


def rank_path(path: str, rank: int) -> str:
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if rank == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext or '.json'}"


class Timeline:
    """Collects complete events ("ph": "X") and writes them as JSON on ``close()``.

    Cheap when disabled (``path=None``): every method returns at once.
    """

    def __init__(self, path: Optional[str], rank: int = 0):
        self.path = rank_path(path, rank) if path else None
        self.rank = rank
        self._events: list[dict] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def now(self) -> float:
        return time.perf_counter()

    def add(self, name: str, start: float, duration: float, cat: str = "cgx",
            args: Optional[dict] = None) -> None:
        """Record an event that began at ``start`` (``perf_counter`` seconds)."""
        if self.path is None:
            return
        ev = {"name": name, "cat": cat, "ph": "X", "pid": self.rank,
              "tid": threading.get_ident() % 100000,
              "ts": (start - self._t0) * 1e6, "dur": duration * 1e6}
        if args:
            ev["args"] = args
        with self._lock:
            self._events.append(ev)

    def events(self) -> list[dict]:
        with self._lock:
            return list(self._events)

    def close(self) -> None:
        """Write the file (idempotent)."""
        if self.path is None:
            return
        with self._lock:
            events, self._events = self._events, []
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
