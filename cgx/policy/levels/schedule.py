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

:class:`AdaptiveSchedule` declares the state and composes the jobs, each in its module:
:mod:`.sampling` (which steps and layers a rank measures), :mod:`.probing` (the
compensation probe's steps and decision), :mod:`.planning` (plans from the measurements),
:mod:`.report` (rows, their table, the plan summary) and :mod:`.state` (checkpoints).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from cgx.policy.levels.candidates import (Candidate, Family, candidates_for, default_candidate,
                                          offered_families, reference_for)
from cgx.policy.update_rule import Compensation, UpdateRule
from cgx.policy.levels import planning, report, sampling, stats
from cgx.policy.levels import state as state_io
from cgx.policy.levels.report import format_levels
# Defined in the modules named, and importable from here as before the split:
from cgx.policy.levels.planning import EXACT  # noqa: F401
from cgx.policy.levels.probing import PROBE_SEED  # noqa: F401
from cgx.policy.levels.report import matches  # noqa: F401
from cgx.policy.levels.state import STATE_FORMAT  # noqa: F401
from cgx.compression.auto_policy import AutoCompression
from cgx.config import Config, Rounding


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
        self._probes: dict = {}  # layer index -> this rank's probe.LayerProbe, in the window

    # -- what travels now ------------------------------------------------------------

    def choices(self, step: int) -> list:
        """Per gradient: the :class:`Candidate` that travels now (None: exact, not planned
        or warming up)."""
        if step < self.settings.warmup_steps:
            return [None] * len(self.names)
        return [c if c is not None and c.family is not Family.EXACT else None
                for c in self.plan]

    # -- statistics (cgx.policy.levels.sampling, .probing) ------------------------------

    def observing(self, step: int) -> bool:
        return sampling.observing(self, step)

    def measure_share(self, rank: int, world: int) -> None:
        """Measure only this rank's share of the layers at each sampled step (every rank
        calls it with its transport's rank and size, before the window's steps; how the
        layers are dealt: :mod:`cgx.policy.levels.sampling`)."""
        self.share = (int(rank), int(world))

    def _probes_layer(self, i: int) -> bool:
        """Whether this rank follows layer ``i``'s compensation probe through the window."""
        return sampling.probes_layer(self, i)

    def wants(self, step: int, i: int) -> bool:
        """Whether :meth:`observe` at ``step`` reads gradient ``i`` (a caller that must copy
        the gradient for it copies only then)."""
        return sampling.wants(self, step, i)

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
        sampling.observe(self, step, indices, grads)

    def due(self, step: int) -> bool:
        return step >= self.next_plan

    def replan_soon(self, step: int) -> None:
        """Make the next plan from the ``window`` steps starting at ``step`` (e.g. at the end
        of an epoch; every rank calls it at the same step)."""
        sampling.clear_window(self)
        self.next_plan = max(step, self.settings.warmup_steps) + self.settings.window

    def plan_summary(self) -> dict:
        """The plan alone, JSON-able (layer -> [family, bits, bucket]), with its schedule:
        what a Keras checkpoint stores (the statistics are not kept)."""
        return report.plan_summary(self)

    def load_plan_summary(self, summary: dict) -> None:
        """Restore :meth:`plan_summary` (by layer name; unknown layers keep the default).

        Names match up to a leading scope: a Keras model loaded from a file names its
        variables ``sequential/dense/kernel`` where the saved one said ``dense/kernel``.
        """
        report.load_plan_summary(self, summary)

    # -- plans (cgx.policy.levels.planning) ---------------------------------------------

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
        return planning.replan(self, step, transport, verbose, hidden)

    def traffic_table(self, world: int) -> list:
        """Per layer (None: not planned), the bytes each candidate sends per step with
        ``world`` ranks: its payload (computed with the candidates) times the collective's
        factor, once per world size. Shared: callers must not modify it."""
        return planning.traffic_table(self, world)

    def plan_bytes(self, plan: Sequence, world: int) -> int:
        """Bytes one rank sends per step with ``plan`` (a Candidate or None per gradient:
        None is exact), from :meth:`traffic_table`."""
        return planning.plan_bytes(self, plan, world)

    def alternative(self, hidden: Sequence[int], base: Optional[Sequence] = None) -> list:
        """The plan the last window's measurements give with the gradients ``hidden`` kept
        exact (the budget unchanged), without adopting it: a proposal to try. Layers not
        measured keep their entry of ``base`` (default: the current plan)."""
        return planning.alternative(self, hidden, base)

    def plan_error(self, plan: Sequence) -> float:
        """The summed measured error of ``plan`` (a Candidate or None per gradient) over the
        measured layers: what the error budget bounds."""
        return planning.plan_error(self, plan)

    def measured_error(self, i: int, c: Candidate) -> Optional[float]:
        """Layer ``i``'s measured error with candidate ``c`` in the last plan's window
        (None: not measured, or ``c`` is not among its candidates)."""
        return planning.measured_error(self, i, c)

    # -- visibility (cgx.policy.levels.report) ------------------------------------------

    def rows(self) -> list[dict]:
        """Per gradient: layer, shape, family, level, bytes, error, share of the budget."""
        return report.rows(self)

    # -- state (cgx.policy.levels.state) -------------------------------------------------

    def state_dict(self) -> dict:
        return state_io.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        state_io.load_state_dict(self, state)


__all__ = ["AdaptiveSchedule", "AutoCompression", "format_levels"]
