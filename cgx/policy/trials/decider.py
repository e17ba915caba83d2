"""Which whole-exchange plan travels, decided by trials: the model proposes, the step clock
decides (``Compression.auto(objective="time")`` and ``Compression.planned()``).

:class:`TrialDecider` runs the rounds for any source of proposals: it starts a round from
the proposals, says at every step which plan travels, reports the decision, and when the
kept plan's measured step or the link drifts, has the planner measure the link again and
starts a new round. :class:`Decider` is auto's: it sits beside
:class:`cgx.policy.levels.AdaptiveSchedule` (the errors) and the planner's
:class:`cgx.policy.planner.schedule.PlannedSchedule` (the simulated step) and asks both for
proposals (:mod:`cgx.policy.trials.proposals`) after each of auto's plans.
:class:`cgx.policy.trials.planned_decider.PlannedDecider` is the planned mode's (time only).
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from cgx.compression.auto_policy import AutoCompression
from cgx.compression.trial_settings import TrialSettings
from cgx.policy.planner.calibration import link_probe
from cgx.policy.trials.proposals import (Proposal, error_budget, plan_from_lists, plan_to_lists,
                                    propose, select)
from cgx.policy.trials.rounds import Event, Phase, Trials, agree_max, format_trials

STATE_FORMAT = 1


def _mark(timeline, name: str, args: dict) -> None:
    if timeline is not None and timeline.enabled:
        timeline.instant(name, row="decider", args=args)


class TrialDecider:
    """Rounds of trials over the plans a subclass proposes (:meth:`proposals`).

    Args:
        planned: the planner's schedule (it re-measures the link before a new round).
        settings: how long plans are tried and how the kept one is watched.
    """

    def __init__(self, planned, settings: TrialSettings):
        self.planned = planned
        self.trials = Trials(settings)
        self.plans: list[list] = []  # per record of the round, its plan
        self.factors: list = []  # and its say on the factor layers (Proposal.factors)

    # -- what a subclass provides ---------------------------------------------------------
    def proposals(self, transport) -> tuple[list[Proposal], float]:
        """The round's plans, likely fastest first, and the error budget they were held to."""
        raise NotImplementedError

    def plan_state(self, plan: list):
        """A plan as plain values (checkpoints)."""
        return list(plan)

    def plan_from_state(self, saved) -> list:
        return list(saved)

    # -- the rounds -------------------------------------------------------------------------
    def propose(self, step: int, transport, verbose: bool = False, timeline=None,
                since: Optional[float] = None) -> None:
        """A new round from the latest proposals (``since``: when the planner started, for
        the round's setup time)."""
        since = time.perf_counter() if since is None else since
        chosen, budget = self.proposals(transport)
        self.plans = [p.plan for p in chosen]
        self.factors = [p.factors for p in chosen]
        self.trials.begin(step, [p.record for p in chosen], budget,
                          link_probe(transport, reps=3),
                          agree_max([time.perf_counter() - since], transport)[0])
        _mark(timeline, "trials", {"step": step, "plans": [p.record.label for p in chosen]})
        if verbose and transport.rank == 0:
            print(f"cgx: step {step}: trying {len(chosen)} exchange plans for "
                  f"{self.trials.settings.steps} steps each: "
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
        """The plan that travels at ``step`` (None: no round yet, the mode's own); a plan's
        first step of its turn is marked on the timeline."""
        k = self.trials.plan_at(step)
        if self.trials.phase is Phase.TRIAL and step == self.trials.turn_start:
            _mark(timeline, "trial", {"step": step, "plan": self.trials.records[k].label})
        return None if k is None else self.plans[k]

    def factors_now(self, step: int) -> Optional[bool]:
        """The factor layers' say of the plan that travels at ``step`` (None: the planner's
        per-layer choice)."""
        k = self.trials.plan_at(step)
        return None if k is None else self.factors[k]

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
        (``step``), the error ``budget``, the kept plan's label (``chosen``), the plans
        tried (``plans``: label, kind, bytes, error, predicted and measured step, steps
        timed, within the budget), their turns in order (``turns``: indices into
        ``plans``, a runoff's included), the runoff passes (``runoffs``) and the measured
        steps' relative spread (``step_noise``, which widens the tie and runoff margins)."""
        return [dict(r) for r in self.trials.history]

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "trials": self.trials.state_dict(),
                "plans": [self.plan_state(p) for p in self.plans], "factors": list(self.factors)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"expected a decider state of format {STATE_FORMAT} (from "
                             "state_dict())")
        self.trials.load_state_dict(state["trials"])
        self.plans = [self.plan_from_state(p) for p in state["plans"]]
        self.factors = list(state.get("factors", [None] * len(self.plans)))


class Decider(TrialDecider):
    """Auto's decider: which of the plans auto and the planner propose travels.

    Args:
        adaptive: auto's schedule (errors per layer and candidate, the budget).
        planned: the planner's schedule (ready times, link and quantizer model).
        settings: the ``Compression.auto(objective="time", ...)`` settings.
    """

    def __init__(self, adaptive, planned, settings: AutoCompression):
        super().__init__(planned, settings.trials)
        self.adaptive, self.settings = adaptive, settings
        self.fewest: list = list(adaptive.plan)  # auto's fewest-bytes plan of its last errors

    def replanned(self, step: int, transport, verbose: bool = False, timeline=None,
                  since: Optional[float] = None) -> None:
        """Auto and the planner just re-planned (every rank, same step; ``since``: when they
        started): auto's plan is the fewest-bytes one of the new errors; a new round."""
        self.fewest = list(self.adaptive.plan)
        self.propose(step, transport, verbose, timeline, since)

    def proposals(self, transport) -> tuple[list[Proposal], float]:
        proposals = propose(self.adaptive, self.planned, self.fewest, transport.size,
                            self.planned.family)
        return (select(proposals, self.settings.model_plans, self.trials.predicted),
                error_budget(self.adaptive))

    def plan_state(self, plan: list):
        return plan_to_lists(plan, self.adaptive.names)

    def plan_from_state(self, saved) -> list:
        return plan_from_lists(saved, self.adaptive.names)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "fewest": self.plan_state(self.fewest)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.fewest = self.plan_from_state(state["fewest"])
