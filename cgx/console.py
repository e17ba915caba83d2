"""What a person sees: rank-prefixed output lines (cgxrun) and progress bars only on a terminal.

``LinePump`` copies a worker's output to cgxrun's, a whole line per write
(so the lines of two ranks never mix mid-line), with the rank's prefix, and
optionally into a per-rank log file. Progress bars that redraw a line with
``\\r`` are drawn as such on a terminal; into a file or pipe only their last
frame per line is written.

``progress(...)`` is tqdm on rank 0 when a person watches (cgx's output, or
cgxrun's, is a terminal), and a silent pass-through otherwise.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Iterable, Optional

TTY_VAR = "CGXRUN_TTY"  # set by cgxrun: "1" when its own stderr is a terminal


def isatty(stream) -> bool:
    try:
        return os.isatty(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False


class LinePump:
    """A thread copying ``src`` (a pipe) to ``dst`` line by line, each line prefixed.

    Args:
        src: the worker's stdout or stderr pipe (binary).
        dst: where lines go (cgxrun's stdout or stderr).
        prefix: put before every line, e.g. ``"[1]<stdout>:"``.
        log_path: also append the raw output here (None: no log).
    """

    def __init__(self, src, dst, prefix: str = "", log_path: Optional[str] = None):
        self._src, self._prefix = src, prefix.encode()
        self._dst_fd = dst.fileno()
        self._tty = isatty(dst)
        self._log = open(log_path, "ab") if log_path else None
        self._thread = threading.Thread(target=self._run, name="cgxrun-output", daemon=True)
        self._thread.start()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # one write() per line in practice: lines of two ranks never mix
            n = os.write(self._dst_fd, view)
            view = view[n:]

    def _emit(self, line: bytes, end: bytes) -> None:
        if end == b"\r" and not self._tty:
            return  # a progress-bar frame: only a terminal redraws it
        if not self._tty and b"\r" in line:
            line = line.rsplit(b"\r", 1)[-1]  # the last frame of a redrawn line
        self._write(self._prefix + line + end)

    def _run(self) -> None:
        fd, buf = self._src.fileno(), b""
        try:
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                if self._log is not None:
                    self._log.write(chunk)
                    self._log.flush()
                buf += chunk
                while True:
                    cuts = [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]
                    if not cuts:
                        break
                    i = min(cuts)
                    end = buf[i:i + 1]
                    if end == b"\r" and buf[i + 1:i + 2] == b"\n":
                        end, step = b"\r\n", 2
                    else:
                        step = 1
                    line, buf = buf[:i], buf[i + step:]
                    self._emit(line, b"\n" if end == b"\r\n" else end)
            if buf:
                self._emit(buf, b"\n")
        except OSError:
            pass
        finally:
            if self._log is not None:
                self._log.close()

    def join(self, timeout: Optional[float] = 10.0) -> None:
        self._thread.join(timeout)


_rank_source: Optional[Callable[[], Optional[int]]] = None  # set by cgx.runtime at import


def set_rank_source(source: Callable[[], Optional[int]]) -> None:
    """Where :func:`progress` learns this process's rank (None: not known yet)."""
    global _rank_source
    _rank_source = source


def _rank() -> int:
    known = _rank_source() if _rank_source is not None else None
    if known is not None:
        return known
    for var in ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def watched() -> bool:
    """True when a person watches this process's output on a terminal."""
    if TTY_VAR in os.environ:
        return os.environ[TTY_VAR] == "1"
    return isatty(sys.stderr)


def progress(iterable: Optional[Iterable] = None, **kwargs: Any):
    """A tqdm progress bar on rank 0 when :func:`watched`, else a silent pass-through.

    Example::

        for epoch in cgx.console.progress(range(10), desc="epochs"):
            ...
    """
    from tqdm import tqdm
    kwargs.setdefault("file", sys.stderr)
    kwargs["disable"] = kwargs.get("disable", False) or not watched() or _rank() != 0
    return tqdm(iterable, **kwargs)
