"""Fusion buckets in the order backward produces gradients, for every adapter."""

from __future__ import annotations

from typing import Sequence

FIRST_BUCKET_BYTES = 1 << 20  # small first bucket: its reduction starts early in backward


def ready_order_buckets(nbytes: Sequence[int], cap_bytes: int,
                        first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Fusion buckets in the order backward produces gradients (the last parameter's
    first): consecutive indices of ``nbytes`` (float32 bytes per gradient, in parameter
    order) until a bucket would exceed ``cap_bytes``; the first bucket is capped at
    ``first_bytes`` so that its exchange starts early. A gradient larger than the cap
    gets a bucket of its own."""
    buckets, cur, size = [], [], 0
    limit = min(cap_bytes, first_bytes)
    for i in range(len(nbytes) - 1, -1, -1):
        if cur and size + nbytes[i] > limit:
            buckets.append(cur)
            cur, size, limit = [], 0, cap_bytes
        cur.append(i)
        size += nbytes[i]
    if cur:
        buckets.append(cur)
    return buckets
