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
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from cgx.compression.planned_policy import PlannedCompression
from cgx.config import ReductionType
from cgx.policy.planner.costs import Collective, CostModel, Option, TensorProfile
from cgx.policy.planner.simulator import SimulatedStep
from cgx.policy.planner.strategy import ExchangePlan, format_exchange, plan

STATE_FORMAT = 1
_FAMILY = {ReductionType.SRA: "sra", ReductionType.RING: "sra",
           ReductionType.ALLGATHER: "allgather"}


@dataclasses.dataclass
class DriftCheck:
    """One drift check: the step it ran at, the plan's prediction, the agreed measurement."""

    step: int
    predicted_s: float
    measured_s: float
    expected_ratio: float  # measured/predicted taken as normal (1, or the model's bias)
    replanned: bool


def _mark(timeline, name: str, args: dict) -> None:
    """A point on the timeline's ``planner`` row (nothing without an enabled timeline)."""
    if timeline is not None and timeline.enabled:
        timeline.instant(name, row="planner", args=args)


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
        now = time.perf_counter()
        start = self._starts.get(step)
        if start is None:
            start = self._starts[step] = now
            for old in [s for s in self._starts if s < step - 4]:
                del self._starts[old]
        if step >= 1:  # step 0 warms up (allocations, first-call costs)
            self._ready[index].append(now - start)

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
        if check_drift and self._end is not None and self.planned_at is not None:
            # The previous step's exchange ended with its latest reduction. The first
            # step after a plan still carries the calibration; it is not measured.
            s, end = self._end
            start = self._starts.get(s)
            if start is not None and s > self.planned_at and s < step:
                self._measured.append(end - start)
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
        from cgx.comm.base import ReduceOp
        local = statistics.median(self._measured) if self._measured else 0.0
        self._measured = []
        agreed = torch.tensor([local], dtype=torch.float64, device=transport.device)
        if transport.size > 1:
            transport.allreduce(agreed, ReduceOp.MAX)
        measured = float(agreed.item())
        predicted = self.plan.step_s
        ratio = measured / predicted if predicted > 0 else 1.0
        if self._calibrate_ratio and measured > 0:
            # Just re-planned for drift and still off: what the model misses, it misses
            # steadily; only a change from here is drift.
            self._ratio, self._calibrate_ratio = ratio, False
        drift = measured > 0 and abs(ratio / self._ratio - 1.0) > self.settings.drift_tolerance
        check = DriftCheck(step, predicted, measured, self._ratio, drift)
        self.checks.append(check)
        _mark(timeline, "drift check", {"step": step, "predicted_ms": 1e3 * predicted,
                                   "measured_ms": 1e3 * measured, "replanned": drift})
        if drift:
            if verbose:
                print(f"cgx: step {step}: measured step {1e3 * measured:.1f} ms against "
                      f"{1e3 * predicted * self._ratio:.1f} ms expected; re-planning",
                      file=sys.stderr, flush=True)
            self.replan(transport, verbose, step=step, timeline=timeline)
            self._calibrate_ratio = True
        return check

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
        i = self._position.get(name)
        if i is not None:
            self._factor_rows[i] = int(rows)
        return self._factors_go(name, rows, ranks, out_features, in_features,
                                self.factors_rule)

    def _factors_go(self, name: str, rows: int, ranks: int, out_features: int,
                    in_features: int, rule: Optional[bool]) -> bool:
        """:meth:`prefer_factors`'s answer under ``rule`` (None: the plan's)."""
        from cgx.policy.planner.costs import OptionMaker
        from cgx.policy.planner.simulator import group_cost
        from cgx.sufficient_factors import worth_it
        i = self._position.get(name)
        if rule is not None:
            return rule and worth_it(rows, ranks, out_features, in_features)
        if i is not None:
            planned = self._factors_planned.get(i)
            if planned is not None and planned[0] == rows:
                return planned[1]
        if self.cost is None:
            return worth_it(rows, ranks, out_features, in_features)
        fams = ["exact", "sfb"]
        if i is None or self.eligible[i] is not None:
            fams.append(self.family)
        t = TensorProfile(name, out_features * in_features, 0.0, (out_features, in_features),
                          rows)
        times = {}
        for o in OptionMaker(self.cost, (self.settings.bits,), fams)(t):
            g = group_cost([0], [t], [o], self.cost)  # the option standing alone
            times[o.name] = g.compress + g.comm + g.decompress
        return "sfb" in times and times["sfb"] < min(t for k, t in times.items() if k != "sfb")

    def factor_sends(self, say: Optional[bool], world: int) -> dict[int, int]:
        """The layers that travel as sufficient factors under ``say`` (True: where Poseidon's
        byte rule allows; False: none; None: the plan's per-layer choice, as
        :meth:`prefer_factors`), each with the bytes one rank sends: its ``K x (M + N)``
        float32 factors to each of the other ``world - 1`` ranks."""
        return {i: (world - 1) * rows * sum(self.shapes[i]) * 4
                for i, rows in self._factor_rows.items() if len(self.shapes[i]) == 2
                and self._factors_go(self.names[i], rows, world, *self.shapes[i], say)}

    def has_factor_layers(self) -> bool:
        """Has a layer been offered as sufficient factors (``sufficient_factors=``)?"""
        return bool(self._factor_rows)

    def _cpu_of(self, tensors: Sequence[TensorProfile], compressed: Sequence[bool],
                cost: CostModel) -> float:
        """The exchange's CPU work (``Option.cpu_s`` summed) with ``compressed[i]`` per tensor."""
        from cgx.policy.planner.costs import OptionMaker
        make = OptionMaker(cost, (self.settings.bits,), ("exact", self.family))
        total = 0.0
        for t, c in zip(tensors, compressed):
            opts = make(t, self.settings.bucket_size)
            total += (opts[-1] if c else opts[0]).cpu_s
        return total

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
        n = len(self.names)
        if self.place and self._device is None:
            self._device = device_profile(self.settings, transport)
        ready, cost = agreed_profile(self._ready, self.settings, transport, self._device)
        self.cost = cost
        # A factor layer (its rows seen) has sufficient factors among its options.
        rows = self._factor_rows
        tensors = [TensorProfile(name, math.prod(shape), t, *(
                       (tuple(shape), rows[i]) if i in rows and len(shape) == 2 else ()))
                   for i, (name, shape, t) in enumerate(zip(self.names, self.shapes, ready))]
        backward = max(ready) if ready else 0.0
        if cost.contention > 0 and backward > 0:
            # The ready times were traced with the exchange then in use running beside
            # backward on the same cores: take its CPU work (in the new model) out of them,
            # or the plan would count it twice. At most half: not all of it overlapped.
            in_use = self.chosen if self.chosen is not None else [e is not None
                                                                  for e in self.eligible]
            busy = self._cpu_of(tensors, in_use, cost)
            scale = max(0.5, 1.0 - busy / backward)
            tensors = [dataclasses.replace(t, ready_s=t.ready_s * scale) for t in tensors]
            backward *= scale
        families = ("exact", self.family) + (("sfb",) if rows else ())
        result = plan(tensors, cost, backward, fusion_mb=(self.fusion_mb,),
                      bits=(self.settings.bits,), families=families,
                      exact_only=[e is None for e in self.eligible])
        # A layer planned as factors is still quantized (where the rules allow) on a step
        # whose factors are not a faithful record.
        self.chosen = [e is not None and opt.name != "exact"
                       for e, opt in zip(self.eligible, result.chosen)]
        # (A layer the rules keep exact had only that option here: the standalone
        # comparison decides its factors.)
        self._factors_planned = {i: (rows[i], result.chosen[i].name == "sfb") for i in rows
                                 if self.eligible[i] is not None}
        self.plan, self._placements = result, None
        _mark(timeline, "plan", {"step": step, "predicted_ms": 1e3 * result.step_s,
                            "choices": {t.name: o.name
                                        for t, o in zip(result.tensors, result.chosen)}})
        self.planned_at = step
        self._measured = []
        if verbose:
            print(f"cgx: planned exchange ({sum(self.chosen)} of {n} tensors compressed)\n"
                  + format_exchange(result, limit=20), file=sys.stderr, flush=True)
        return result

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The plan and what its drift checks need, as plain values: a resumed run checks
        at the same steps, against the same prediction and bias, and re-plans from the
        same ready times as the run it continues."""
        return {"format": STATE_FORMAT, "names": list(self.names), "chosen": self.chosen,
                "cost": None if self.cost is None else self.cost.to_dict(),
                "factors": {self.names[i]: [k, f] for i, (k, f) in
                            self._factors_planned.items()},
                "plan": None if self.plan is None else plan_to_dict(self.plan),
                "planned_at": self.planned_at,
                "checks": [dataclasses.asdict(c) for c in self.checks],
                "ratio": self._ratio, "calibrate_ratio": self._calibrate_ratio,
                "ready": [list(r) for r in self._ready],
                "measured": self._measured + self._pending_measurement(),
                "trace_from": self._trace_from}

    def _pending_measurement(self) -> list[float]:
        """The step whose exchange ended last, measured: ``begin_step`` adds it at the next
        step's start, which a checkpoint taken between steps would otherwise lose."""
        if self._end is None or self.planned_at is None:
            return []
        s, end = self._end
        start = self._starts.get(s)
        return [end - start] if start is not None and s > self.planned_at else []

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"planned-exchange state of format {state.get('format')!r}; this "
                             f"version reads format {STATE_FORMAT}")
        if state["names"] != self.names:
            self._adopt(state)
            return
        self.chosen = None if state["chosen"] is None else list(state["chosen"])
        cost = state.get("cost")
        self.cost = None if cost is None else CostModel.from_dict(cost)
        # the plan's sufficient-factor choices (absent from checkpoints of older versions)
        self._factors_planned = {self._position[name]: (int(k), bool(f))
                                 for name, (k, f) in state.get("factors", {}).items()}
        self._factor_rows = {i: k for i, (k, _) in self._factors_planned.items()}
        # the plan and its drift checks (absent from checkpoints of older versions: those
        # keep the choices, without drift checks)
        saved = state.get("plan")
        self.plan = None if saved is None else plan_from_dict(saved)
        self._placements = None
        self.planned_at = state.get("planned_at")
        self.checks = [DriftCheck(**c) for c in state.get("checks", [])]
        self._ratio = float(state.get("ratio", 1.0))
        self._calibrate_ratio = bool(state.get("calibrate_ratio", False))
        for queue, times in zip(self._ready, state.get("ready", [])):
            queue.clear()
            queue.extend(float(t) for t in times)
        self._measured = [float(t) for t in state.get("measured", [])]
        self._trace_from = state.get("trace_from", 0)
        self._starts, self._end = {}, None

    def _adopt(self, state: dict) -> None:
        """The state of an exchange of other gradients (this optimizer's, before parameters
        were frozen, unfrozen or added): its plan does not fit them. The machine's model and
        the drift checks so far carry over, and each gradient's ready times by name; this
        set is traced again (the uniform quantized exchange) from the next step, then
        planned. Every rank changes its parameters alike, so every rank does the same."""
        position = {n: i for i, n in enumerate(state["names"])}
        ready = state.get("ready", [])
        for name, queue in zip(self.names, self._ready):
            j = position.get(name)
            queue.clear()
            if j is not None and j < len(ready):
                queue.extend(float(t) for t in ready[j])
        cost = state.get("cost")
        self.cost = None if cost is None else CostModel.from_dict(cost)
        self.checks = [DriftCheck(**c) for c in state.get("checks", [])]
        self.chosen, self.plan, self.planned_at = None, None, None
        self._placements = None
        self._factors_planned, self._factor_rows = {}, {}
        self._ratio, self._calibrate_ratio, self._measured = 1.0, False, []
        self._trace_from = None
        self._starts, self._end = {}, None


