"""A plan of the planned exchange: the agreed profile, the ready times less the exchange's
own CPU work where it shared the cores, the planner's per-tensor choice and what it implies
for the factor layers.

:func:`replan` takes the :class:`cgx.policy.planner.schedule.PlannedSchedule` (``s``)
whose plan (``s.chosen``, ``s.cost``, ``s.plan``, ``s.planned_at``) it sets.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Optional, Sequence

from cgx.policy.planner.costs import CostModel, TensorProfile
from cgx.policy.planner.strategy import ExchangePlan, format_exchange, plan
from cgx.policy.planner.tracing import agreed_profile, device_profile, mark


def replan(s, transport, verbose: bool = False, step: Optional[int] = None,
           timeline=None) -> ExchangePlan:
    """Every rank at the same point: agree on the profile, measure, plan."""
    if s.place and s._device is None:
        s._device = device_profile(s.settings, transport)
    ready, cost = agreed_profile(s._ready, s.settings, transport, s._device)
    s.cost = cost
    # A factor layer (its rows seen) has sufficient factors among its options.
    rows = s._factor_rows
    tensors = [TensorProfile(name, math.prod(shape), t, *(
                   (tuple(shape), rows[i]) if i in rows and len(shape) == 2 else ()))
               for i, (name, shape, t) in enumerate(zip(s.names, s.shapes, ready))]
    tensors, backward = _without_own_work(s, tensors, max(ready) if ready else 0.0, cost)
    families = ("exact", s.family) + (("sfb",) if rows else ())
    result = plan(tensors, cost, backward, fusion_mb=(s.fusion_mb,),
                  bits=(s.settings.bits,), families=families,
                  exact_only=[e is None for e in s.eligible])
    _adopt_plan(s, result, step, timeline)
    if verbose:
        print(f"cgx: planned exchange ({sum(s.chosen)} of {len(s.names)} tensors compressed)\n"
              + format_exchange(result, limit=20), file=sys.stderr, flush=True)
    return result


def _without_own_work(s, tensors: list, backward: float, cost: CostModel) -> tuple:
    """``(tensors, backward)`` with the ready times scaled down by the exchange's CPU work
    where it shared the cores with backward."""
    if cost.contention > 0 and backward > 0:
        # The ready times were traced with the exchange then in use running beside
        # backward on the same cores: take its CPU work (in the new model) out of them,
        # or the plan would count it twice. At most half: not all of it overlapped.
        in_use = s.chosen if s.chosen is not None else [e is not None for e in s.eligible]
        busy = cpu_of(s, tensors, in_use, cost)
        scale = max(0.5, 1.0 - busy / backward)
        tensors = [dataclasses.replace(t, ready_s=t.ready_s * scale) for t in tensors]
        backward *= scale
    return tensors, backward


def _adopt_plan(s, result: ExchangePlan, step: Optional[int], timeline) -> None:
    """Take ``result`` as the plan made at ``step``."""
    rows = s._factor_rows
    # A layer planned as factors is still quantized (where the rules allow) on a step
    # whose factors are not a faithful record.
    s.chosen = [e is not None and opt.name != "exact"
                for e, opt in zip(s.eligible, result.chosen)]
    # (A layer the rules keep exact had only that option here: the standalone
    # comparison decides its factors.)
    s._factors_planned = {i: (rows[i], result.chosen[i].name == "sfb") for i in rows
                          if s.eligible[i] is not None}
    s.plan, s._placements = result, None
    mark(timeline, "plan", {"step": step, "predicted_ms": 1e3 * result.step_s,
                            "choices": {t.name: o.name
                                        for t, o in zip(result.tensors, result.chosen)}})
    s.planned_at = step
    s._measured = []


def cpu_of(s, tensors: Sequence[TensorProfile], compressed: Sequence[bool],
           cost: CostModel) -> float:
    """The exchange's CPU work (``Option.cpu_s`` summed) with ``compressed[i]`` per tensor."""
    from cgx.policy.planner.costs import OptionMaker
    make = OptionMaker(cost, (s.settings.bits,), ("exact", s.family))
    total = 0.0
    for t, c in zip(tensors, compressed):
        opts = make(t, s.settings.bucket_size)
        total += (opts[-1] if c else opts[0]).cpu_s
    return total
