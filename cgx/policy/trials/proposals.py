"""What the model proposes for a round of trials: whole-exchange plans with their bytes,
measured error and simulated step.

A plan is one :class:`cgx.policy.levels.candidates.Candidate` (or None: not planned, exact)
per gradient. The proposals of one round:

- ``exact``: every gradient exact, in fused buckets (what DDP does);
- ``uniform``: the uniform default level wherever the rules allow (what fixed 4-bit does);
- ``planner``: the planner's choice (:mod:`cgx.policy.planner`): the uniform level where compressing
  shortens the simulated step, exact where the exchange hides under backward;
- ``fewest bytes``: auto's knapsack (:mod:`cgx.policy.levels`): the fewest bytes within the error
  budget, every family offered;
- ``planner + fewest bytes``: the knapsack with the planner's exact tensors kept exact, their
  share of the budget spent on the others;
- ``16-bit``: every gradient cast to 16 bits in fused buckets (what DDP's fp16/bf16 hooks
  send), each layer by the cast it lost least to (fp16, unless a value overflowed it);
- ``planner, 16-bit for exact``: the planner's choice with its exact tensors cast to 16 bits;
- with sufficient-factor layers (``sufficient_factors=``), ``uniform ..., factors`` and
  ``uniform ..., no factors``: the uniform plan with every factor layer sent as factors
  (where Poseidon's byte rule allows) and with none. Every other plan sends them as the
  planner chose per layer.

In every plan a layer that travels as factors counts their bytes and no error (factors
rebuild the average exactly).

The 16-bit plans are proposed when the casts are among the families (by default with
``objective="time"``).

Each plan's error is the sum of its layers' measured errors (auto's table, combined over
ranks), its step the planner's simulation of it (its timeline, the calibrated link and
quantizer, the CPU the exchange takes from backward), both agreed on every rank: every rank
proposes the same plans.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from cgx.policy.levels.candidates import CASTS, Candidate, Family
from cgx.policy.trials.rounds import PlanRecord
from cgx.policy.planner.costs import Collective, OptionMaker
from cgx.policy.planner.simulator import simulate


@dataclasses.dataclass
class Proposal:
    """A plan and its record (label, kind, bytes, error, predicted step)."""

    record: PlanRecord
    plan: list  # a Candidate or None per gradient
    factors: Optional[bool] = None  # factor layers: True every one Poseidon's byte rule
    # allows, False none, None the planner's per-layer choice


def _option(c: Optional[Candidate], t, makers: dict, world: int):
    """The planner's option for candidate ``c`` of tensor ``t``."""
    m = makers["exact"]
    if c is None or c.family is Family.EXACT:
        return m(t)[0]
    if c.family in CASTS:  # the planner's fp16 option: a cast each way, 2 bytes a value
        if "cast" not in makers:
            makers["cast"] = OptionMaker(m.m, (4,), ("exact", "fp16"))
        return makers["cast"](t)[-1]
    if c.family is Family.QUANTIZE:
        key = ("q", c.bits)
        if key not in makers:
            makers[key] = OptionMaker(m.m, (c.bits,), ("exact", makers["family"]))
        return makers[key](t, c.bucket_size)[-1]
    kind = Collective.ALLGATHER if c.family is Family.TOPK else Collective.ALLREDUCE
    shape = t.shape if t.shape is not None else (t.numel,)
    return m.payload(c.label, t, int(c.traffic(shape, world)), kind)


def predicted_step(plan: Sequence, exchange, family: str = "sra") -> float:
    """The simulated step of ``plan`` on the planner's last exchange plan (its tensors,
    fusion groups, cost model, backward and tail)."""
    model = exchange.model
    makers = {"exact": OptionMaker(model, (4,), ("exact", family)), "family": family}
    options = [_option(c, t, makers, model.world) for c, t in zip(plan, exchange.tensors)]
    return simulate(exchange.tensors, options, exchange.groups, model, exchange.backward_s,
                    exchange.tail_s).step_s


def plan_bytes(plan: Sequence, shapes: Sequence, world: int) -> int:
    """Bytes one rank sends per step with ``plan``."""
    exact = Candidate(Family.EXACT)
    return int(sum((c or exact).traffic(s, world) for c, s in zip(plan, shapes)))


def distinct(plans):
    """``(label, kind, plan[, factors])`` in order, leaving out a plan already proposed under
    another label (the first label names it)."""
    seen = []
    for label, kind, plan, *factors in plans:
        key = (plan, factors)
        if key not in seen:
            seen.append(key)
            yield label, kind, plan, *factors


