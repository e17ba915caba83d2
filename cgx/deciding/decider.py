"""The deciding exchange: the model proposes, trials measure, the fastest plan within the
error budget travels (``Compression.auto(objective="time")``).

:class:`Decider` sits beside auto's :class:`cgx.adaptive.AdaptiveSchedule` (the errors) and
the planner's :class:`cgx.planner.schedule.PlannedSchedule` (the simulated step). After each
of auto's plans it asks both for proposals (:mod:`cgx.deciding.proposals`), starts a round
of trials (:mod:`cgx.deciding.trials`) and, at every step, says which plan travels. When the
kept plan's measured step drifts, the planner measures the link again and a new round
starts from the same errors.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from cgx.compression.auto import AutoCompression
from cgx.planner.calibration import link_probe
from cgx.deciding.proposals import (error_budget, plan_from_lists, plan_to_lists, propose,
                                    select)
from cgx.deciding.trials import Event, Phase, Trials, agree_max, format_trials

STATE_FORMAT = 1


def _mark(timeline, name: str, args: dict) -> None:
    if timeline is not None and timeline.enabled:
        timeline.instant(name, row="decider", args=args)


class Decider:
    """Which whole-exchange plan travels at each step, decided by trials.

    Args:
        adaptive: auto's schedule (errors per layer and candidate, the budget).
        planned: the planner's schedule (ready times, link and quantizer model).
        settings: the ``Compression.auto(objective="time", ...)`` settings.
    """

    def __init__(self, adaptive, planned, settings: AutoCompression):
        self.adaptive, self.planned, self.settings = adaptive, planned, settings
        self.trials = Trials(settings.trials)
        self.plans: list[list] = []  # per record of the round, its plan
        self.fewest: list = list(adaptive.plan)  # auto's fewest-bytes plan of its last errors

    def replanned(self, step: int, transport, verbose: bool = False, timeline=None,
                  since: Optional[float] = None) -> None:
        """Auto and the planner just re-planned (every rank, same step; ``since``: when they
        started): auto's plan is the fewest-bytes one of the new errors; a new round."""
        self.fewest = list(self.adaptive.plan)
        self.propose(step, transport, verbose, timeline, since)

    def propose(self, step: int, transport, verbose: bool = False, timeline=None,
                since: Optional[float] = None) -> None:
        """A new round from the latest errors and the planner's latest plan (``since``: when
        the planner started, for the round's setup time)."""
        since = time.perf_counter() if since is None else since
        proposals = propose(self.adaptive, self.planned, self.fewest, transport.size,
                            self.planned.family)
        chosen = select(proposals, self.settings.model_plans, self.trials.predicted)
        self.plans = [p.plan for p in chosen]
        self.trials.begin(step, [p.record for p in chosen], error_budget(self.adaptive),
                          link_probe(transport, reps=3),
                          agree_max([time.perf_counter() - since], transport)[0])
        _mark(timeline, "trials", {"step": step, "plans": [p.record.label for p in chosen]})
        if verbose and transport.rank == 0:
            print(f"cgx: step {step}: trying {len(chosen)} exchange plans for "
                  f"{self.settings.trials.steps} steps each: "
                  + ", ".join(p.record.label for p in chosen), file=sys.stderr, flush=True)

    def tick(self, step: int, transport, verbose: bool = False, timeline=None) -> None:
        """At the first reduction of ``step`` (every rank): time the last step, end a round or
        re-try when due."""
        event = self.trials.tick(step, time.perf_counter(), transport,
                                 probe=lambda: link_probe(transport, reps=2))
        if event is Event.DECIDED:
            self._report(step, transport, verbose, timeline)
        elif event is Event.RETRIAL:
            if verbose and transport.rank == 0:
                print(f"cgx: step {step}: the kept plan's step or the link moved since the "
                      "trials; measuring the link again", file=sys.stderr, flush=True)
            since = time.perf_counter()
            self.planned.replan(transport, False, step=step, timeline=timeline)
            self.propose(step, transport, verbose, timeline, since)

    def plan_now(self, step: int, timeline=None) -> Optional[list]:
        """The plan that travels at ``step`` (None: no round yet, auto's own); a plan's first
        step of its turn is marked on the timeline."""
        k = self.trials.plan_at(step)
        if self.trials.phase is Phase.TRIAL and step == self.trials.turn_start:
            _mark(timeline, "trial", {"step": step, "plan": self.trials.records[k].label})
        return None if k is None else self.plans[k]

    def _report(self, step: int, transport, verbose: bool, timeline) -> None:
        t = self.trials
        kept = t.records[t.chosen]
        _mark(timeline, "decided", {"step": step, "plan": kept.label,
                                    "measured_ms": 1e3 * (kept.measured_s or 0.0)})
        if verbose and transport.rank == 0:
            print(f"cgx: step {step}: kept '{kept.label}' after trials\n"
                  + format_trials(t.records, t.chosen), file=sys.stderr, flush=True)

    def rounds(self) -> list[dict]:
        """Every finished round: its first step (``start``), the step it decided at
        (``step``), the error ``budget``, the kept plan's label (``chosen``) and the plans
        tried (``plans``: label, kind, bytes, error, predicted and measured step, within
        the budget)."""
        return [dict(r) for r in self.trials.history]

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        names = self.adaptive.names
        return {"format": STATE_FORMAT, "trials": self.trials.state_dict(),
                "plans": [plan_to_lists(p, names) for p in self.plans],
                "fewest": plan_to_lists(self.fewest, names)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"expected a decider state of format {STATE_FORMAT} (from "
                             "state_dict())")
        self.trials.load_state_dict(state["trials"])
        names = self.adaptive.names
        self.plans = [plan_from_lists(p, names) for p in state["plans"]]
        self.fewest = plan_from_lists(state["fewest"], names)
