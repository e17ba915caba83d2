"""The planned exchange of one gradient list: trace, calibrate, plan, apply.

Timeline (``c`` = calibrate_steps)::

    steps [0, c)   the uniform quantized exchange; each gradient's ready time recorded
                   (from the step's first ready gradient: backward's start is not seen)
    step  c        every rank, at its first reduction of the step: the per-tensor ready
                   times are agreed (MAX over ranks), the link is measured (alpha-beta per
                   collective, the slowest rank's), the quantizer's throughput is agreed
                   (MIN over ranks), and the planner fixes each tensor's option

    when the set of gradients changes (parameters frozen, unfrozen or added: the optimizer
                   rebuilds its exchange and loads this state into it), the new set is
                   traced again for ``c`` steps from the next one, then planned

    every ``replan_every`` steps after a plan, at the first reduction of the step: the
                   measured step (first gradient ready to the end of the step's last
                   reduction) is agreed (MAX over ranks of each rank's median) and compared
                   with the prediction; a drift beyond ``drift_tolerance`` re-measures and
                   re-plans from the latest ready times (``Compression.planned(trials=False)``;
                   with trials, :mod:`cgx.policy.trials.planned_decider` tries each plan against exact and
                   uniform, keeps the fastest and checks it against its trial instead)

Every input of the planner is agreed over the ranks and the planner is deterministic,
so every rank holds the same plan: the ranks issue the same collectives.

:class:`PlannedSchedule` declares the state and composes the jobs, each in its module:
:mod:`.tracing` (ready times, measured steps, the agreed profile), :mod:`.drift` (the
drift checks), :mod:`.factors` (sufficient factors or not), :mod:`.replanning` (a plan)
and :mod:`.state` (checkpoints, plans as plain values).
"""

from __future__ import annotations

import collections
import time
from typing import Optional, Sequence

from cgx.compression.planned_policy import PlannedCompression
from cgx.config import ReductionType
from cgx.policy.planner import drift, factors, replanning, tracing
from cgx.policy.planner import state as state_io
from cgx.policy.planner.costs import CostModel
from cgx.policy.planner.drift import DriftCheck
from cgx.policy.planner.strategy import ExchangePlan
# Defined in the modules named, and importable from here as before the split:
from cgx.policy.planner.state import STATE_FORMAT, plan_from_dict, plan_to_dict  # noqa: F401
from cgx.policy.planner.tracing import agreed_profile, device_profile  # noqa: F401

_FAMILY = {ReductionType.SRA: "sra", ReductionType.RING: "sra",
           ReductionType.ALLGATHER: "allgather"}


