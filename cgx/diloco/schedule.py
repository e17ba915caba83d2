"""Which parameters each fragment holds, and at which local step each fragment syncs.

Fragments are contiguous runs of the parameters (in the model's order), balanced by
size, every parameter in exactly one. A round is H local steps; fragment ``f`` syncs
once a round, at offset ``(f + 1) * H // K`` into it (the last one at the round's end,
so one fragment is DiLoCo's sync every H steps), and its result lands ``delay`` steps
later (Streaming DiLoCo's delayed application). Steps count local steps, the
warm-up left out.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Sequence


def balanced_fragments(numels: Sequence[int], k: int) -> list[list[int]]:
    """Cut ``range(len(numels))`` into ``k`` contiguous non-empty runs of about equal size.

    Raises:
        ValueError: ``k`` outside ``[1, len(numels)]``.
    """
    n = len(numels)
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} parameters into {k} non-empty fragments")
    cum = list(itertools.accumulate(numels, initial=0))  # cum[j]: size of the first j
    cuts = [0]
    for f in range(1, k):
        target = cum[n] * f / k
        low, high = cuts[-1] + 1, n - (k - f)  # each fragment keeps at least one
        j = min(max(bisect.bisect_left(cum, target), low), high)
        if j > low and target - cum[j - 1] < cum[j] - target:
            j -= 1
        cuts.append(j)
    cuts.append(n)
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


@dataclasses.dataclass(frozen=True)
class FragmentSchedule:
    """The fragments of one run and their sync steps.

    Args:
        groups: each fragment's parameter indices (:func:`balanced_fragments`).
        sync_every: H, local steps per round.
        delay: steps between a fragment's sync and the landing of its result.
        start: the local step this schedule begins after (a schedule chosen by
            ``sync_every="auto"`` starts where the calibration round ended).
    """

    groups: tuple
    sync_every: int
    delay: int
    start: int = 0

    @classmethod
    def make(cls, numels: Sequence[int], fragments: int, sync_every: int, delay: int,
             start: int = 0) -> "FragmentSchedule":
        groups = tuple(tuple(g) for g in balanced_fragments(numels, fragments))
        return cls(groups, int(sync_every), int(delay), int(start))

    @property
    def offsets(self) -> list[int]:
        """Each fragment's sync step within a round, in ``1..H``."""
        k, h = len(self.groups), self.sync_every
        return [(f + 1) * h // k for f in range(k)]

    def syncing(self, step: int) -> list[int]:
        """The fragments that sync after local step ``step`` (1-based)."""
        s = step - self.start
        return [f for f, off in enumerate(self.offsets)
                if s >= off and (s - off) % self.sync_every == 0]

    def next_sync(self, step: int) -> int:
        """The first local step after ``step`` at which some fragment syncs."""
        s = step - self.start
        best = None
        for off in self.offsets:
            nxt = off if s < off else off + ((s - off) // self.sync_every + 1) * self.sync_every
            best = nxt if best is None else min(best, nxt)
        return best + self.start