def _option_to_list(o: Option) -> list:
    return [o.name, o.compress_s, [[k.value, b] for k, b in o.wire], o.decompress_s,
            o.linear_s, [[n, k.value] for n, k in o.calls], o.cpu_s]


def _option_from_list(v: list) -> Option:
    name, compress_s, wire, decompress_s, linear_s, calls, cpu_s = v
    return Option(name, float(compress_s), tuple((Collective(k), int(b)) for k, b in wire),
                  float(decompress_s), float(linear_s),
                  tuple((n, Collective(k)) for n, k in calls), float(cpu_s))


def agreed_profile(ready_times: list, settings, transport,
                   device=None) -> tuple[list, CostModel]:
    """The ready times and the cost model every rank plans with: MAX over ranks of
    the latest ready time, the slowest quantizer and factor rebuild (as 1/throughput)
    and the most crowded host; the link measured (or ``assume_gbit``). ``ready_times``:
    per tensor, this rank's traced ready times; ``settings``: the PlannedCompression;
    ``device``: the device profile to weigh placements with (None: no choice)."""
    from cgx.comm.base import ReduceOp
    from cgx.policy.planner.calibration import (contention, link_model, machine_throughput,
                                         ranks_on_this_host)
    n = len(ready_times)
    local = torch.tensor([statistics.median(r) if r else 0.0 for r in ready_times] + [
        0.0] * 5, dtype=torch.float64)
    tp = machine_throughput(settings.bits, settings.bucket_size)
    local[n:] = torch.tensor([1.0 / tp["compress_bps"], 1.0 / tp["decompress_bps"],
                              1.0 / tp["cast_bps"],
                              contention(ranks_on_this_host(transport),
                                         0 if transport.device.type == "cuda" else None),
                              1.0 / tp["matmul_flops"]], dtype=torch.float64)
    agreed = local.to(transport.device)
    if transport.size > 1:
        transport.allreduce(agreed, ReduceOp.MAX)
    agreed = agreed.cpu().tolist()
    ready, inv = agreed[:n], agreed[n:]
    speeds = dict(compress_bps=1 / inv[0], decompress_bps=1 / inv[1], cast_bps=1 / inv[2],
                  contention=inv[3], matmul_flops=1 / inv[4])
    speeds["device"] = device
    if settings.assume_gbit is not None:
        return ready, CostModel.uniform(transport.size, settings.assume_gbit, **speeds)
    return ready, CostModel(transport.size, link_model(transport), **speeds)


