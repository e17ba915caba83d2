"""One object per way a list of gradients travels, each with its ``reduce``.

:class:`cgx.exchange.plan.GradientPlan` picks one (:func:`make_mode`) and hands it
each call's tensors on the engine thread. Every mode reduces in place and reads the
shared :class:`Settings` (op, predivide, error feedback, the residual store).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import torch

from cgx.policy.update_rule import UpdateRule
from cgx.comm.base import ReduceOp
from cgx.exchange.residuals import ResidualStore
from cgx.policy import GradMode
from cgx.quant.codec import FLOAT_DTYPES


@dataclasses.dataclass
class Settings:
    """What every mode reads: the reduction op, the predivide factor, whether residuals
    are kept, where they are kept, and the optimizer's update rule."""

    op: ReduceOp
    predivide: float
    error_feedback: bool
    store: ResidualStore
    update_rule: UpdateRule = UpdateRule.UNKNOWN


@dataclasses.dataclass
class Call:
    """One reduction call: the tensors (in place), which of the plan's they are, their
    names and specs, the rounding step, and whether they are a joined rank's zeros."""

    work: list
    idx: list
    names: list
    specs: list
    step: int
    shadow: bool
    label: str


def _layer_errors(names, specs, work, threads: int):
    """``ReduceStats`` holding this rank's relative compression error per compressed layer.

    Hidden cost: one quantize pass (with write-back) of a copy of each compressed
    gradient; it runs only every ``CGX_STATS_EVERY`` steps.
    """
    from cgx.policy.levels.stats import quantization_error
    from cgx.collectives.reducer import ReduceStats
    errors = {}
    for n, s, w in zip(names, specs, work):
        if s is None or w.numel() == 0:
            continue
        norm = float(w.detach().float().norm())
        errors[n] = quantization_error(w, s, threads) / norm if norm > 0 else 0.0
    return ReduceStats(layer_error=errors)


def reduce_fused(cfg: Settings, red, call: Call, specs: Sequence,
                 placements: Optional[Sequence] = None) -> None:
    """One fused reducer call: each tensor quantized by its spec, or exact (None);
    ``placements``: where each CUDA tensor is quantized (None: on its GPU)."""
    work = call.work
    # The reducer quantizes float32/16/bf16 only; float64 travels exact.
    specs = [s if s is not None and w.dtype in FLOAT_DTYPES else None
             for s, w in zip(specs, work)]
    every = red.config.stats_every
    if every and call.step % every == 0 and not call.shadow:
        red.add_stats(_layer_errors(call.names, specs, work, red.config.cpu_threads))
    residuals = None
    if cfg.store.keeps_any() and not call.shadow:
        cfg.store.send_with_exact(work, call.names, specs)
        residuals = cfg.store.buffers(work, call.names, specs)
    red.allreduce(work, specs, op=cfg.op, prescale_factor=1.0 / cfg.predivide,
                  postscale_factor=cfg.predivide, name=call.label, residuals=residuals,
                  step=call.step, placements=placements)
    if residuals is not None:
        cfg.store.settle(call.names, residuals)