def with_factors(adaptive, plan: Sequence, sends: dict, world: int) -> tuple[int, float]:
    """``plan``'s bytes and error with the layers of ``sends`` (index: bytes, from
    :meth:`cgx.policy.planner.schedule.PlannedSchedule.factor_sends`) sent as factors."""
    exact = Candidate(Family.EXACT)
    masked = [exact if i in sends else c for i, c in enumerate(plan)]
    moved = sum(exact.traffic(adaptive.shapes[i], world) for i in sends)
    return (int(adaptive.plan_bytes(masked, world) - moved + sum(sends.values())),
            adaptive.plan_error(masked))


def factor_variants(uniform_label: str, uniform: list, planned) -> list:
    """With sufficient-factor layers, the uniform plan with every factor layer as factors
    where they send fewer bytes, and with none: which pays is measured, not modelled
    (the planner's per-layer choice travels in every other plan)."""
    if not planned.has_factor_layers():
        return []
    return [(uniform_label + ", factors", "uniform", uniform, True),
            (uniform_label + ", no factors", "uniform", uniform, False)]


def sixteen_bit(adaptive, i: int) -> Optional[Candidate]:
    """Layer ``i``'s 16-bit cast with the smaller measured error (fp16 first among equals;
    None: no cast offered, not measured, or every cast overflowed)."""
    best, best_error = None, math.inf
    for f in CASTS:
        error = adaptive.measured_error(i, Candidate(f))
        if error is not None and error < best_error:
            best, best_error = Candidate(f), error
    return best


def error_budget(adaptive) -> float:
    """``alpha`` times the uniform default's measured error: what no kept plan exceeds."""
    return adaptive.settings.alpha * adaptive.plan_error(adaptive.reference)


def propose(adaptive, planned, fewest: Sequence, world: int,
            family: str = "sra") -> list[Proposal]:
    """The round's plans (see the module doc), duplicates dropped, each with its record.

    ``adaptive``: the :class:`cgx.policy.levels.AdaptiveSchedule` (its measured errors);
    ``planned``: the :class:`cgx.policy.planner.schedule.PlannedSchedule` just re-planned (its
    ``chosen`` and ``plan``); ``fewest``: auto's fewest-bytes plan of the same errors."""
    exact = Candidate(Family.EXACT)
    uniform = list(adaptive.reference)
    time_plan = [ref if (ref is not None and chosen) else (None if ref is None else exact)
                 for ref, chosen in zip(uniform, planned.chosen)]
    hidden = [i for i, c in enumerate(planned.chosen)
              if not c and adaptive.candidates[i] is not None]
    plans = [("exact (fused)", "exact", [None if c is None else exact for c in uniform]),
             ("uniform " + adaptive.default.label, "uniform", uniform),
             ("planner", "model", time_plan),
             ("fewest bytes", "model", list(fewest)),
             ("planner + fewest bytes", "model", adaptive.alternative(hidden, fewest))]
    plans += factor_variants(plans[1][0], uniform, planned)
    casts = [sixteen_bit(adaptive, i) for i in range(len(uniform))]
    if any(c is not None for c in casts):
        plans += [("16-bit", "model", [c or ref for c, ref in zip(casts, uniform)]),
                  ("planner, 16-bit for exact", "model",
                   [c if (p == exact and c is not None) else p
                    for c, p in zip(casts, time_plan)])]
    budget = error_budget(adaptive)
    out = []
    for label, kind, plan, *factors in distinct(plans):
        sends = planned.factor_sends(factors[0] if factors else None, world)
        nbytes, error = with_factors(adaptive, plan, sends, world)
        record = PlanRecord(label, kind, nbytes, error,
                            predicted_step(plan, planned.plan, family),
                            eligible=kind == "exact" or error <= budget * (1 + 1e-9))
        out.append(Proposal(record, plan, *factors))
    return out


def select(proposals: Sequence[Proposal], model_plans: int, corrected) -> list[Proposal]:
    """What a round tries: the two baselines (when within the budget) and the
    ``model_plans`` model plans within the budget with the shortest corrected predicted
    step (``corrected(record)``: the prediction times what earlier rounds measured), in
    the order of that prediction: the likely fastest first, so that a plan that cannot win
    is seen early and its turn cut short (:data:`cgx.policy.trials.rounds.CUT`)."""
    base = [p for p in proposals if p.record.kind != "model" and p.record.eligible]
    model = sorted((p for p in proposals if p.record.kind == "model" and p.record.eligible),
                   key=lambda p: corrected(p.record))
    chosen = base + model[:model_plans]
    for p in chosen:
        p.record.predicted_s = corrected(p.record)
    return sorted(chosen, key=lambda p: p.record.predicted_s)


def plan_to_lists(plan: Sequence, names: Sequence[str]) -> dict:
    """A plan as plain values by gradient name (checkpoints)."""
    return {n: c.as_list() for n, c in zip(names, plan) if c is not None}


def plan_from_lists(saved: dict, names: Sequence[str]) -> list:
    return [Candidate.from_list(saved[n]) if n in saved else None for n in names]
