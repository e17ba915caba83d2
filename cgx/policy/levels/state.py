"""An adaptive schedule's checkpoint: its plan, the last plan's errors and the window's
measurements so far, as plain values, restored by layer name.

The functions take the :class:`cgx.policy.levels.schedule.AdaptiveSchedule` (``s``).
"""

from __future__ import annotations

from cgx.policy.levels.candidates import Candidate
from cgx.policy.update_rule import Compensation

STATE_FORMAT = 2  # 1: the window's summed gradients instead of its measurements


def state_dict(s) -> dict:
    return {"format": STATE_FORMAT, "next_plan": s.next_plan,
            "plans_made": s.plans_made, "budget": s.budget,
            "hidden": sorted(s.hidden),
            "plan": {n: c.as_list() for n, c in zip(s.names, s.plan) if c is not None},
            "errors": None if s._errors is None else
            {s.names[i]: v for i, v in s._errors.items()},
            "sums": {k: list(v) for k, v in s._sums.items()},
            "counts": dict(s._counts), "scorer": s.scorer.state_dict(),
            "compensation": {n: v.value for n, v in s.compensation.items()}}


def load_state_dict(s, state: dict) -> None:
    if not isinstance(state, dict) or state.get("format") not in (1, STATE_FORMAT):
        raise ValueError(f"expected an adaptive-plan state of format {STATE_FORMAT} (from "
                         f"state_dict()), got {type(state).__name__}")
    # By layer name: layers added since (unfrozen, a new param group) keep the default.
    s.next_plan = int(state["next_plan"])
    s.plans_made = int(state["plans_made"])
    s.budget = float(state["budget"])
    s.hidden = set(state.get("hidden", ()))
    for i, n in enumerate(s.names):
        c = state["plan"].get(n)
        if c is not None and s.candidates[i] is not None:
            s.plan[i] = Candidate.from_list(c)
    index = {n: i for i, n in enumerate(s.names)}
    s._errors = None if state["errors"] is None else \
        {index[n]: v for n, v in state["errors"].items() if n in index}
    # Format 1 kept summed gradients, not measurements: its window starts over.
    s._sums = {k: list(v) for k, v in state.get("sums", {}).items() if k in index}
    s._counts = {k: int(v) for k, v in state.get("counts", {}).items() if k in index}
    if "scorer" in state:
        s.scorer.load_state_dict(state["scorer"])
    s.compensation = {n: Compensation(v) for n, v in
                      state.get("compensation", {}).items() if n in index}
