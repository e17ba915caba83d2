"""Trials: the model proposes a few exchange plans, the step clock decides between them.

Timeline (``K`` plans, ``s`` = settle_steps, ``m`` = steps per plan)::

    step t0                 a round starts: plan 0 travels
    steps [t0 + k(s+m),     plan k travels; its first ``s`` steps are not measured (the
           t0 + (k+1)(s+m))     switch: residuals handed over, new buffers), the next ``m`` are
    step t0 + K(s+m)        every rank at its first reduction: the medians are agreed (MAX
                            over ranks of each rank's median, as the drift check does) and
                            the fastest plan within the error budget is kept (bytes break
                            ties); from this step on it travels
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
import statistics
from typing import Optional, Sequence

import torch

from cgx.compression.trials import TrialSettings

STATE_FORMAT = 1
# A link probe this much slower or faster (relative) than at the decision starts a new round:
# the kept plan's own step may hardly move when the link changes (a compressed plan's step
# is mostly compute and compression), but which plan is fastest does.
LINK_CHANGE = 0.5


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

    @property
    def compressed(self) -> bool:
        return self.kind != "exact"


def choose(records: Sequence[PlanRecord], tie_tolerance: float) -> int:
    """The index of the fastest measured plan within the budget; among plans within
    ``tie_tolerance`` of it, the one sending fewest bytes (then the first)."""
    pool = [k for k, r in enumerate(records) if r.eligible and r.measured_s is not None]
    if not pool:
        raise ValueError("no plan of the round is within the error budget and measured; the "
                         "exact plan always is: propose it")
    best = min(records[k].measured_s for k in pool)
    ties = [k for k in pool if records[k].measured_s <= best * (1 + tie_tolerance)]
    return min(ties, key=lambda k: (records[k].bytes, k))


class Trials:
    """The rounds of trials of one exchange, and the plan they keep (see the module doc)."""

    def __init__(self, settings: TrialSettings):
        self.settings = settings
        self.phase = Phase.IDLE
        self.records: list[PlanRecord] = []
        self.start: Optional[int] = None  # first step of the current (or last) round
        self.chosen: Optional[int] = None  # index into records of the kept plan
        self.decided_at: Optional[int] = None
        self.rounds = 0
        self.history: list[dict] = []  # one summary per finished round
        # learned measured/predicted per plan kind (1.0 until measured)
        self.corrections: dict[str, float] = {}
        self.budget = 0.0  # the current round's error budget
        self.link_s: Optional[float] = None  # the link probe at the decision
        self._times: list[list[float]] = []  # this rank's measured steps per record
        self._since_check: list[float] = []  # the kept plan's steps since the last check
        self._last: Optional[tuple[int, float]] = None  # (step, start time) of the latest

    # -- which plan travels ----------------------------------------------------------
    def begin(self, step: int, records: Sequence[PlanRecord], budget: float = 0.0) -> None:
        """Start a round at ``step`` with ``records`` (every rank the same list); ``budget``:
        the error budget they were checked against (kept in the history)."""
        if not records:
            raise ValueError("a round of trials needs at least one plan")
        self.budget = float(budget)
        self.phase, self.start, self.records = Phase.TRIAL, int(step), list(records)
        self.chosen, self.decided_at = None, None
        self._times = [[] for _ in self.records]
        self._since_check = []

    def end_step(self) -> int:
        return self.start + len(self.records) * self.settings.turn

    def plan_at(self, step: int) -> Optional[int]:
        """The record whose plan travels at ``step`` (None before any round)."""
        if self.phase is Phase.DECIDED:
            return self.chosen
        if self.phase is Phase.TRIAL:
            k = (step - self.start) // self.settings.turn
            return min(max(k, 0), len(self.records) - 1)
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
        if prev is not None and prev[0] == step - 1:
            self._record(prev[0], now - prev[1])
        if self.phase is Phase.TRIAL and step >= self.end_step():
            self._decide(step, transport)
            self.link_s = probe() if probe is not None else None
            return Event.DECIDED
        every = self.settings.recheck_every
        if self.phase is Phase.DECIDED and every and step > self.decided_at \
                and (step - self.decided_at) % every == 0:
            drifted = self._drifted(transport)
            link = probe() if probe is not None else None
            if link and self.link_s and abs(link / self.link_s - 1.0) > LINK_CHANGE:
                drifted = True
            return Event.RETRIAL if drifted else Event.NONE
        return Event.NONE

    def _record(self, step: int, seconds: float) -> None:
        """The time of ``step`` (just ended), under the plan that travelled then."""
        if self.phase is Phase.TRIAL and step >= self.start:
            k, offset = divmod(step - self.start, self.settings.turn)
            if k < len(self.records) and offset >= self.settings.settle_steps:
                self._times[k].append(seconds)
        elif self.phase is Phase.DECIDED and step >= self.decided_at:
            self._since_check.append(seconds)

    def _decide(self, step: int, transport) -> None:
        medians = [statistics.median(t) if t else 0.0 for t in self._times]
        for r, m in zip(self.records, agree_max(medians, transport)):
            r.measured_s = m if m > 0 else None
        self.chosen = choose(self.records, self.settings.tie_tolerance)
        self.phase, self.decided_at = Phase.DECIDED, int(step)
        self.rounds += 1
        self._learn()
        self.history.append({"start": self.start, "step": int(step), "budget": self.budget,
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

    def _drifted(self, transport) -> bool:
        local = statistics.median(self._since_check) if self._since_check else 0.0
        self._since_check = []
        measured = agree_max([local], transport)[0]
        base = self.records[self.chosen].measured_s
        if not measured or not base:
            return False
        return abs(measured / base - 1.0) > self.settings.drift_tolerance

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "phase": self.phase.value,
                "records": [dataclasses.asdict(r) for r in self.records],
                "start": self.start, "chosen": self.chosen, "decided_at": self.decided_at,
                "rounds": self.rounds, "history": list(self.history),
                "corrections": dict(self.corrections), "budget": self.budget,
                "link_s": self.link_s, "times": [list(t) for t in self._times],
                "since_check": list(self._since_check)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"expected a trials state of format {STATE_FORMAT} (from "
                             "state_dict())")
        self.phase = Phase(state["phase"])
        self.records = [PlanRecord(**r) for r in state["records"]]
        self.start, self.chosen = state["start"], state["chosen"]
        self.decided_at, self.rounds = state["decided_at"], int(state["rounds"])
        self.history = list(state["history"])
        self.corrections = {k: float(v) for k, v in state["corrections"].items()}
        self.budget = float(state["budget"])
        self.link_s = state["link_s"]
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
    lines = ["| plan | measured step | predicted step | bytes/step | error | within budget |",
             "|---|---:|---:|---:|---:|:---:|"]
    for k, r in enumerate(records):
        mark = " (kept)" if k == chosen else ""
        measured = "-" if r.measured_s is None else f"{1e3 * r.measured_s:.1f} ms"
        lines.append(f"| {r.label}{mark} | {measured} | {1e3 * r.predicted_s:.1f} ms | "
                     f"{r.bytes:,} | {r.error:.4g} | {'yes' if r.eligible else 'no'} |")
    return "\n".join(lines)
