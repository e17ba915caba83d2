"""The planned exchange's drift checks: the measured step, agreed over the ranks, against
the plan's prediction; a drift beyond ``drift_tolerance`` re-plans.

:func:`check_drift` takes the :class:`cgx.policy.planner.schedule.PlannedSchedule` (``s``)
whose checks (``s.checks``) and expected bias (``s._ratio``, ``s._calibrate_ratio``) it keeps.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

from cgx.policy.planner.tracing import mark


@dataclasses.dataclass
class DriftCheck:
    """One drift check: the step it ran at, the plan's prediction, the agreed measurement."""

    step: int
    predicted_s: float
    measured_s: float
    expected_ratio: float  # measured/predicted taken as normal (1, or the model's bias)
    replanned: bool


def check_drift(s, step: int, transport, verbose: bool = False,
                timeline=None) -> DriftCheck:
    """Agree on the measured step; re-plan when it drifts from the prediction. A
    collective: every rank calls it at the same step."""
    from cgx.comm.base import ReduceOp
    local = statistics.median(s._measured) if s._measured else 0.0
    s._measured = []
    agreed = torch.tensor([local], dtype=torch.float64, device=transport.device)
    if transport.size > 1:
        transport.allreduce(agreed, ReduceOp.MAX)
    measured = float(agreed.item())
    predicted = s.plan.step_s
    ratio = measured / predicted if predicted > 0 else 1.0
    if s._calibrate_ratio and measured > 0:
        # Just re-planned for drift and still off: what the model misses, it misses
        # steadily; only a change from here is drift.
        s._ratio, s._calibrate_ratio = ratio, False
    drift = measured > 0 and abs(ratio / s._ratio - 1.0) > s.settings.drift_tolerance
    check = DriftCheck(step, predicted, measured, s._ratio, drift)
    s.checks.append(check)
    mark(timeline, "drift check", {"step": step, "predicted_ms": 1e3 * predicted,
                                   "measured_ms": 1e3 * measured, "replanned": drift})
    if drift:
        if verbose:
            print(f"cgx: step {step}: measured step {1e3 * measured:.1f} ms against "
                  f"{1e3 * predicted * s._ratio:.1f} ms expected; re-planning",
                  file=sys.stderr, flush=True)
        s.replan(transport, verbose, step=step, timeline=timeline)
        s._calibrate_ratio = True
    return check
