"""When plans are made, and what survives them: windows, re-planning, state.

Timeline (``w`` = warmup_steps, ``n`` = window, ``A`` = adjust_every)::

    steps [0, w)           exact exchange (warm-up)
    steps [w, w + n)       the uniform default; each candidate's error measured on
                           sampled steps' gradients (cgx.policy.levels.stats)
    step  w + n            first plan, then every A steps: each plan from the
                           measurements of the n steps before it

The measurements (one table per rank) are added up with one allreduce and the
solver is deterministic, so every rank holds the same plan. A layer with no
gradient during a window keeps its level. A plan change
keeps what it can: error-feedback residuals stay with their layers (a layer
that turns exact hands its residual over to its next gradient).
"""

from __future__ import annotations

import math
import sys
from typing import Optional, Sequence

import torch

from cgx.policy.levels.candidates import (Candidate, Family, candidates_for, default_candidate,
                                          offered_families, reference_for, traffic_factor)
from cgx.policy.update_rule import Compensation, UpdateRule
from cgx.policy.levels.solver import solve
from cgx.policy.levels import probe, stats
from cgx.compression.auto_policy import AutoCompression
from cgx.config import Config, Rounding

STATE_FORMAT = 2  # 1: the window's summed gradients instead of its measurements
PROBE_SEED = 0x9E0B  # stochastic rounding noise of the compensation probe
EXACT = Candidate(Family.EXACT)


