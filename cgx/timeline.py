"""Chrome-trace timeline of what cgx does (``CGX_TIMELINE`` / ``HOROVOD_TIMELINE``).

Open the file in ``chrome://tracing`` or https://ui.perfetto.dev. Each rank
writes its own file: ``path`` for rank 0, and ``path`` with ``.rank<r>``
inserted before the extension for the others (or ``{rank}`` in the path is
replaced), so several ranks never write the same file.

One row (thread) per collective, named after it (``opt1.bucket0``,
``ddp.bucket2``, ``allreduce.loss``, ...), as Horovod's timeline has one row
per tensor. On it, per step:

* ``ready <tensor>``: instant events when a gradient is ready (optimizer
  hooks, DDP buckets, the TensorFlow exchange);
* ``queued``: from submission to the engine until the engine starts it;
* ``compress``, ``wait`` (blocked on the wire), ``reduce`` (decompress, add,
  recompress), ``decompress``, ``plain`` (uncompressed allreduce);
* ``done``: the whole collective, with its sizes in ``args``.

Events are streamed: the file is a JSON array written event by event and
flushed as it goes, so a crash keeps everything up to the crash (Chrome's
trace format allows the closing ``]`` to be missing; :func:`load` adds it).
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
    """Streams Chrome-trace events of one rank to a file.

    Cheap when disabled (``path=None``): every method returns at once.

    Args:
        path: the trace file (per-rank name, see :func:`rank_path`), or None.
        rank: this rank (the trace's process id).
    """

    def __init__(self, path: Optional[str], rank: int = 0):
        self.rank = rank
        self.path: Optional[str] = None
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._file = None
        self._rows: dict[str, int] = {}
        self._count = 0
        self._recent: list[dict] = []  # the last events, for tests and summaries
        if path:
            self.start(path)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def start(self, path: str) -> None:
        """(Re)start writing to ``path`` (per-rank name); the previous file is closed."""
        self.close()
        full = rank_path(path, self.rank)
        os.makedirs(os.path.dirname(os.path.abspath(full)), exist_ok=True)
        with self._lock:
            self._file = open(full, "w", buffering=1)
            self._file.write("[\n")
            self._rows, self._count = {}, 0
            self.path = full
        self._write({"name": "process_name", "ph": "M", "pid": self.rank,
                     "args": {"name": f"cgx rank {self.rank}"}})

    def now(self) -> float:
        return time.perf_counter()

    def _row(self, row: str) -> int:
        tid = self._rows.get(row)
        if tid is None:
            tid = self._rows[row] = len(self._rows) + 1
            self._write_locked({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                                "args": {"name": row}})
        return tid

    def _write(self, ev: dict) -> None:
        with self._lock:
            self._write_locked(ev)

    def _write_locked(self, ev: dict) -> None:
        if self._file is None:
            return
        self._file.write(("" if self._count == 0 else ",\n") + json.dumps(ev))
        self._file.flush()  # streamed: a crash keeps what happened
        self._count += 1
        self._recent.append(ev)
        del self._recent[:-1000]

    def add(self, name: str, start: float, duration: float, cat: str = "cgx",
            args: Optional[dict] = None, row: str = "cgx") -> None:
        """Record a span that began at ``start`` (``perf_counter`` seconds) on ``row``."""
        if self._file is None:
            return
        with self._lock:
            ev = {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": self._row(row),
                  "ts": (start - self._t0) * 1e6, "dur": duration * 1e6}
            if args:
                ev["args"] = args
            self._write_locked(ev)

    def instant(self, name: str, row: str = "cgx", args: Optional[dict] = None,
                when: Optional[float] = None) -> None:
        """Record a point in time (e.g. a gradient became ready) on ``row``."""
        if self._file is None:
            return
        with self._lock:
            ev = {"name": name, "cat": "cgx", "ph": "i", "s": "t", "pid": self.rank,
                  "tid": self._row(row),
                  "ts": ((time.perf_counter() if when is None else when) - self._t0) * 1e6}
            if args:
                ev["args"] = args
            self._write_locked(ev)

    def events(self) -> list[dict]:
        """The last (up to 1000) events written."""
        with self._lock:
            return list(self._recent)

    def close(self) -> None:
        """Finish the file (idempotent)."""
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None


def load(path: str) -> list[dict]:
    """The events of a timeline file, also of one cut short by a crash (no closing ``]``)."""
    with open(path) as f:
        text = f.read().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "\n]"
    data = json.loads(text)
    return data["traceEvents"] if isinstance(data, dict) else data
