"""What a cgx method reports from cgx's own statistics, from the moment it is set up."""

from __future__ import annotations

from typing import Callable


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
