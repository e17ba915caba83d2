"""The planned exchange's say on sufficient factors (``sufficient_factors=``): whether a
linear layer's weight gradient travels as its factors, and what the factor layers send.

The functions take the :class:`cgx.policy.planner.schedule.PlannedSchedule` (``s``) whose
factor layers (``s._factor_rows``: the rows each last offered; ``s._factors_planned``: what
the plan chose for them) they read and keep.
"""

from __future__ import annotations

from typing import Optional

from cgx.policy.planner.costs import TensorProfile


def prefer_factors(s, name: str, rows: int, ranks: int, out_features: int,
                   in_features: int) -> bool:
    """The answer of ``PlannedSchedule.prefer_factors``; notes the layer's agreed rows."""
    i = s._position.get(name)
    if i is not None:
        s._factor_rows[i] = int(rows)
    return factors_go(s, name, rows, ranks, out_features, in_features, s.factors_rule)


def factors_go(s, name: str, rows: int, ranks: int, out_features: int,
               in_features: int, rule: Optional[bool]) -> bool:
    """:func:`prefer_factors`'s answer under ``rule`` (None: the plan's)."""
    from cgx.sufficient_factors import worth_it
    i = s._position.get(name)
    if rule is not None:
        return rule and worth_it(rows, ranks, out_features, in_features)
    if i is not None:
        planned = s._factors_planned.get(i)
        if planned is not None and planned[0] == rows:
            return planned[1]
    if s.cost is None:
        return worth_it(rows, ranks, out_features, in_features)
    return _factors_alone_win(s, i, name, rows, out_features, in_features)


def _factors_alone_win(s, i: Optional[int], name: str, rows: int, out_features: int,
                       in_features: int) -> bool:
    """Whether the factors' allgather and rebuild beat the layer's other options, each
    standing alone in the last plan's cost model."""
    from cgx.policy.planner.costs import OptionMaker
    from cgx.policy.planner.simulator import group_cost
    fams = ["exact", "sfb"]
    if i is None or s.eligible[i] is not None:
        fams.append(s.family)
    t = TensorProfile(name, out_features * in_features, 0.0, (out_features, in_features),
                      rows)
    times = {}
    for o in OptionMaker(s.cost, (s.settings.bits,), fams)(t):
        g = group_cost([0], [t], [o], s.cost)  # the option standing alone
        times[o.name] = g.compress + g.comm + g.decompress
    return "sfb" in times and times["sfb"] < min(t for k, t in times.items() if k != "sfb")


def factor_sends(s, say: Optional[bool], world: int) -> dict[int, int]:
    """The factor layers that travel as factors under ``say``, each with the bytes one
    rank sends (see ``PlannedSchedule.factor_sends``)."""
    return {i: (world - 1) * rows * sum(s.shapes[i]) * 4
            for i, rows in s._factor_rows.items() if len(s.shapes[i]) == 2
            and factors_go(s, s.names[i], rows, world, *s.shapes[i], say)}
