"""Deterministic pipelining of per-block collective programs.

An algorithm describes one block as a generator: it does local work
(compress, reduce, decompress) and ``yield``s each asynchronous collective it
issues; the scheduler resumes it once that collective has completed. Several
blocks are in flight at once, so the link carries block ``b`` while the CPU
compresses block ``b + 1``.

Every rank must issue its collectives in the same order (torch.distributed,
MPI and Horovod match operations by sequence). The scheduler therefore takes
every decision from counters only, never from timing: with the same number of
blocks and the same ``depth``, every rank issues the same sequence.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Generator, Iterable, Optional

from cgx.comm.base import Work

BlockProgram = Generator[Work, None, None]


class PhaseTimer:
    """Seconds spent per phase (compress, reduce, decompress, wait), summed.

    With a timeline, every span is also recorded as a trace event.
    """

    __slots__ = ("seconds", "timeline", "row")

    def __init__(self, timeline=None, row: str = "cgx"):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.timeline = timeline if timeline is not None and timeline.enabled else None
        self.row = row  # the timeline row: the collective's name

    def add(self, phase: str, dt: float) -> None:
        self.seconds[phase] += dt
        if self.timeline is not None:
            self.timeline.add(phase, time.perf_counter() - dt, dt, row=self.row)

    def time(self, phase: str):
        return _Span(self, phase)


class _Span:
    __slots__ = ("timer", "phase", "t0")

    def __init__(self, timer: PhaseTimer, phase: str):
        self.timer, self.phase = timer, phase

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.timer.add(self.phase, time.perf_counter() - self.t0)


def run(programs: Iterable[BlockProgram], depth: int = 3,
        timer: Optional[PhaseTimer] = None) -> None:
    """Run block programs with at most ``depth`` collectives outstanding.

    Rule (identical on every rank): start the next block while fewer than
    ``depth`` collectives are pending; otherwise resume the block whose
    collective was issued first (waiting for it), which then issues its next
    collective or finishes.
    """
    if depth < 1:
        raise ValueError(f"pipeline depth must be >= 1, got {depth}")
    pending: collections.deque[tuple[BlockProgram, Work]] = collections.deque()
    source = iter(programs)
    exhausted = False
    wait = _waiter(timer)
    while True:
        if not exhausted and len(pending) < depth:
            prog = next(source, None)
            if prog is None:
                exhausted = True
                continue
            work = next(prog, None)
            if work is not None:
                pending.append((prog, work))
            continue
        if not pending:
            return
        prog, work = pending.popleft()
        wait(work)
        try:
            nxt = prog.send(None)
        except StopIteration:
            continue
        pending.append((prog, nxt))


def _waiter(timer: Optional[PhaseTimer]) -> Callable[[Work], None]:
    if timer is None:
        return lambda w: w.wait()

    def wait(work: Work) -> None:
        t0 = time.perf_counter()
        work.wait()
        timer.add("wait", time.perf_counter() - t0)

    return wait
