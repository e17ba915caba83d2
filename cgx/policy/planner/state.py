"""The planned exchange's checkpoint: its plan and what its drift checks need, as plain
values; a checkpoint of other gradients adopted; an :class:`ExchangePlan` to and from
plain values.

The functions that take ``s`` take the :class:`cgx.policy.planner.schedule.PlannedSchedule`.
"""

from __future__ import annotations

import dataclasses

from cgx.policy.planner.costs import Collective, CostModel, Option, TensorProfile
from cgx.policy.planner.drift import DriftCheck
from cgx.policy.planner.simulator import SimulatedStep
from cgx.policy.planner.strategy import ExchangePlan
from cgx.policy.planner.tracing import pending_measurement

STATE_FORMAT = 1


def state_dict(s) -> dict:
    """See ``PlannedSchedule.state_dict``."""
    return {"format": STATE_FORMAT, "names": list(s.names), "chosen": s.chosen,
            "cost": None if s.cost is None else s.cost.to_dict(),
            "factors": {s.names[i]: [k, f] for i, (k, f) in s._factors_planned.items()},
            "plan": None if s.plan is None else plan_to_dict(s.plan),
            "planned_at": s.planned_at,
            "checks": [dataclasses.asdict(c) for c in s.checks],
            "ratio": s._ratio, "calibrate_ratio": s._calibrate_ratio,
            "ready": [list(r) for r in s._ready],
            "measured": s._measured + pending_measurement(s),
            "trace_from": s._trace_from}


def load_state_dict(s, state: dict) -> None:
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"planned-exchange state of format {state.get('format')!r}; this "
                         f"version reads format {STATE_FORMAT}")
    if state["names"] != s.names:
        adopt(s, state)
        return
    s.chosen = None if state["chosen"] is None else list(state["chosen"])
    cost = state.get("cost")
    s.cost = None if cost is None else CostModel.from_dict(cost)
    # the plan's sufficient-factor choices (absent from checkpoints of older versions)
    s._factors_planned = {s._position[name]: (int(k), bool(f))
                          for name, (k, f) in state.get("factors", {}).items()}
    s._factor_rows = {i: k for i, (k, _) in s._factors_planned.items()}
    # the plan and its drift checks (absent from checkpoints of older versions: those
    # keep the choices, without drift checks)
    saved = state.get("plan")
    s.plan = None if saved is None else plan_from_dict(saved)
    s._placements = None
    s.planned_at = state.get("planned_at")
    s.checks = [DriftCheck(**c) for c in state.get("checks", [])]
    s._ratio = float(state.get("ratio", 1.0))
    s._calibrate_ratio = bool(state.get("calibrate_ratio", False))
    for queue, times in zip(s._ready, state.get("ready", [])):
        queue.clear()
        queue.extend(float(t) for t in times)
    s._measured = [float(t) for t in state.get("measured", [])]
    s._trace_from = state.get("trace_from", 0)
    s._starts, s._end = {}, None


def adopt(s, state: dict) -> None:
    """The state of an exchange of other gradients (this optimizer's, before parameters
    were frozen, unfrozen or added): its plan does not fit them. The machine's model and
    the drift checks so far carry over, and each gradient's ready times by name; this
    set is traced again (the uniform quantized exchange) from the next step, then
    planned. Every rank changes its parameters alike, so every rank does the same."""
    position = {n: i for i, n in enumerate(state["names"])}
    ready = state.get("ready", [])
    for name, queue in zip(s.names, s._ready):
        j = position.get(name)
        queue.clear()
        if j is not None and j < len(ready):
            queue.extend(float(t) for t in ready[j])
    cost = state.get("cost")
    s.cost = None if cost is None else CostModel.from_dict(cost)
    s.checks = [DriftCheck(**c) for c in state.get("checks", [])]
    s.chosen, s.plan, s.planned_at = None, None, None
    s._placements = None
    s._factors_planned, s._factor_rows = {}, {}
    s._ratio, s._calibrate_ratio, s._measured = 1.0, False, []
    s._trace_from = None
    s._starts, s._end = {}, None


def _option_to_list(o: Option) -> list:
    return [o.name, o.compress_s, [[k.value, b] for k, b in o.wire], o.decompress_s,
            o.linear_s, [[n, k.value] for n, k in o.calls], o.cpu_s]


def _option_from_list(v: list) -> Option:
    name, compress_s, wire, decompress_s, linear_s, calls, cpu_s = v
    return Option(name, float(compress_s), tuple((Collective(k), int(b)) for k, b in wire),
                  float(decompress_s), float(linear_s),
                  tuple((n, Collective(k)) for n, k in calls), float(cpu_s))


def plan_to_dict(p: ExchangePlan) -> dict:
    """A :class:`ExchangePlan` as plain values (checkpoints): the inverse of :func:`plan_from_dict`."""
    t = p.timeline
    return {"tensors": [[x.name, x.numel, x.ready_s, None if x.shape is None else list(x.shape),
                         x.rows] for x in p.tensors],
            "options": [[_option_to_list(o) for o in opts] for opts in p.options],
            "choice": list(p.choice), "groups": [list(g) for g in p.groups],
            "fusion_bytes": p.fusion_bytes,
            "timeline": [t.step_s, t.backward_s, t.tail_s, [list(g) for g in t.groups], t.cpu_s],
            "model": p.model.to_dict(), "backward_s": p.backward_s, "tail_s": p.tail_s,
            "decision_s": p.decision_s}


def plan_from_dict(d: dict) -> ExchangePlan:
    step_s, backward_s, tail_s, spans, cpu_s = d["timeline"]
    return ExchangePlan(
        tensors=[TensorProfile(name, int(numel), float(ready),
                               None if shape is None else tuple(shape), rows)
                 for name, numel, ready, shape, rows in d["tensors"]],
        options=[[_option_from_list(o) for o in opts] for opts in d["options"]],
        choice=[int(c) for c in d["choice"]], groups=[list(g) for g in d["groups"]],
        fusion_bytes=float(d["fusion_bytes"]),
        timeline=SimulatedStep(float(step_s), float(backward_s), float(tail_s),
                               tuple(tuple(g) for g in spans), float(cpu_s)),
        model=CostModel.from_dict(d["model"]), backward_s=float(d["backward_s"]),
        tail_s=float(d["tail_s"]), decision_s=float(d["decision_s"]))
