"""Ports for the tests' worlds: each pytest-xdist worker draws from a range of its own.

A port taken by binding port 0 comes from the kernel's ephemeral range, the same range
the source ports of every outgoing connection come from, and two workers that each
found a "free" port there can collide with each other or with a connection made in
between. Here each worker (``PYTEST_XDIST_WORKER`` gw0, gw1, ...; none: the first range)
takes ports below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), from a
block of its own, in turn, skipping any port that cannot be bound at the moment. A
process that is no test worker (a rank started by one) gets the range of the worker that
started it, through the environment.
"""

from __future__ import annotations

import itertools
import os
import socket

BLOCK = 1500  # ports per worker: gw0 takes 15000-16499, gw1 16500-17999, ...
FIRST = 15000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = "".join(c for c in name if c.isdigit())
    return int(digits) if digits else 0


def worker_range() -> range:
    """This worker's ports (wrapping around below the ephemeral range)."""
    low = _ephemeral_low()
    slots = max(1, (low - FIRST) // BLOCK)
    start = FIRST + (_worker_index() % slots) * BLOCK
    return range(start, min(start + BLOCK, low))


# In turn from a start that differs per process, so that a worker's successive worlds (and
# a world that failed to release its port yet) do not ask for the same one.
_next = itertools.count(os.getpid() % BLOCK)


def free_port() -> int:
    """A port of this worker's range that can be bound on 127.0.0.1 now."""
    ports = worker_range()
    for _ in range(len(ports)):
        port = ports[next(_next) % len(ports)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {ports.start}-{ports.stop - 1} "
                       f"(worker {_worker_index()})")