class PlannedSchedule:
    """Ready times while calibrating, then the per-tensor choice, checked for drift.

    Args:
        names, shapes: the gradients (plan order).
        specs: the quantized spec of each gradient the rules let compress (None: always exact).
        settings: the :class:`PlannedCompression` settings.
        algorithm: the reducer's compressed algorithm (the option the planner weighs).
        fusion_mb: the optimizer's bucket size (the fusion groups the planner assumes).
        place: weigh where each CUDA tensor is quantized (the exchange applies the plan's
            :meth:`placements`): the device profile is measured once, at the first plan.
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]], specs: Sequence,
                 settings: PlannedCompression, algorithm: ReductionType = ReductionType.SRA,
                 fusion_mb: float = 64.0, place: bool = False):
        from cgx.policy.planner.placement import DeviceProfile
        given = getattr(settings, "device_profile", None)
        if given is not None and not isinstance(given, DeviceProfile):
            raise TypeError("Compression.planned(device_profile=) takes a "
                            "cgx.policy.planner.placement.DeviceProfile (e.g. DeviceProfile.h200()) "
                            f"or None, got {given!r}")
        self.names = list(names)
        self._position = {n: i for i, n in enumerate(self.names)}
        self.shapes = [tuple(s) for s in shapes]
        self.eligible = list(specs)
        self.settings = settings
        self.family = _FAMILY.get(algorithm, "sra")
        self.fusion_mb = float(fusion_mb)
        self.place = place
        self._device = None  # the device profile the plans weigh (place: measured once)
        self.chosen: Optional[list[bool]] = None  # per tensor: compressed?
        self.cost: Optional[CostModel] = None  # the model of the last plan
        self.plan: Optional[ExchangePlan] = None
        self.planned_at: Optional[int] = None  # the step of the last plan
        self.checks: list[DriftCheck] = []  # every drift check, in order
        self._placements: Optional[list] = None  # of the plan (see placements())
        # Tracing runs from this step for calibrate_steps steps (None: from the next step
        # seen; after the set of gradients changed).
        self._trace_from: Optional[int] = 0
        # The latest ready times (seconds after the step's first), per tensor.
        window = max(settings.calibrate_steps, 5)
        self._ready = [collections.deque(maxlen=window) for _ in self.names]
        self._starts: dict[int, float] = {}  # step -> its first gradient's ready time
        self._end: Optional[tuple[int, float]] = None  # (step, end of its latest reduction)
        self._measured: list[float] = []  # steps measured since the last check
        self._ratio = 1.0  # measured/predicted the checks take as normal
        self._calibrate_ratio = False  # the next check sets _ratio (after a drift re-plan)
        # Sufficient-factor layers (``sufficient_factors=``): the rows (K) each last
        # offered, agreed by every rank, and what the plan chose for them, by index.
        self._factor_rows: dict[int, int] = {}
        self._factors_planned: dict[int, tuple[int, bool]] = {}  # index -> (rows, factors?)
        # A trial's say for every factor layer (cgx.policy.trials): True, Poseidon's byte rule;
        # False, never; None, the plan's per-layer choice (below).
        self.factors_rule: Optional[bool] = None

    # -- main thread: backward hooks ---------------------------------------------------
    def note_ready(self, index: int, step: int) -> None:
        """Gradient ``index`` is ready (called from the backward hook)."""
        tracing.note_ready(self, index, step)

    # -- engine thread ------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.chosen is None and self._trace_from is not None and \
            step >= self._trace_from + self.settings.calibrate_steps

    def note_reduced(self, step: int) -> None:
        """A reduction of ``step`` finished (engine thread)."""
        self._end = (step, time.perf_counter())

    def begin_step(self, step: int, transport, verbose: bool = False, timeline=None,
                   check_drift: bool = True) -> None:
        """The first reduction of ``step`` on every rank: plan when due, check for drift
        (``check_drift``: False when trials watch the kept plan instead). Plans and checks
        are also marked on ``timeline`` (``cgx.timeline``) when given."""
        if self._trace_from is None:
            self._trace_from = step
        if check_drift:
            tracing.measure_previous(self, step)
        if self.due(step):
            self.replan(transport, verbose, step=step, timeline=timeline)
        elif (check_drift and self.plan is not None and self.planned_at is not None
              and self.settings.replan_every
              and (step - self.planned_at) % self.settings.replan_every == 0):
            self.check_drift(step, transport, verbose, timeline)

    def check_drift(self, step: int, transport, verbose: bool = False,
                    timeline=None) -> DriftCheck:
        """Agree on the measured step; re-plan when it drifts from the prediction. A
        collective: every rank calls it at the same step."""
        return drift.check_drift(self, step, transport, verbose, timeline)

    def prefer_factors(self, name: str, rows: int, ranks: int, out_features: int,
                       in_features: int) -> bool:
        """Send a linear layer's weight gradient as sufficient factors (``sufficient_factors=``)?

        Called by every rank with the agreed rows, before each exchange of the layer.
        When the plan weighed this layer's factors (the rows it saw offered), the plan's
        choice: the factors are one option among the layer's others in the simulated
        step, overlap with backward and the exchange's CPU work included. Otherwise (before
        the first plan, or the rows changed since): before any plan, Poseidon's byte rule;
        after one, the factors' allgather and rebuild against the layer's other options
        standing alone in the plan's cost model - so a 4-bit exchange that beats the
        factors wins, which the byte rule (against float32) cannot see. While
        ``factors_rule`` is set (the deciding mode's trial or kept plan), its say instead.
        The same on every rank: the inputs are agreed.
        """
        return factors.prefer_factors(self, name, rows, ranks, out_features, in_features)

    def factor_sends(self, say: Optional[bool], world: int) -> dict[int, int]:
        """The layers that travel as sufficient factors under ``say`` (True: where Poseidon's
        byte rule allows; False: none; None: the plan's per-layer choice, as
        :meth:`prefer_factors`), each with the bytes one rank sends: its ``K x (M + N)``
        float32 factors to each of the other ``world - 1`` ranks."""
        return factors.factor_sends(self, say, world)

    def has_factor_layers(self) -> bool:
        """Has a layer been offered as sufficient factors (``sufficient_factors=``)?"""
        return bool(self._factor_rows)

    def specs(self) -> list:
        if self.chosen is None:
            return list(self.eligible)
        return [s if c else None for s, c in zip(self.eligible, self.chosen)]

    def placements(self) -> Optional[list]:
        """Per tensor, where the plan quantizes it (:class:`cgx.collectives.offload.Placement`;
        None: exact), or None when the plan had no device to weigh (CPU tensors)."""
        if self.plan is None or self.chosen is None or self.plan.model.device is None:
            return None
        if self._placements is None:
            from cgx.policy.planner.placement import placement_of
            self._placements = [placement_of(o.name) if c else None
                                for o, c in zip(self.plan.chosen, self.chosen)]
        return self._placements

    def replan(self, transport, verbose: bool = False, step: Optional[int] = None,
               timeline=None) -> ExchangePlan:
        """Every rank at the same point: agree on the profile, measure, plan."""
        return replanning.replan(self, transport, verbose, step, timeline)

    # -- state (cgx.policy.planner.state) -----------------------------------------------
    def state_dict(self) -> dict:
        """The plan and what its drift checks need, as plain values: a resumed run checks
        at the same steps, against the same prediction and bias, and re-plans from the
        same ready times as the run it continues."""
        return state_io.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        state_io.load_state_dict(self, state)
