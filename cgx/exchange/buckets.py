"""Fusion buckets in the order backward produces gradients, for every adapter: by size,
in user groups or `num_groups`, with sufficient-factor layers in buckets of their own."""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence

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


def _ready_runs(nbytes: Sequence[int], cap_bytes: int, alone: dict, own: set) -> list[list[int]]:
    """Ready order, cut at each factor weight: the runs between them fused as usual."""
    buckets: list[list[int]] = []
    run: list[int] = []

    def flush() -> None:
        if run:
            kept = run[::-1]  # parameter order
            first = FIRST_BUCKET_BYTES if not buckets else cap_bytes
            buckets.extend([kept[j] for j in b] for b in ready_order_buckets(
                [nbytes[i] for i in kept], cap_bytes, first))
            run.clear()

    for i in range(len(nbytes) - 1, -1, -1):
        if i in alone:
            flush()
            buckets.append(alone[i])
        elif i not in own:
            run.append(i)
    flush()
    return buckets


def _in_groups(count: int, num_groups: int, alone: dict, own: set) -> list[list[int]]:
    """``num_groups`` buckets of consecutive gradients (ready order); each factor bucket
    goes before the first group holding a gradient that backward reaches after it."""
    rev = [i for i in range(count)[::-1] if i not in own]
    n = min(num_groups, len(rev)) or 1
    groups = [rev[k * len(rev) // n:(k + 1) * len(rev) // n] for k in range(n)]
    for one in alone.values():
        at = next((k for k, g in enumerate(groups) if g and min(g) < one[0]), len(groups))
        groups.insert(at, one)
    return [g for g in groups if g]


def compose_buckets(nbytes: Sequence[int], cap_bytes: int, *,
                    user_groups: Optional[Sequence[Sequence[int]]] = None, num_groups: int = 0,
                    factor_weights: Iterable[int] = (),
                    factor_biases: Optional[Mapping[int, int]] = None) -> list[list[int]]:
    """Fusion buckets in launch order for gradients of ``nbytes`` bytes (float32, in
    parameter order), as the user asks: explicit ``user_groups`` (lists of indices; the
    others form one more bucket), ``num_groups`` equal groups, or by size in ready order.
    A sufficient-factor weight (``factor_weights``) is a bucket of its own, with its bias
    (``factor_biases``: weight index -> bias index), placed where backward produces it so
    that its exchange starts beside backward."""
    biases = dict(factor_biases or {})
    alone = {i: [i] + ([biases[i]] if i in biases else [])
             for i in sorted(set(factor_weights), reverse=True)}
    own = set(alone) | set(biases.values())  # travel in the factor layers' own buckets
    if user_groups is not None:
        order = [[i for i in g if i not in own] for g in user_groups]
        grouped = {i for g in order for i in g}
        rest = [i for i in range(len(nbytes)) if i not in grouped and i not in own]
        return [g for g in order if g] + ([rest] if rest else []) + list(alone.values())
    if num_groups:
        return _in_groups(len(nbytes), num_groups, alone, own)
    return _ready_runs(nbytes, cap_bytes, alone, own)
