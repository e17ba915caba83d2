"""The settings of trials (``Compression.auto(objective="time")``): how long each proposed
plan runs and how the kept one is watched. Held and validated here; run by
:mod:`cgx.policy.trials.rounds`."""

from __future__ import annotations

import dataclasses

# The settings' names as Compression.auto spells them.
_ARG = {"steps": "trial_steps", "settle_steps": "trial_settle_steps",
        "warmup_steps": "trial_warmup_steps", "runoffs": "trial_runoffs"}


@dataclasses.dataclass
class TrialSettings:
    """How long plans are tried and how the kept one is watched.

    Args:
        steps: measured steps per plan (>= 1).
        settle_steps: steps after a switch that are not measured (>= 0).
        warmup_steps: steps between a round's setup (the planner's measurements) and the
            first plan's turn, the plan in use travelling on (>= 0): the setup's
            transient (allocations, busy threads) stays out of the first plan's times.
        recheck_every: steps between checks of the kept plan (0: never re-tried, not
            even when the link moved while the plans took turns).
        drift_tolerance: relative change of the kept plan's step that starts a new round.
        tie_tolerance: plans within this fraction of the fastest count as equally fast;
            the one with the smallest error is kept, then the one sending fewest bytes.
            The margin widens to what the round's measured step spread resolves
            (:func:`cgx.policy.trials.rounds.resolution`), and so does ``runoff_margin``.
        runoffs: extra passes over the plans whose measured step is within
            ``runoff_margin`` of the fastest (when two or more are), in the reverse
            order of the pass before, each plan's times pooled: a few steps measure a
            plan to about 10% on shared cores, as much as the best plans often differ.
            After the first, a pass runs only the plans the clock still cannot tell
            from the fastest (a tie :func:`cgx.policy.trials.rounds.choose` would break by
            error), so close plans are measured until they separate, or tie for real.
        runoff_margin: how close (relative) to the fastest a plan runs again.
    """

    steps: int = 3
    settle_steps: int = 1
    warmup_steps: int = 3
    recheck_every: int = 200
    drift_tolerance: float = 0.2
    tie_tolerance: float = 0.02
    runoffs: int = 3
    runoff_margin: float = 0.1

    def __post_init__(self):
        for name, lo in (("steps", 1), ("settle_steps", 0), ("warmup_steps", 0),
                         ("recheck_every", 0), ("runoffs", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{_ARG.get(name, name)}={v!r} must be an int >= {lo}")
        for name in ("drift_tolerance", "tie_tolerance", "runoff_margin"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{_ARG.get(name, name)}={v!r} must be a number >= 0")

    @property
    def turn(self) -> int:
        """Steps each plan travels in a round."""
        return self.settle_steps + self.steps