class AdaptiveSchedule:
    """The adaptive plan of one gradient list, and the statistics it is made from.

    Args:
        names, shapes: the gradients (plan order).
        eligible: which gradients may be compressed at all (the layer rules:
            small and 1-D tensors stay exact and are not planned).
        settings: the :class:`AutoCompression` settings.
        config: defaults (the uniform default level, rounding).
        error_feedback: whether the exchange keeps residuals (it decides which families
            are offered: :func:`offered_families`).
        compensations: the :class:`Compensation` options of a quantized layer
            (:func:`cgx.policy.levels.probe.options_for`); with two or more, each layer's is
            measured during the window (:mod:`cgx.policy.levels.probe`) and decided at each plan.
        update_rule: the optimizer's: the probe's shadow update, and the families
            offered (:func:`offered_families`).
        beta: the moving average's weight (the probe runs it as the exchange does).

    Attributes:
        plan: the current :class:`Candidate` per gradient (None: not planned, exact).
        plans_made: how many plans so far.
        table: rows of the current plan (see :meth:`rows`).
        compensation: per layer name, the :class:`Compensation` the last plan chose
            (layers not measured are absent: the exchange's own applies).
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]],
                 eligible: Sequence[bool], settings: AutoCompression, config: Config,
                 error_feedback: bool = True, compensations: Sequence[Compensation] = (),
                 update_rule: UpdateRule = UpdateRule.UNKNOWN, beta: float = 0.95):
        self.names = list(names)
        self.shapes = [tuple(s) for s in shapes]
        self.settings = settings
        self.rounding: Rounding = settings.rounding or config.rounding
        fams = offered_families(settings.families, error_feedback,
                                update_rule is UpdateRule.ADAPTIVE)
        self.default = default_candidate(fams, config, settings)
        self.candidates = [candidates_for(s, fams, settings.bits, settings.bucket_sizes,
                                          settings.densities, settings.ranks)
                           if ok else None for s, ok in zip(self.shapes, eligible)]
        # The reference of each layer: the uniform default where it applies (PowerSGD's
        # default does not to a matrix too small for it), else exact.
        self.reference: list[Optional[Candidate]] = [
            None if cands is None else reference_for(s, self.default)
            for s, cands in zip(self.shapes, self.candidates)]
        for ref, cands in zip(self.reference, self.candidates):
            if cands is not None and ref not in cands:
                cands.append(ref)
        self.plan: list[Optional[Candidate]] = list(self.reference)
        # per layer, each candidate's index in its list and its payload bytes (None: not
        # planned): fixed for the run, read by every decision
        self._position = [None if cands is None else {c: j for j, c in enumerate(cands)}
                          for cands in self.candidates]
        self._wire = [None if cands is None else [c.wire_bytes(s) for c in cands]
                      for s, cands in zip(self.shapes, self.candidates)]
        self.next_plan = settings.warmup_steps + settings.window
        self.plans_made = 0
        self.hidden: set = set()  # layers the planner keeps exact (compressing saves no time)
        # The window's measurements (cgx.policy.levels.stats): per layer name, the sum of each
        # candidate's errors over the sampled steps with a gradient, and their number.
        self._sums: dict[str, list] = {}
        self._counts: dict[str, int] = {}
        self.scorer = stats.PowerSGDScorer()  # warm-started PowerSGD, as the exchange runs it
        self.threads = config.cpu_threads  # of the quantizer in the measurements
        self._errors: Optional[dict] = None  # layer index -> (combined errors, costs)
        self.budget = 0.0
        self.world = 2  # ranks of the last plan (the candidates' traffic)
        self._traffic: dict[int, list] = {}  # ranks -> per layer, each candidate's traffic
        # (this rank, world size): which layers this rank measures at a sampled step (the
        # exchange sets it from its transport: measure_share); per world size, the rank
        # that measures each layer at a window's first sampled step
        self.share = (0, 1)
        self._first_measurer: dict[int, list] = {}
        self.compensation_options = tuple(compensations)
        self.update_rule, self.beta = update_rule, float(beta)
        self.compensation: dict[str, Compensation] = {}
        self._probes: dict[int, probe.LayerProbe] = {}  # this rank's, in the window

    # -- what travels now ------------------------------------------------------------

    def choices(self, step: int) -> list:
        """Per gradient: the :class:`Candidate` that travels now (None: exact, not planned
        or warming up)."""
        if step < self.settings.warmup_steps:
            return [None] * len(self.names)
        return [c if c is not None and c.family is not Family.EXACT else None
                for c in self.plan]

    # -- statistics ----------------------------------------------------------------------

    def observing(self, step: int) -> bool:
        return self.next_plan - self.settings.window <= step < self.next_plan

    def _turn(self, step: int) -> Optional[int]:
        """Which of the window's sampled steps ``step`` is (None: not one)."""
        return stats.sample_turn(step - (self.next_plan - self.settings.window),
                                 self.settings.window)

    def _sampled(self, step: int) -> bool:
        return self._turn(step) is not None

    def _ranks(self, i: int) -> list[int]:
        """The PowerSGD ranks layer ``i`` may pick (its scorer iterates at every window step)."""
        cands = self.candidates[i] or ()
        return [c.rank for c in cands if c.family is Family.POWERSGD]

    def measure_share(self, rank: int, world: int) -> None:
        """Measure only this rank's share of the layers at each sampled step (every rank
        calls it with its transport's rank and size, before the window's steps).

        The ranks split the window's measurements instead of each measuring every layer:
        at a sampled step each layer is measured by one rank, the layers dealt out
        largest first to the least loaded rank (:func:`stats.measuring_ranks`), and the
        deal turns by one rank at each sampled step, so over a window a layer is measured
        on several ranks' gradients. A rank's measuring work per window is 1/world of
        measuring every layer (the project's LM on 2 ranks: 4 sampled steps of 50-70 ms
        instead of 100-140 ms); each layer's error is a mean over the window's sampled
        steps, not over those steps times the ranks. (A layer that only some ranks use,
        a branch taken on some ranks' inputs, is measured at the sampled steps dealt to
        them; dealt only to ranks without its gradient, it keeps its level, as an unused
        layer does.)"""
        self.share = (int(rank), int(world))

    def _deal(self, world: int) -> list:
        """Per layer, the rank that measures it at a window's first sampled step."""
        if world not in self._first_measurer:  # the work: a large layer's sample at most
            work = [0 if c is None else min(math.prod(s), stats.SAMPLE_VALUES)
                    for s, c in zip(self.shapes, self.candidates)]
            self._first_measurer[world] = stats.measuring_ranks(work, world)
        return self._first_measurer[world]

    def _measures(self, step: int, i: int) -> bool:
        """Whether this rank measures layer ``i`` at ``step`` (a sampled step)."""
        rank, world = self.share
        if world <= 1:
            return True
        return (self._deal(world)[i] + self._turn(step)) % world == rank

    def _probes_layer(self, i: int) -> bool:
        """Whether this rank follows layer ``i``'s compensation probe through the window
        (the rank that measures it first; every window step)."""
        if len(self.compensation_options) < 2 or self.candidates[i] is None or \
                self._probe_spec(i) is None:
            return False
        rank, world = self.share
        return world <= 1 or self._deal(world)[i] == rank

    def _probe_spec(self, i: int):
        """The level the probe quantizes layer ``i`` at: its plan's, else the default's
        (None: neither quantizes)."""
        for c in (self.plan[i], self.default):
            if c is not None and c.family is Family.QUANTIZE:
                return c.spec(self.rounding)
        return None

    def wants(self, step: int, i: int) -> bool:
        """Whether :meth:`observe` at ``step`` reads gradient ``i`` (a caller that must copy
        the gradient for it copies only then)."""
        return (self.observing(step) and self.candidates[i] is not None
                and ((self._sampled(step) and self._measures(step, i))
                     or bool(self._ranks(i)) or self._probes_layer(i)))

    def observe(self, step: int, indices: Sequence[int], grads: Sequence[torch.Tensor]) -> None:
        """Measure this step's gradients (without residuals), when the step is one of the
        window's samples (see :mod:`cgx.policy.levels.stats`).

        Hidden cost: at every window step, one PowerSGD power iteration per layer that may
        pick PowerSGD (and its check for an all-zero gradient, a host sync); at the
        sampled steps, that check for every layer, one quantize pass per quantization
        candidate and one top-k, on at most ``stats.SAMPLE_VALUES`` values of each layer;
        at every window step, the compensation probe of this rank's layers
        (:mod:`cgx.policy.levels.probe`).
        """
        if not self.observing(step):
            return
        sampled = self._sampled(step)
        for i, g in zip(indices, grads):
            if not self.wants(step, i) or not bool(g.detach().any()):
                continue  # nothing to measure, or no gradient: nothing to learn
            cands, ranks = self.candidates[i], self._ranks(i)
            name, g = self.names[i], g.detach().reshape(-1).to(torch.float32)
            probing, measure = self._probes_layer(i), sampled and self._measures(step, i)
            if (probing or measure) and not bool(torch.isfinite(g).all()):
                probing = measure = False
            if probing:
                self._probe(step, i, g)
            low = self.scorer.step(name, g, self.shapes[i], ranks, measure) if ranks else None
            if not measure:  # (not finite: a loss-scaling overflow's step is not measured)
                continue
            errs = stats.candidate_errors(g, cands, rounding=self.rounding, threads=self.threads,
                                          key=stats.step_key(step, name), lowrank=low)
            old = self._sums.get(name)
            self._sums[name] = errs if old is None else [a + b for a, b in zip(old, errs)]
            self._counts[name] = self._counts.get(name, 0) + 1

    def _probe(self, step: int, i: int, g: torch.Tensor) -> None:
        p = self._probes.get(i)
        if p is None:
            p = self._probes[i] = probe.LayerProbe(g.numel(), self._probe_spec(i),
                                                   self.update_rule, self.beta)
        p.step(g, stats.step_key(step, self.names[i]) ^ PROBE_SEED)

    def _decide_compensation(self, planned: list, transport) -> None:
        """Each probed layer's compensation from the window's probes of every rank (one
        allreduce; a collective when there are options to choose from)."""
        if len(self.compensation_options) < 2:
            return
        width = 1 + 2 * len(probe.VARIANTS)
        sums = [self._probes[i].sums_now() if i in self._probes else [0.0] * width
                for i in planned]
        rows = stats.combine(sums, [int(i in self._probes) for i in planned], transport)
        for i, row in zip(planned, rows):
            measured = probe.measures(row) if row is not None else None
            if measured is not None:
                self.compensation[self.names[i]] = probe.choose(measured,
                                                                self.compensation_options)

    def due(self, step: int) -> bool:
        return step >= self.next_plan

    def replan_soon(self, step: int) -> None:
        """Make the next plan from the ``window`` steps starting at ``step`` (e.g. at the end
        of an epoch; every rank calls it at the same step)."""
        self._clear_window()
        self.next_plan = max(step, self.settings.warmup_steps) + self.settings.window

    def plan_summary(self) -> dict:
        """The plan alone, JSON-able (layer -> [family, bits, bucket]), with its schedule:
        what a Keras checkpoint stores (the statistics are not kept)."""
        return {"next_plan": self.next_plan, "plans_made": self.plans_made,
                "plan": {n: c.as_list() for n, c in zip(self.names, self.plan) if c is not None},
                "compensation": {n: v.value for n, v in self.compensation.items()}}

    def load_plan_summary(self, summary: dict) -> None:
        """Restore :meth:`plan_summary` (by layer name; unknown layers keep the default).

        Names match up to a leading scope: a Keras model loaded from a file names its
        variables ``sequential/dense/kernel`` where the saved one said ``dense/kernel``.
        """
        self.next_plan = int(summary["next_plan"])
        self.plans_made = int(summary["plans_made"])
        for i, n in enumerate(self.names):
            c = summary["plan"].get(n)
            if c is None:
                c = next((v for k, v in summary["plan"].items() if _same_layer(k, n)), None)
            if c is not None and self.candidates[i] is not None:
                cand = Candidate.from_list(c)
                if cand in self.candidates[i]:
                    self.plan[i] = cand
            kept = summary.get("compensation", {})
            v = kept.get(n, next((v for k, v in kept.items() if _same_layer(k, n)), None))
            if v is not None:
                self.compensation[n] = Compensation(v)

    def replan(self, step: int, transport, threads: int = 1, verbose: bool = False,
               hidden: Sequence[int] = ()) -> bool:
        """Make the next plan from the window's measurements (a collective: call it on every
        rank at the same point). Returns True when the plan changed.

        A layer that no rank measured in the window (no gradient at any sampled step:
        unused, frozen, a branch not taken) keeps its level: zero error for every
        candidate would give it the most aggressive one.

        ``hidden``: gradients for which the planner found that compressing saves no time
        (their exchange hides under backward, or is cheaper than compressing): they stay
        exact (no error), and the budget, still that of the uniform default on every
        layer, goes to the others. ``threads`` is not used (the errors are measured
        during the window, by :meth:`observe`)."""
        self.hidden = {self.names[i] for i in hidden}
        planned = [i for i, c in enumerate(self.candidates) if c is not None]
        names = [self.names[i] for i in planned]
        errors = stats.combine([self._sums.get(n, [0.0] * len(self.candidates[i]))
                                for n, i in zip(names, planned)],
                               [self._counts.get(n, 0) for n in names], transport)
        old = list(self.plan)
        measured = [(i, e) for i, e in zip(planned, errors) if e is not None]
        for i, e in zip(planned, errors):
            if e is None and self.names[i] in self.hidden:
                self.plan[i] = Candidate(Family.EXACT)
        if measured:
            self._solve([i for i, _ in measured], [e for _, e in measured], transport.size)
        self._decide_compensation(planned, transport)
        self.plans_made += 1
        self._clear_window()
        self.next_plan = step + self.settings.adjust_every
        changed = old != self.plan
        if verbose and changed and transport.rank == 0:
            print(f"[cgx] compression plan {self.plans_made} at step {step}:\n"
                  + format_levels(self.rows()), file=sys.stderr, flush=True)
        return changed

    def _solve(self, layers: list, errors: list, world: int) -> None:
        """The knapsack over ``layers`` (their combined ``errors``); sets their plan."""
        choice, self.budget, costs = self._solution(layers, errors, world, self.hidden)
        for i, j in zip(layers, choice):
            self.plan[i] = self.candidates[i][j]
        self.world = world
        self._errors = {**(self._errors or {}),
                        **{i: (errors[k], list(costs[k])) for k, i in enumerate(layers)}}

    def _solution(self, layers: list, errors: list, world: int, hidden) -> tuple:
        """``(choice per layer, budget, costs)``: the fewest bytes within the budget, the
        layers named in ``hidden`` exact."""
        table = self.traffic_table(world)
        costs = [table[i] for i in layers]
        ref = [self._position[i][self.reference[i]] for i in layers]
        budget = self.settings.alpha * sum(e[j] for e, j in zip(errors, ref))
        for k, i in enumerate(layers):
            if self.names[i] in hidden:  # only exact is offered, and it costs nothing
                j = self._position[i][EXACT]
                costs[k] = [0.0 if jj == j else math.inf for jj in range(len(costs[k]))]
        solution = solve(costs, errors, budget, reference=None if hidden else ref)
        return solution.choice, budget, costs

    def traffic_table(self, world: int) -> list:
        """Per layer (None: not planned), the bytes each candidate sends per step with
        ``world`` ranks: its payload (computed with the candidates) times the collective's
        factor, once per world size. Shared: callers must not modify it."""
        table = self._traffic.get(world)
        if table is None:
            factor = {f: traffic_factor(f, world) for f in Family}
            table = self._traffic[world] = [
                None if cands is None else [factor[c.family] * b for c, b in zip(cands, wire)]
                for cands, wire in zip(self.candidates, self._wire)]
        return table

    def plan_bytes(self, plan: Sequence, world: int) -> int:
        """Bytes one rank sends per step with ``plan`` (a Candidate or None per gradient:
        None is exact), from :meth:`traffic_table`."""
        table, total = self.traffic_table(world), 0.0
        for i, c in enumerate(plan):
            c = c or EXACT
            j = self._position[i].get(c) if self._position[i] is not None else None
            total += table[i][j] if j is not None else c.traffic(self.shapes[i], world)
        return int(total)

    def alternative(self, hidden: Sequence[int], base: Optional[Sequence] = None) -> list:
        """The plan the last window's measurements give with the gradients ``hidden`` kept
        exact (the budget unchanged), without adopting it: a proposal to try. Layers not
        measured keep their entry of ``base`` (default: the current plan)."""
        plan = list(self.plan if base is None else base)
        if not self._errors or not hidden:
            return plan
        layers = sorted(self._errors)
        names = {self.names[i] for i in hidden}
        choice, _, _ = self._solution(layers, [self._errors[i][0] for i in layers],
                                      self.world, names)
        for i, j in zip(layers, choice):
            plan[i] = self.candidates[i][j]
        return plan

    def plan_error(self, plan: Sequence) -> float:
        """The summed measured error of ``plan`` (a Candidate or None per gradient) over the
        measured layers: what the error budget bounds."""
        total = 0.0
        for i, (errs, _) in (self._errors or {}).items():
            j = self._position[i].get(plan[i] if plan[i] is not None else EXACT)
            if j is not None:
                total += errs[j]
        return total

    def measured_error(self, i: int, c: Candidate) -> Optional[float]:
        """Layer ``i``'s measured error with candidate ``c`` in the last plan's window
        (None: not measured, or ``c`` is not among its candidates)."""
        pos = self._position[i]
        row = (self._errors or {}).get(i)
        if row is None or pos is None or c not in pos:
            return None
        return row[0][pos[c]]

    def _clear_window(self) -> None:
        """Forget the window's measurements (the warm start of the PowerSGD scorer stays)."""
        self._sums.clear()
        self._counts.clear()
        self._probes.clear()

    # -- visibility --------------------------------------------------------------------

    def rows(self) -> list[dict]:
        """Per gradient: layer, shape, family, level, bytes, error, share of the budget."""
        out = []
        for i, (n, s) in enumerate(zip(self.names, self.shapes)):
            c = self.plan[i]
            numel = math.prod(s)
            row = {"layer": n, "shape": s, "family": "exact" if c is None else c.family.value,
                   "level": "exact (not planned)" if c is None else
                   "exact (planner: no time saved)" if n in self.hidden else c.label,
                   "bytes": 4 * numel if c is None else c.wire_bytes(s),
                   "error": 0.0, "share": 0.0,
                   "compensation": self.compensation[n].value if n in self.compensation and
                   c is not None and c.family is Family.QUANTIZE else ""}
            if c is not None and self._errors is not None and i in self._errors:
                errs, _ = self._errors[i]
                row["error"] = errs[self._position[i][c]]
                row["share"] = row["error"] / self.budget if self.budget > 0 else 0.0
            out.append(row)
        return out

    # -- state -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "next_plan": self.next_plan,
                "plans_made": self.plans_made, "budget": self.budget,
                "hidden": sorted(self.hidden),
                "plan": {n: c.as_list() for n, c in zip(self.names, self.plan) if c is not None},
                "errors": None if self._errors is None else
                {self.names[i]: v for i, v in self._errors.items()},
                "sums": {k: list(v) for k, v in self._sums.items()},
                "counts": dict(self._counts), "scorer": self.scorer.state_dict(),
                "compensation": {n: v.value for n, v in self.compensation.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") not in (1, STATE_FORMAT):
            raise ValueError(f"expected an adaptive-plan state of format {STATE_FORMAT} (from "
                             f"state_dict()), got {type(state).__name__}")
        # By layer name: layers added since (unfrozen, a new param group) keep the default.
        self.next_plan = int(state["next_plan"])
        self.plans_made = int(state["plans_made"])
        self.budget = float(state["budget"])
        self.hidden = set(state.get("hidden", ()))
        for i, n in enumerate(self.names):
            c = state["plan"].get(n)
            if c is not None and self.candidates[i] is not None:
                self.plan[i] = Candidate.from_list(c)
        index = {n: i for i, n in enumerate(self.names)}
        self._errors = None if state["errors"] is None else \
            {index[n]: v for n, v in state["errors"].items() if n in index}
        # Format 1 kept summed gradients, not measurements: its window starts over.
        self._sums = {k: list(v) for k, v in state.get("sums", {}).items() if k in index}
        self._counts = {k: int(v) for k, v in state.get("counts", {}).items() if k in index}
        if "scorer" in state:
            self.scorer.load_state_dict(state["scorer"])
        self.compensation = {n: Compensation(v) for n, v in
                             state.get("compensation", {}).items() if n in index}


def _same_layer(a: str, b: str) -> bool:
    """Two variable names of the same layer, up to a leading scope ("model/" + name)."""
    return a == b or a.endswith("/" + b) or b.endswith("/" + a)


def matches(summary: dict, names: Sequence[str]) -> bool:
    """True when every layer of a :meth:`AdaptiveSchedule.plan_summary` is among ``names``."""
    return all(any(_same_layer(k, n) for n in names) for k in summary["plan"])


def format_levels(rows: list[dict]) -> str:
    """A markdown table of :meth:`AdaptiveSchedule.rows`."""
    comp = any(r.get("compensation") for r in rows)  # measured per layer: one more column
    lines = ["| layer | shape | family | level | bytes | error | share of budget |"
             + (" compensation |" if comp else ""),
             "|---|---|---|---|---:|---:|---:|" + ("---|" if comp else "")]
    for r in rows:
        shape = "x".join(map(str, r["shape"])) or "scalar"
        lines.append(f"| {r['layer']} | {shape} | {r['family']} | {r['level']} | "
                     f"{r['bytes']:,} | {r['error']:.4g} | {100 * r['share']:.1f}% |"
                     + (f" {r.get('compensation') or '-'} |" if comp else ""))
    total = sum(r["bytes"] for r in rows)
    lines.append(f"| **total** | | | | **{total:,}** | | |" + (" |" if comp else ""))
    return "\n".join(lines)



__all__ = ["AdaptiveSchedule", "AutoCompression", "format_levels"]