def device_profile(settings, transport):
    """Where compression may run, for the planner: ``settings.device_profile`` when given;
    on a CUDA transport, rank 0's :func:`cgx.policy.planner.placement.calibrate_device` (every
    rank plans with the same; a collective); else None (CPU tensors: no choice)."""
    given = getattr(settings, "device_profile", None)
    if given is not None or transport.device.type != "cuda":
        return given
    from cgx.policy.planner.placement import DeviceProfile, calibrate_device
    mine = calibrate_device(transport.device, bits=settings.bits,
                            bucket_size=settings.bucket_size).to_dict() \
        if transport.rank == 0 else None
    return DeviceProfile.from_dict(transport.allgather_object(mine)[0])


def plan_to_dict(p: ExchangePlan) -> dict:
    """A :class:`ExchangePlan` as plain values (checkpoints): the inverse of :func:`plan_from_dict`."""
    t = p.timeline
    return {"tensors": [[x.name, x.numel, x.ready_s, None if x.shape is None else list(x.shape),
                         x.rows] for x in p.tensors],
            "options": [[_option_to_list(o) for o in opts] for opts in p.options],
            "choice": list(p.choice), "groups": [list(g) for g in p.groups],
            "fusion_bytes": p.fusion_bytes,
            "timeline": [t.step_s, t.backward_s, t.tail_s, [list(g) for g in t.groups], t.cpu_s],
            "model": p.model.to_dict(), "backward_s": p.backward_s, "tail_s": p.tail_s,
            "decision_s": p.decision_s}


def plan_from_dict(d: dict) -> ExchangePlan:
    step_s, backward_s, tail_s, spans, cpu_s = d["timeline"]
    return ExchangePlan(
        tensors=[TensorProfile(name, int(numel), float(ready),
                               None if shape is None else tuple(shape), rows)
                 for name, numel, ready, shape, rows in d["tensors"]],
        options=[[_option_from_list(o) for o in opts] for opts in d["options"]],
        choice=[int(c) for c in d["choice"]], groups=[list(g) for g in d["groups"]],
        fusion_bytes=float(d["fusion_bytes"]),
        timeline=SimulatedStep(float(step_s), float(backward_s), float(tail_s),
                          tuple(tuple(g) for g in spans), float(cpu_s)),
        model=CostModel.from_dict(d["model"]), backward_s=float(d["backward_s"]),
        tail_s=float(d["tail_s"]), decision_s=float(d["decision_s"]))
