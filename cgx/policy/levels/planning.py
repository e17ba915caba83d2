"""Plans from a window's measurements: the budget, each candidate's traffic, the knapsack
(:mod:`.solver`) over the measured layers, and what a plan would send or cost in error.

The functions take the :class:`cgx.policy.levels.schedule.AdaptiveSchedule` (``s``) whose
plan they make (``s.plan``, ``s.budget``, ``s.world``) and whose last plan's errors
(``s._errors``) and traffic tables (``s._traffic``) they keep.
"""

from __future__ import annotations

import math
import sys
from typing import Optional, Sequence

from cgx.policy.levels import probing, report, sampling, stats
from cgx.policy.levels.candidates import Candidate, Family, traffic_factor
from cgx.policy.levels.solver import solve

EXACT = Candidate(Family.EXACT)


def replan(s, step: int, transport, verbose: bool = False,
           hidden: Sequence[int] = ()) -> bool:
    """Make the next plan (see ``AdaptiveSchedule.replan``). Returns True when it changed."""
    s.hidden = {s.names[i] for i in hidden}
    planned = [i for i, c in enumerate(s.candidates) if c is not None]
    names = [s.names[i] for i in planned]
    errors = stats.combine([s._sums.get(n, [0.0] * len(s.candidates[i]))
                            for n, i in zip(names, planned)],
                           [s._counts.get(n, 0) for n in names], transport)
    old = list(s.plan)
    measured = [(i, e) for i, e in zip(planned, errors) if e is not None]
    for i, e in zip(planned, errors):
        if e is None and s.names[i] in s.hidden:
            s.plan[i] = Candidate(Family.EXACT)
    if measured:
        solve_layers(s, [i for i, _ in measured], [e for _, e in measured], transport.size)
    probing.decide_compensation(s, planned, transport)
    s.plans_made += 1
    sampling.clear_window(s)
    s.next_plan = step + s.settings.adjust_every
    changed = old != s.plan
    if verbose and changed and transport.rank == 0:
        print(f"[cgx] compression plan {s.plans_made} at step {step}:\n"
              + report.format_levels(s.rows()), file=sys.stderr, flush=True)
    return changed


def solve_layers(s, layers: list, errors: list, world: int) -> None:
    """The knapsack over ``layers`` (their combined ``errors``); sets their plan."""
    choice, s.budget, costs = solution(s, layers, errors, world, s.hidden)
    for i, j in zip(layers, choice):
        s.plan[i] = s.candidates[i][j]
    s.world = world
    s._errors = {**(s._errors or {}),
                 **{i: (errors[k], list(costs[k])) for k, i in enumerate(layers)}}


def solution(s, layers: list, errors: list, world: int, hidden) -> tuple:
    """``(choice per layer, budget, costs)``: the fewest bytes within the budget, the
    layers named in ``hidden`` exact."""
    table = s.traffic_table(world)
    costs = [table[i] for i in layers]
    ref = [s._position[i][s.reference[i]] for i in layers]
    budget = s.settings.alpha * sum(e[j] for e, j in zip(errors, ref))
    for k, i in enumerate(layers):
        if s.names[i] in hidden:  # only exact is offered, and it costs nothing
            j = s._position[i][EXACT]
            costs[k] = [0.0 if jj == j else math.inf for jj in range(len(costs[k]))]
    result = solve(costs, errors, budget, reference=None if hidden else ref)
    return result.choice, budget, costs


def traffic_table(s, world: int) -> list:
    """Per layer (None: not planned), the bytes each candidate sends per step with
    ``world`` ranks, once per world size (see ``AdaptiveSchedule.traffic_table``)."""
    table = s._traffic.get(world)
    if table is None:
        factor = {f: traffic_factor(f, world) for f in Family}
        table = s._traffic[world] = [
            None if cands is None else [factor[c.family] * b for c, b in zip(cands, wire)]
            for cands, wire in zip(s.candidates, s._wire)]
    return table


def plan_bytes(s, plan: Sequence, world: int) -> int:
    """Bytes one rank sends per step with ``plan`` (None: exact)."""
    table, total = s.traffic_table(world), 0.0
    for i, c in enumerate(plan):
        c = c or EXACT
        j = s._position[i].get(c) if s._position[i] is not None else None
        total += table[i][j] if j is not None else c.traffic(s.shapes[i], world)
    return int(total)


def alternative(s, hidden: Sequence[int], base: Optional[Sequence] = None) -> list:
    """The plan the last window's measurements give with ``hidden`` kept exact."""
    plan = list(s.plan if base is None else base)
    if not s._errors or not hidden:
        return plan
    layers = sorted(s._errors)
    names = {s.names[i] for i in hidden}
    choice, _, _ = solution(s, layers, [s._errors[i][0] for i in layers], s.world, names)
    for i, j in zip(layers, choice):
        plan[i] = s.candidates[i][j]
    return plan


def plan_error(s, plan: Sequence) -> float:
    """The summed measured error of ``plan`` over the measured layers."""
    total = 0.0
    for i, (errs, _) in (s._errors or {}).items():
        j = s._position[i].get(plan[i] if plan[i] is not None else EXACT)
        if j is not None:
            total += errs[j]
    return total


def measured_error(s, i: int, c: Candidate) -> Optional[float]:
    """Layer ``i``'s measured error with candidate ``c`` in the last plan's window."""
    pos = s._position[i]
    row = (s._errors or {}).get(i)
    if row is None or pos is None or c not in pos:
        return None
    return row[0][pos[c]]
