"""Which rank failed first, and with what code: the exit record of a ``cgxrun --gloo`` job.

torch.distributed.run stops the other workers when one fails but exits 1 whatever
the worker's code, and cannot tell which of several failing ranks went first.
So cgxrun starts each worker under a small recorder
(``python -m cgx.launch.exit_record DIR -- prog ...``) that writes the time and
code of a failed worker to ``DIR/rank<R>``, and each rank's cgx runtime notes in
``DIR/atexit.rank<R>`` when it starts to exit (:func:`note_exit_status`,
:func:`write_atexit`), before it closes the connections its peers wait on.
:func:`first_recorded_failure` reads them back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

RECORD_FLAG = "--_record-exit"
EXIT_RECORD_VAR = "CGXRUN_EXIT_DIR"  # where ranks note when they start to exit
TAG_OUTPUT_VAR = "CGXRUN_TAG_OUTPUT"  # "1": the recorder prefixes output lines with the rank
OUTPUT_DIR_VAR = "CGXRUN_OUTPUT_DIR"  # the recorder also copies output to DIR/rank.<r>/


def exit_code(returncode: int) -> int:
    """Shell convention: a process killed by signal s (returncode -s) -> 128 + s."""
    return 128 - returncode if returncode < 0 else returncode


def record_exit(record_dir: str, command: list[str]) -> int:
    """Run ``command``; if it fails, write ``<time_ns> <returncode>`` to ``record_dir/<RANK>``.

    Signals are forwarded to the command, and a command killed by a signal
    kills the recorder with the same signal, so torch.distributed.run sees
    exactly what the command did.
    """
    def die_with_parent():  # the command must not outlive a recorder killed by SIGKILL
        default_signals()
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    rank = os.environ.get("RANK", str(os.getpid()))
    tag = os.environ.get(TAG_OUTPUT_VAR, "0") == "1"
    log_dir = os.environ.get(OUTPUT_DIR_VAR)
    pipe = subprocess.PIPE if tag or log_dir else None
    try:
        proc = subprocess.Popen(command, preexec_fn=die_with_parent, stdout=pipe, stderr=pipe)
    except OSError as e:
        print(f"cgxrun: cannot start {command[0]!r}: {e}", file=sys.stderr)
        proc, code = None, 127
    if proc is not None:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, lambda signum, _f: proc.send_signal(signum))
        pumps = []
        if pipe is not None:
            from cgx.console import LinePump
            if log_dir:
                os.makedirs(os.path.join(log_dir, f"rank.{rank}"), exist_ok=True)
            for name, src, dst in (("stdout", proc.stdout, sys.stdout),
                                   ("stderr", proc.stderr, sys.stderr)):
                log = os.path.join(log_dir, f"rank.{rank}", name) if log_dir else None
                pumps.append(LinePump(src, dst, f"[{rank}]<{name}>:" if tag else "", log))
        code = proc.wait()
        for pump in pumps:
            pump.join()
    if code != 0:
        rank = os.environ.get("RANK", str(os.getpid()))
        with open(os.path.join(record_dir, f"rank{rank}"), "w") as f:
            f.write(f"{time.time_ns()} {code}")
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)  # undo the forwarding handler
        except (OSError, ValueError):
            pass  # SIGKILL/SIGSTOP: cannot be caught anyway
        os.kill(os.getpid(), -code)
    return code


def first_recorded_failure(record_dir: str) -> Optional[tuple[int, int]]:
    """(rank, returncode) of the failed rank that went first, or None.

    A failed rank's time is when cgx's exit handler ran (``atexit.rank<R>``,
    written by cgx.runtime before it closes the rank's connections, which is
    what makes blocked peers fail), else when its process ended (``rank<R>``).
    Its code is the status its program exited with, when cgx noted one there.
    """
    def read(name):
        with open(os.path.join(record_dir, name)) as f:
            return f.read().split()

    found = []
    for name in os.listdir(record_dir):
        if not name.startswith("rank"):
            continue
        try:
            t, code = read(name)
            rank = int(name[len("rank"):])
            t, code = int(t), int(code)
        except (OSError, ValueError):
            continue
        try:
            noted = read(f"atexit.rank{rank}")
            t = min(t, int(noted[0]))
            if len(noted) > 1 and int(noted[1]) != 0:
                # The status the program exited with (sys.exit), noted before its exit
                # handlers ran: the launcher may have stopped it by a signal since.
                code = int(noted[1])
        except (OSError, ValueError, IndexError):
            pass
        found.append((t, rank, code))
    if not found:
        return None
    _, rank, code = min(found)
    return rank, code


def default_signals() -> None:
    """In a child before exec: SIGINT/SIGTERM/SIGHUP back to their defaults.

    A job started in the background (``cgxrun ... &``, CI runners) inherits
    SIGINT as *ignored*; a Python worker would then never raise
    KeyboardInterrupt and launchers could not stop it with SIGINT.
    """
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(s, signal.SIG_DFL)
        except (OSError, ValueError):
            pass


_exit_status = None  # what the program exits with, once known (sys.exit, uncaught error)


def note_exit_status() -> None:
    """Under cgxrun: learn the exit status before the exit handlers run.

    A rank that calls ``sys.exit(3)`` closes its connections in its exit handler; a
    peer blocked in a collective with it then fails, and the launcher may stop this
    rank (SIGTERM) before it has finished exiting. cgxrun reports the first failure,
    and this makes it report 3, not the signal.
    """
    real_exit, previous_hook = sys.exit, sys.excepthook

    def exit_(status=None):
        global _exit_status
        _exit_status = status
        real_exit(status)

    def hook(exc_type, exc, tb):
        global _exit_status
        if _exit_status is None:
            _exit_status = 1
        previous_hook(exc_type, exc, tb)

    sys.exit, sys.excepthook = exit_, hook


def _status_code(status) -> int:
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def write_atexit(rank: int) -> None:
    """Note, for cgxrun, that ``rank`` starts to exit now (and its status, when known)."""
    record_dir = os.environ.get(EXIT_RECORD_VAR)
    if not record_dir:
        return
    try:
        with open(os.path.join(record_dir, f"atexit.rank{rank}"), "w") as f:
            f.write(str(time.time_ns()))
            if _exit_status is not None:
                f.write(f" {_status_code(_exit_status)}")
    except OSError:
        pass


if __name__ == "__main__":  # python -m cgx.launch.exit_record DIR -- prog [args...]
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        sys.exit("usage: python -m cgx.launch.exit_record DIR -- program [args...]")
    sys.exit(record_exit(sys.argv[1], sys.argv[3:]))