def reduce_family(cfg: Settings, red, comp, ws: list, names: list) -> None:
    """Top-k or PowerSGD tensors in as few collectives as the family allows, in place;
    counted in the reducer's statistics (the bytes sent by the transport itself)."""
    from cgx.collectives.reducer import ReduceStats
    pre, post = 1.0 / cfg.predivide, cfg.predivide
    if pre != 1.0:
        for w in ws:
            w.mul_(pre)
    outs = comp.allreduce_many(ws, red.transport, names, cfg.op)
    for w, o in zip(ws, outs):
        if o is not w:  # a family that reduced in place returns the tensor itself
            w.copy_(o.view_as(w))
        if post != 1.0:
            w.mul_(post)
    numel, world = sum(w.numel() for w in ws), red.transport.size
    red.add_stats(ReduceStats(calls=1, numel=numel,
                              input_bytes=sum(w.numel() * w.element_size() for w in ws),
                              seconds={"_fp32_wire": float(2 * (world - 1) * 4 * numel
                                                           // world)}))


class Mode:
    """A way to reduce; subclasses implement :meth:`reduce`."""

    kind: GradMode

    def __init__(self, cfg: Settings, compression):
        self.cfg = cfg
        self.compression = compression

    def begin_step(self, step: int, red) -> None:
        """Start of ``step`` (engine thread, every rank): what the mode decides per step."""

    def carry_step(self, old: "Mode") -> None:
        """Take over ``old``'s view of the step under way (the same gradients, laid out
        again in the middle of a step): what it decided at its begin_step still holds."""

    def reduce(self, red, call: Call) -> None:
        raise NotImplementedError

    def specs_now(self, specs: list) -> list:
        """The specs the next step uses (the plan's fixed ones unless the mode decides)."""
        return specs

    def compressors(self) -> tuple:
        """What may hold residuals of this mode's tensors."""
        return (self.compression,)

    def held(self, name: str) -> list[torch.Tensor]:
        """What the mode's compressors hold for ``name``, flat float32, gradient units."""
        parts = []
        for comp in self.compressors():
            e = comp.residual(name) if callable(getattr(comp, "residual", None)) else None
            if e is not None:
                parts.append(e.detach().reshape(-1).to(torch.float32) * self.cfg.predivide)
        return parts

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Fused(Mode):
    """EXACT and QUANTIZE: one fused reducer call, each tensor by its fixed spec."""

    def __init__(self, cfg: Settings, compression, kind: GradMode):
        super().__init__(cfg, compression)
        self.kind = kind

    def reduce(self, red, call: Call) -> None:
        reduce_fused(self.cfg, red, call, call.specs)


class Summable(Mode):
    """fp16/bf16/Horovod-style casts: cast payloads summed in one plain allreduce."""

    kind = GradMode.SUMMABLE

    def reduce(self, red, call: Call) -> None:
        comp, pre = self.compression, 1.0 / self.cfg.predivide
        pairs = [comp.compress_for_reduction(w.mul_(pre) if pre != 1.0 else w,
                                             red.transport, n)
                 for n, w in zip(call.names, call.work)]
        red.allreduce([p for p, _ in pairs], None, op=ReduceOp.SUM, name=call.label)
        scale = self.cfg.predivide
        if self.cfg.op is ReduceOp.AVERAGE:
            scale /= red.transport.size
        for w, (payload, ctx) in zip(call.work, pairs):
            w.copy_(comp.decompress(payload, ctx).view_as(w))
            if scale != 1.0:
                w.mul_(scale)


class PerTensor(Mode):
    """Top-k, PowerSGD: exact tensors in one allreduce, the others by the family."""

    kind = GradMode.PER_TENSOR

    def reduce(self, red, call: Call) -> None:
        work, specs = call.work, call.specs
        plain = [k for k, s in enumerate(specs) if s is None]
        if plain:
            red.allreduce([work[k] for k in plain], None, op=self.cfg.op, name=call.label,
                          prescale_factor=1.0 / self.cfg.predivide,
                          postscale_factor=self.cfg.predivide)
        # The compressed tensors of this call in as few collectives as the family
        # allows (top-k: one allgather; PowerSGD: one allreduce of P, one of Q).
        packed = [k for k, s in enumerate(specs) if s is not None]
        if packed:
            reduce_family(self.cfg, red, self.compression, [work[k] for k in packed],
                          [call.names[k] for k in packed])


class Planned(Mode):
    """Traced first, then each tensor exact or quantized as the planner decides; with
    trials (the default), the planner's plan, all exact and all quantized take turns and
    the fastest measured travels (:mod:`cgx.policy.trials.planned_decider`)."""

    kind = GradMode.PLANNED

    def __init__(self, cfg: Settings, compression, planned):
        super().__init__(cfg, compression)
        from cgx.policy.trials.planned_decider import PlannedDecider
        self.planned = planned  # cgx.policy.planner.schedule.PlannedSchedule
        trials = getattr(compression, "trials", None)
        self.decider = PlannedDecider(planned, trials) if trials is not None else None
        self.last_step: Optional[int] = None
        self._chosen: Optional[list] = None  # the trial's or kept plan (None: the planner's)
        # this step's specs and placements (set once a step: every call of it reads them)
        self._specs: Optional[list] = None
        self._where: Optional[list] = None
        # a plan restored without trials (a checkpoint of trials=False or of an older
        # version): tried at the next step
        self._untried = False

    def begin_step(self, step: int, red) -> None:
        if step == self.last_step:
            return
        self.last_step = step
        t, verbose, timeline = red.transport, red.config.verbose, red.timeline
        if self.decider is None:
            self.planned.begin_step(step, t, verbose, timeline)
        else:
            self.decider.tick(step, t, verbose, timeline)  # a re-trial re-plans first
            before, since = self.planned.planned_at, time.perf_counter()
            self.planned.begin_step(step, t, verbose, timeline, check_drift=False)
            fresh = self.planned.planned_at == step and before != step  # a new plan: try it
            if fresh or self._untried and self.planned.chosen is not None:
                self._untried = False
                self.decider.propose(step, t, verbose, timeline, since)
            self._chosen = self.decider.plan_now(step, timeline)
        self._specs, self._where = self._travelling()

    def carry_step(self, old: Mode) -> None:
        if isinstance(old, Planned) and old.planned.names == self.planned.names:
            self.last_step, self._chosen = old.last_step, old._chosen
            self._specs, self._where = self._travelling()

    def _travelling(self) -> tuple:
        """The specs of the plan that travels, and where each CUDA tensor is quantized: the
        planner's placements while its plan travels (None: on the tensor's device; the
        exact and uniform plans keep that)."""
        p, chosen = self.planned, self._chosen
        if chosen is None or chosen == p.chosen:
            return p.specs(), p.placements()
        return [s if c else None for s, c in zip(p.eligible, chosen)], None

    def specs_now(self, specs: list) -> list:
        return self._specs if self._specs is not None else self._travelling()[0]

    def reduce(self, red, call: Call) -> None:
        self.begin_step(call.step, red)
        now, where = self.specs_now(call.specs), self._where
        reduce_fused(self.cfg, red, call, [now[i] for i in call.idx],
                     None if where is None else [where[i] for i in call.idx])
        if not call.shadow:
            self.planned.note_reduced(call.step)

    def state_dict(self) -> dict:
        state = {"planned": self.planned.state_dict()}
        if self.decider is not None:
            state["decider"] = self.decider.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "planned" not in state:
            return
        same = state["planned"].get("names") == self.planned.names
        self.planned.load_state_dict(state["planned"])
        self._specs = self._where = None  # read again at the next step
        # the trials of other gradients (parameters frozen or added since) do not apply:
        # this set is traced and planned again, then tried
        if self.decider is not None and "decider" in state and same:
            self.decider.load_state_dict(state["decider"])
        elif self.decider is not None:
            self._untried = self.planned.chosen is not None
