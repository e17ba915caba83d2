"""Run one process per rank, each inside its namespace, and collect what they did.

:func:`run_group` is the engine behind :meth:`SlowNetwork.launch`: it starts
every rank in its own session (so a rank's children die with it), waits with
a deadline, and stops the whole group as soon as one rank fails: a Gloo peer
left waiting for a dead rank would otherwise hang for its full timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from typing import Callable, Mapping, Optional, Sequence

from .results import LaunchResult, RankResult

_POLL_S = 0.02
_TERM_GRACE_S = 2.0  # after SIGTERM, wait this long before SIGKILL


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the rank's process group, then SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    for sig, grace in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)  # pgid == pid: started with start_new_session
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_group(
    argvs: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    *,
    timeout: float,
    cwd: Optional[str] = None,
    on_start: Optional[Callable[[list[subprocess.Popen]], None]] = None,
) -> LaunchResult:
    """Start ``argvs[i]`` with ``envs[i]`` for every rank; wait, stop all on failure.

    Output goes to temporary files rather than pipes: a chatty rank can never
    block on a full pipe while the harness waits for another rank.

    Args:
        argvs: full command of each rank (already wrapped in ``ip netns exec``).
        envs: complete environment of each rank.
        timeout: seconds for the whole group; then every rank is stopped.
        cwd: working directory of the ranks.
        on_start: called with the live processes, so an owner can stop them
            from a signal handler.

    Returns:
        A :class:`LaunchResult` (never raises for a failing rank; see ``check()``).
    """
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="cgx-netsim-out-") as outdir, contextlib.ExitStack() as stack:
        files = []
        start = time.monotonic()
        try:
            _start(argvs, envs, cwd, outdir, stack, files, procs)
            if on_start is not None:
                on_start(procs)
            failed, timed_out = _wait(procs, start + timeout)
            elapsed = time.monotonic() - start
            stopped = [p.poll() is None for p in procs]
        finally:
            for p in procs:
                _stop(p)
        results = _collect(procs, files, stopped, timed_out)
    return LaunchResult(ranks=results, elapsed_s=elapsed, timed_out=timed_out, failed_ranks=failed)


def _start(argvs, envs, cwd, outdir: str, stack: contextlib.ExitStack, files: list,
           procs: list) -> None:
    """Start every rank, its output in ``outdir``; appends to ``files`` and ``procs`` as it
    goes, so that the caller stops the ranks already started if a later one fails to start."""
    for rank, (argv, env) in enumerate(zip(argvs, envs)):
        out = stack.enter_context(open(os.path.join(outdir, f"rank{rank}.out"), "w+b"))
        err = stack.enter_context(open(os.path.join(outdir, f"rank{rank}.err"), "w+b"))
        files.append((out, err))
        procs.append(subprocess.Popen(
            list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=out, stderr=err, start_new_session=True,
        ))


def _wait(procs: list, deadline: float) -> tuple[list[int], bool]:
    """Poll until a rank fails, all exit, or the deadline passes: (failed ranks, timed out)."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c is not None and c != 0]
        if failed or all(c is not None for c in codes):
            return failed, False
        if time.monotonic() >= deadline:
            return failed, True
        time.sleep(_POLL_S)


def _collect(procs: list, files: list, stopped: list, timed_out: bool) -> list[RankResult]:
    """Every rank's :class:`RankResult`, its output read back from its files."""
    results = []
    for rank, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0)
        err.seek(0)
        results.append(RankResult(
            rank=rank,
            returncode=p.returncode,
            stdout=out.read().decode(errors="replace"),
            stderr=err.read().decode(errors="replace"),
            killed=stopped[rank],
            timed_out=timed_out and stopped[rank],
        ))
    return results
