"""What every cgx method shares: its initialization on the model's device, and what it
reports from cgx's own statistics from the moment it is set up."""

from __future__ import annotations

import os
from typing import Callable


def init_cgx(model):
    """``cgx.torch``, initialized for the device of ``model``'s parameters: on a GPU (every
    rank of this benchmark on the same one) cgx's transport uses the Gloo group the ranks
    joined, as NCCL wants one GPU per rank."""
    import cgx.torch as hvd
    device = next(model.parameters()).device
    if device.type == "cuda":
        os.environ.setdefault("CGX_BACKEND", "gloo")
    hvd.init(device=device.type)
    return hvd


def cgx_counters(hvd) -> tuple[Callable[[int], float], Callable[[], float]]:
    """(bytes this rank handed to its transport since now, seconds spent compressing and
    decompressing since now), read from ``hvd.stats()``."""
    start = hvd.stats()

    def accounted(steps: int) -> float:
        return hvd.stats().wire_bytes - start.wire_bytes

    def compression_seconds() -> float:
        now = hvd.stats().seconds
        return sum(now.get(k, 0.0) - start.seconds.get(k, 0.0) for k in ("compress", "decompress"))

    return accounted, compression_seconds


def ring_bytes(nbytes: float, world: int) -> float:
    """What each rank sends in a ring allreduce of ``nbytes`` (the count of the methods that
    do not count their own bytes)."""
    return 2 * (world - 1) / world * nbytes
