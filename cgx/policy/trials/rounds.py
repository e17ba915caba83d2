"""Trials: the model proposes a few exchange plans, the step clock decides between them.

Timeline (``K`` plans, ``s`` = settle_steps, ``m`` = steps per plan)::

    step t0                 a round starts: the plan in use travels on for ``w`` steps
                            (warmup_steps), then plan 0
    plan k's turn           its first ``s`` steps are not measured (the switch: residuals
                            handed over, new buffers), the next ``m`` are, each step's time
                            agreed by the ranks (the slowest rank's) as it ends; a turn ends
                            early when ``CUT_STEPS`` measured steps in a row are over
                            ``1 + CUT`` times the best plan's median so far (it cannot win;
                            a slow link's exact plan costs two measured steps, not ``m``;
                            one slow step is not enough: a pause of the training loop's own
                            between two steps, an evaluation or a checkpoint, lands in one
                            step's interval)
    runoffs                 when two or more plans measured within ``runoff_margin`` of
                            the fastest (or within what the clock resolves: the step
                            spread measured in the round, RESOLUTION_Z), they take another
                            turn each (the reverse order
                            of the pass before: a drift of the machine over the round
                            weighs on both ends alike), their times pooled with the
                            first; later passes only for the plans the clock still
                            cannot tell from the fastest (within ``tie_tolerance`` or
                            the resolution); ``runoffs`` passes at most
    after the last turn     every rank at its first reduction: the fastest plan's median
                            within the error budget is kept (ties, within
                            ``tie_tolerance`` or the clock's resolution: less error, then
                            fewer bytes; :func:`choose`); from this
                            step on it travels
    every ``recheck_every`` steps after: the kept plan's median since the last check is
                            agreed; off its trial time by more than ``drift_tolerance``,
                            a new round starts (a link made slower or faster, a new phase
                            of training)

A step's time is the interval between the first reductions of two consecutive steps on
the engine thread: everything a step costs (forward, backward, the exchange's own CPU
work competing with it, the optimizer), not only what the model sees. Every rank calls
:meth:`Trials.tick` at the same steps and decides from agreed values, so every rank keeps
the same plan.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from typing import Optional, Sequence

import torch

from cgx.compression.trial_settings import TrialSettings

STATE_FORMAT = 1
# A link probe this much slower or faster (relative) than at the decision starts a new round:
# the kept plan's own step may hardly move when the link changes (a compressed plan's step
# is mostly compute and compression), but which plan is fastest does. Only a change worth
# LINK_FLOOR of the kept plan's step counts (a fast link's probe is a millisecond or two,
# and its jitter as large).
LINK_CHANGE, LINK_FLOOR = 0.5, 0.2
# A plan whose last CUT_STEPS measured steps are each this much slower (relative) than the
# best median so far ends its turn early. One such step does not: the interval between two
# steps' first reductions also holds whatever the training loop does between them (an
# evaluation every few steps, logging, a checkpoint), and a plan cut on that one step would
# be judged on it alone. Two in a row are the plan's own.
CUT, CUT_STEPS = 0.5, 2
# Two plans' medians closer than RESOLUTION_Z standard errors of their difference are more
# than the clock can tell apart here: the steps' spread is measured in the round (pooled
# over its plans: the machine's noise is common to them), and the tie and runoff margins
# widen to it. On 2 shared cores a step's time spreads by 5-15%; three steps a plan then
# cannot tell 10% apart, and a compressed plan kept on such a difference costs accuracy
# for nothing (the LM at fast links: a plan measured 16% faster on 3 steps, kept, ended
# 0.5% above fp32's loss).
RESOLUTION_Z = 1.0


class Phase(enum.Enum):
    IDLE = "idle"  # no round yet (the model has not proposed)
    TRIAL = "trial"  # plans take turns
    DECIDED = "decided"  # the kept plan travels; checked every recheck_every steps


class Event(enum.Enum):
    """What :meth:`Trials.tick` did at a step."""

    NONE = "none"
    DECIDED = "decided"  # the round ended: :attr:`Trials.chosen` travels from this step
    RETRIAL = "retrial"  # the kept plan drifted: the caller proposes and starts a new round


@dataclasses.dataclass
class PlanRecord:
    """One proposed plan of a round: what the model says of it, and what the clock said.

    ``kind``: "exact" (nothing compressed), "uniform" (the uniform default level) or
    "model" (a plan the model proposed); the learned corrections are per kind.
    ``error``: the plan's compression error (the error budget's units); ``eligible``:
    within the budget. ``measured_s``: the agreed median step, once tried.
    """

    label: str
    kind: str
    bytes: int
    error: float
    predicted_s: float
    eligible: bool = True
    measured_s: Optional[float] = None
    samples: int = 0  # measured steps behind measured_s (every turn of the round)

    @property
    def compressed(self) -> bool:
        return self.kind != "exact"


def step_noise(samples: Sequence[Sequence[float]]) -> float:
    """The relative standard deviation of one measured step, pooled over plans and robust
    to a step that holds something else (an evaluation, a checkpoint): the median, over
    every two consecutive steps of a plan, of their difference over the plan's median
    step, divided by 0.9539 (sqrt(2) x 0.6745: that median for normal steps); 0 when no
    plan has two steps."""
    diffs = []
    for t in samples:
        if len(t) < 2:
            continue
        mid = statistics.median(t)
        if mid > 0:
            diffs += [abs(b - a) / mid for a, b in zip(t, t[1:])]
    return statistics.median(diffs) / 0.9539 if diffs else 0.0


def resolution(noise: float, n_a: int, n_b: int) -> float:
    """The relative difference of two plans' medians (of ``n_a`` and ``n_b`` steps) that
    the clock resolves at step spread ``noise``: ``RESOLUTION_Z`` standard errors of the
    difference (a median's standard error is 1.2533 sigma / sqrt(n))."""
    if noise <= 0 or n_a < 1 or n_b < 1:
        return 0.0
    return RESOLUTION_Z * 1.2533 * noise * math.sqrt(1.0 / n_a + 1.0 / n_b)


def margin(floor: float, noise: float, n_a: int, n_b: int) -> float:
    """How far apart two plans' medians (of ``n_a`` and ``n_b`` steps) still tie: ``floor``
    (a tie or runoff tolerance), or what the clock cannot resolve when that is wider."""
    return max(floor, resolution(noise, n_a, n_b))


def choose(records: Sequence[PlanRecord], tie_tolerance: float, noise: float = 0.0) -> int:
    """The index of the fastest measured plan within the budget; among plans within
    ``tie_tolerance`` of it (or within what the clock resolves at the round's step spread
    ``noise``, :func:`resolution`, when wider), the one with the smallest error, then the
    one sending fewest bytes (then the first).

    Error before bytes: when the clock cannot tell two plans apart, the one that loses
    less of the gradient reaches a given loss in as many steps or fewer, and the time to
    that loss is what the deciding objective is about (on the LM, a 4-bit plan that tied
    exact in its trial needed 130 steps to the target where exact needed 120). The
    planned mode's plans carry no error: bytes break its ties."""
    pool = [k for k, r in enumerate(records) if r.eligible and r.measured_s is not None]
    if not pool:
        raise ValueError("no plan of the round is within the error budget and measured; the "
                         "exact plan always is: propose it")
    fastest = min(pool, key=lambda k: records[k].measured_s)
    best, n = records[fastest].measured_s, records[fastest].samples
    ties = [k for k in pool if records[k].measured_s <= best * (
        1 + margin(tie_tolerance, noise, n, records[k].samples))]
    return min(ties, key=lambda k: (records[k].error, records[k].bytes, k))


class Trials:
    """The rounds of trials of one exchange, and the plan they keep (see the module doc)."""

    def __init__(self, settings: TrialSettings):
        self.settings = settings
        self.phase = Phase.IDLE
        self.records: list[PlanRecord] = []
        self.start: Optional[int] = None  # first step of the current (or last) round
        self.order: list[int] = []  # the records' turns in this round, runoffs appended
        self.pos = 0  # the turn now: order[pos] (the record whose turn it is: current)
        self.turn_start: Optional[int] = None  # the first step of its turn
        self.turn_base = 0  # its measured steps from earlier turns of the round
        self.runoffs = 0  # runoff passes this round
        self.chosen: Optional[int] = None  # index into records of the kept plan
        self.decided_at: Optional[int] = None
        self.rounds = 0
        self.history: list[dict] = []  # one summary per finished round
        # learned measured/predicted per plan kind (1.0 until measured)
        self.corrections: dict[str, float] = {}
        self.budget = 0.0  # the current round's error budget
        self.link_s: Optional[float] = None  # the link probe at the decision
        self.round_link: Optional[float] = None  # the link probe as the round started
        self.setup_s = 0.0  # seconds the round's proposals took (planner, errors, solver)
        self.checks: list[dict] = []  # every check of a kept plan (step, ratios, retrial)
        self._times: list[list[float]] = []  # this rank's measured steps per record
        self._since_check: list[float] = []  # the kept plan's steps since the last check
        self._last: Optional[tuple[int, float]] = None  # (step, start time) of the latest

    # -- which plan travels ----------------------------------------------------------
    def begin(self, step: int, records: Sequence[PlanRecord], budget: float = 0.0,
              link_s: Optional[float] = None, setup_s: float = 0.0) -> None:
        """Start a round at ``step`` with ``records`` (every rank the same list); ``budget``:
        the error budget they were checked against (kept in the history); ``link_s``: the
        link probe now (a round across a link change is run again); ``setup_s``: what making
        the proposals took (kept in the history)."""
        self.round_link, self.setup_s = link_s, float(setup_s)
        if not records:
            raise ValueError("a round of trials needs at least one plan")
        self.budget = float(budget)
        self.phase, self.start, self.records = Phase.TRIAL, int(step), list(records)
        self.order, self.pos, self.runoffs = list(range(len(self.records))), 0, 0
        self.turn_start, self.turn_base = int(step) + self.settings.warmup_steps, 0
        self.chosen, self.decided_at = None, None
        self._times = [[] for _ in self.records]
        self._since_check = []

    @property
    def current(self) -> int:
        """The record whose turn it is (TRIAL)."""
        return self.order[self.pos]

    def plan_at(self, step: int) -> Optional[int]:
        """The record whose plan travels at ``step`` (None before any round)."""
        if self.phase is Phase.DECIDED:
            return self.chosen
        if self.phase is Phase.TRIAL:
            return self.current if step >= self.turn_start else None
        return None

    def predicted(self, record: PlanRecord) -> float:
        """The model's step for ``record``, corrected by what earlier rounds measured."""
        return record.predicted_s * self.corrections.get(record.kind, 1.0)

    # -- the step clock (engine thread, every rank, first reduction of each step) ---------
    def tick(self, step: int, now: float, transport, probe=None) -> Event:
        """Step ``step`` starts at ``now``: time the previous one; end a round or check the
        kept plan when due (collectives: every rank calls this at the same steps).
        ``probe``: a function reading the link's speed now (seconds of a fixed collective,
        agreed), taken at each decision and check."""
        prev, self._last = self._last, (step, now)
        if self.phase is Phase.TRIAL:
            if prev is not None and prev[0] == step - 1 and prev[0] >= self.turn_start:
                self._measure(prev[0], now - prev[1], transport)
            if step > self.turn_start and self._turn_over():
                self._next_turn(step)
            if self.pos == len(self.order):
                self._decide(step)
                if not self.settings.recheck_every:  # never re-tried: no probe either
                    return Event.DECIDED
                # the link changed while the plans took turns: their times do not compare
                moved, self.link_s = self._probe_moved(probe, self.round_link)
                return Event.RETRIAL if moved else Event.DECIDED
            return Event.NONE
        if prev is not None and prev[0] == step - 1 and self.phase is Phase.DECIDED \
                and prev[0] >= self.decided_at:
            self._since_check.append(now - prev[1])
        every = self.settings.recheck_every
        if self.phase is Phase.DECIDED and every and step > self.decided_at \
                and (step - self.decided_at) % every == 0:
            return Event.RETRIAL if self._check(step, transport, probe) else Event.NONE
        return Event.NONE

    def _check(self, step: int, transport, probe) -> bool:
        """The kept plan's check: its step (agreed median since the last check) against its
        trial, and the link against the decision's probe. True: start a new round."""
        local = statistics.median(self._since_check) if self._since_check else 0.0
        self._since_check = []
        measured = agree_max([local], transport)[0]
        base = self.records[self.chosen].measured_s
        step_ratio = measured / base if measured and base else 1.0
        link_moved, link = self._probe_moved(probe, self.link_s)
        link_ratio = link / self.link_s if link and self.link_s else 1.0
        retrial = abs(step_ratio - 1.0) > self.settings.drift_tolerance or link_moved
        self.checks.append({"step": int(step), "step_ratio": step_ratio,
                            "link_ratio": link_ratio, "retrial": retrial})
        return retrial

    def _probe_moved(self, probe, then: Optional[float]) -> tuple[bool, Optional[float]]:
        """Read the link (``probe``, agreed by the ranks) against ``then``: (moved, the
        latest reading). A move is read twice: one jittery probe (a rank descheduled, a
        neighbour's burst) is not a link change, a change that persists is."""
        if probe is None:
            return False, None
        link = probe()
        if not self._link_moved(link, then):
            return False, link
        again = probe()
        return self._link_moved(again, then) and (again > then) == (link > then), again

    def _link_moved(self, now: Optional[float], then: Optional[float]) -> bool:
        """The link probe moved by more than LINK_CHANGE, and by LINK_FLOOR of the kept step."""
        if not now or not then:
            return False
        step = self.records[self.chosen].measured_s or 0.0
        return abs(now - then) > max(LINK_CHANGE * then, LINK_FLOOR * step)

    def _measure(self, step: int, seconds: float, transport) -> None:
        """Step ``step`` of the current turn took ``seconds`` here: past the settling steps,
        its time agreed by the ranks (a collective every rank makes at the same step)."""
        if step - self.turn_start >= self.settings.settle_steps:
            self._times[self.current].append(agree_max([seconds], transport)[0])

    def _turn_over(self) -> bool:
        """The current plan has its measured steps this turn, or its last ``CUT_STEPS``
        show it cannot win."""
        turn = self._times[self.current][self.turn_base:]
        if len(turn) >= self.settings.steps:
            return True
        done = [statistics.median(t) for k, t in enumerate(self._times)
                if k != self.current and t and self.records[k].eligible]
        return bool(len(turn) >= CUT_STEPS and done
                    and min(turn[-CUT_STEPS:]) > (1 + CUT) * min(done))

    def _next_turn(self, step: int) -> None:
        """The next plan's turn starts at ``step``; after the last, a runoff pass if due."""
        self.pos += 1
        if self.pos == len(self.order):
            self.order += self._runoff()
        if self.pos < len(self.order):
            self.turn_start, self.turn_base = int(step), len(self._times[self.current])

    def _runoff(self) -> list[int]:
        """The plans that run again (a runoff pass), or none: those within the budget whose
        median is within ``runoff_margin`` of the fastest (after the first pass: those the
        clock cannot yet tell from it, which :func:`choose` would call a tie), when two or
        more are and passes are left, in the reverse order of their last turns."""
        medians = {k: statistics.median(t) for k, t in enumerate(self._times)
                   if t and self.records[k].eligible}
        if self.runoffs >= self.settings.runoffs or len(medians) < 2:
            return []
        fastest = min(medians, key=medians.get)
        noise, n = step_noise(self._times), len(self._times[fastest])
        floor = self.settings.runoff_margin if self.runoffs == 0 else \
            self.settings.tie_tolerance
        close = {k for k, m in medians.items() if m <= medians[fastest] * (
            1 + margin(floor, noise, n, len(self._times[k])))}
        if len(close) < 2:
            return []
        self.runoffs += 1
        last = {k: i for i, k in enumerate(self.order)}  # each plan's latest turn
        return sorted(close, key=lambda k: -last[k])

    def _decide(self, step: int) -> None:
        for r, t in zip(self.records, self._times):
            r.measured_s, r.samples = (statistics.median(t) if t else None), len(t)
        noise = step_noise(self._times)
        self.chosen = choose(self.records, self.settings.tie_tolerance, noise)
        self.phase, self.decided_at = Phase.DECIDED, int(step)
        self.rounds += 1
        self._learn()
        self.history.append({"start": self.start, "step": int(step), "budget": self.budget,
                             "setup_s": self.setup_s, "runoffs": self.runoffs,
                             "step_noise": noise,
                             "turns": list(self.order),
                             "chosen": self.records[self.chosen].label,
                             "plans": [dataclasses.asdict(r) for r in self.records]})

    def _learn(self) -> None:
        """Per kind, measured over predicted (the median over this round's plans of the
        kind): the next round's proposals are ranked by corrected predictions."""
        by_kind: dict[str, list[float]] = {}
        for r in self.records:
            if r.measured_s and r.predicted_s > 0:
                by_kind.setdefault(r.kind, []).append(r.measured_s / r.predicted_s)
        for kind, ratios in by_kind.items():
            self.corrections[kind] = statistics.median(ratios)

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "phase": self.phase.value,
                "records": [dataclasses.asdict(r) for r in self.records],
                "start": self.start, "turn_start": self.turn_start,
                "order": list(self.order), "pos": self.pos, "turn_base": self.turn_base,
                "runoffs": self.runoffs,
                "chosen": self.chosen, "decided_at": self.decided_at,
                "rounds": self.rounds, "history": list(self.history),
                "corrections": dict(self.corrections), "budget": self.budget,
                "link_s": self.link_s, "round_link": self.round_link,
                "setup_s": self.setup_s, "checks": list(self.checks), "times": [list(t) for t in self._times],
                "since_check": list(self._since_check)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"expected a trials state of format {STATE_FORMAT} (from "
                             "state_dict())")
        self.phase = Phase(state["phase"])
        self.records = [PlanRecord(**r) for r in state["records"]]
        self.start, self.chosen = state["start"], state["chosen"]
        self.turn_start = state["turn_start"]
        # (states saved before runoffs existed: one pass in record order, at "current")
        self.order = [int(k) for k in state.get("order", range(len(self.records)))]
        self.pos = int(state["pos"] if "pos" in state else state["current"])
        self.turn_base, self.runoffs = int(state.get("turn_base", 0)), int(state.get("runoffs", 0))
        self.decided_at, self.rounds = state["decided_at"], int(state["rounds"])
        self.history = list(state["history"])
        self.corrections = {k: float(v) for k, v in state["corrections"].items()}
        self.budget = float(state["budget"])
        self.link_s, self.round_link = state["link_s"], state["round_link"]
        self.setup_s = float(state["setup_s"])
        self.checks = list(state["checks"])
        self._times = [[float(x) for x in t] for t in state["times"]]
        self._since_check = [float(x) for x in state["since_check"]]
        self._last = None  # a resumed run's first step is not timed against the old run's


def agree_max(values: Sequence[float], transport) -> list[float]:
    """``values`` with each entry the MAX over ranks (a collective on ``transport``)."""
    from cgx.comm.base import ReduceOp
    t = torch.tensor(list(values), dtype=torch.float64, device=transport.device)
    if transport.size > 1:
        transport.allreduce(t, ReduceOp.MAX)
    return [float(x) for x in t.cpu().tolist()]


def format_trials(records: Sequence[PlanRecord], chosen: Optional[int]) -> str:
    """A markdown table of a round: plan, measured step, the model's (corrected) prediction
    made before the round, bytes, error."""
    lines = ["| plan | measured step | predicted step | bytes/step | error | within budget "
             "| steps timed |", "|---|---:|---:|---:|---:|:---:|---:|"]
    for k, r in enumerate(records):
        mark = " (kept)" if k == chosen else ""
        measured = "-" if r.measured_s is None else f"{1e3 * r.measured_s:.1f} ms"
        lines.append(f"| {r.label}{mark} | {measured} | {1e3 * r.predicted_s:.1f} ms | "
                     f"{r.bytes:,} | {r.error:.4g} | {'yes' if r.eligible else 'no'} | "
                     f"{r.samples} |")
    return "\n".join(lines)


def format_round(rnd: dict) -> str:
    """:func:`format_trials` of one round as ``exchange_trials()`` lists it (a dict)."""
    records = [PlanRecord(**p) for p in rnd["plans"]]
    kept = next((k for k, r in enumerate(records) if r.label == rnd["chosen"]), None)
    return format_trials(records, kept)
