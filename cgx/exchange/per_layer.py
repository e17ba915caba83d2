"""The AUTO mode: per-layer families and levels chosen within an error budget
(``cgx.policy.levels``), optionally with the planner (``Compression.auto(planner=True)``).

Each call reduces each family's tensors together: quantized and exact ones in one fused
call, top-k ones in one allgather, PowerSGD ones in two allreduces, then the fp16 ones and
the bf16 ones in one allreduce each (that order on every rank). Residuals stay with
their family while a layer keeps it (a new quantization level, top-k density or PowerSGD
rank keeps them; PowerSGD also keeps its warm start; a cast keeps none). When a layer
changes family, what its old compressor still owed is added once to its next
gradient, which the new compressor then carries (and, with error feedback, owes in its
turn). Every family's residual is in input units (after the ``1 / predivide`` prescale),
so what is owed is exactly what was dropped, whichever chunk of the fused reduction the
values fell in.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from cgx.policy.levels import AdaptiveSchedule
from cgx.policy.levels import probe
from cgx.policy.levels.candidates import CASTS, Family
from cgx.policy.update_rule import named_form
from cgx.comm.base import ReduceOp
from cgx.compression import ErrorFeedback
from cgx.compression.auto_policy import Objective
from cgx.compression.planned_policy import PlannedCompression
from cgx.policy.trials import Decider
from cgx.exchange.modes import Call, Mode, Settings, reduce_family, reduce_fused
from cgx.policy import GradMode
from cgx.quant.codec import QuantSpec


# The families reduced apart from the fused quantized/exact call, in this order.
SEPARATE = (Family.TOPK, Family.POWERSGD, *CASTS)


class FusedCast:
    """A 16-bit cast family's tensors in one allreduce: ``Compression.fp16``'s (or bf16's)
    reduction of their concatenation (predivided by the world size, summed on the wire,
    scaled back), as DDP's fp16/bf16 hooks do per bucket.

    Float32 gradients take one pass each way: each is divided and cast straight into a
    wire-type buffer kept between calls, and the sum is cast back into the gradient
    itself (float32 math, so the values are the compressor's bit for bit). Other dtypes
    go through the compressor on a float32 concatenation."""

    def __init__(self, family: Family):
        from cgx.compression.casts import BF16Compressor, FP16Compressor
        self.compressor = FP16Compressor() if family is Family.FP16 else BF16Compressor()
        self._wire: Optional[torch.Tensor] = None  # the wire-type buffer, grown as needed

    def allreduce_many(self, ws: list, transport, names: list, op) -> list:
        if any(w.dtype != torch.float32 for w in ws):
            flat = torch.cat([w.detach().reshape(-1).float() for w in ws])
            out = self.compressor.allreduce(flat, transport, op=op)
            return list(out.split([w.numel() for w in ws]))
        total = sum(w.numel() for w in ws)
        if total == 0:  # same shapes everywhere: nothing to exchange
            return list(ws)
        c = self.compressor
        f = c.predivide if c.predivide is not None else float(transport.size)
        wire = self._buffer(total, ws[0].device)
        segs, off = [], 0
        for w in ws:
            segs.append(wire[off:off + w.numel()])
            torch.div(w.reshape(-1), f, out=segs[-1])  # float32 math, one rounding
            off += w.numel()
        average = op is ReduceOp.AVERAGE
        transport.allreduce(wire, ReduceOp.SUM if average else op)
        factor = f / transport.size if average else f
        for w, seg in zip(ws, segs):
            w.copy_(seg.view_as(w))
            if factor != 1.0:
                w.mul_(factor)
        return list(ws)

    def _buffer(self, numel: int, device) -> torch.Tensor:
        wire = self._wire
        if wire is None or wire.numel() < numel or wire.device != device:
            self._wire = wire = torch.empty(numel, dtype=self.compressor.wire_dtype,
                                            device=device)
        return wire[:numel]


def _planner_for(adaptive: AdaptiveSchedule, comp, names, shapes, base):
    """The planner auto consults (``Compression.auto(planner=True)``), traced like the
    planned mode with auto's default level."""
    from cgx.policy.planner.schedule import PlannedSchedule
    d = adaptive.default
    bits, bucket = (d.bits, d.bucket_size) if d.family is Family.QUANTIZE else (4, 1024)
    return PlannedSchedule(
        names, shapes, [QuantSpec(bits, bucket) if c is not None else None
                        for c in adaptive.candidates],
        PlannedCompression(bits=bits, bucket_size=bucket, calibrate_steps=2, trials=False,
                           assume_gbit=comp.assume_gbit, replan_every=0),
        base.inner_reduction, base.fusion_buffer_mb)


def _compensations(compression, base, deciding: bool) -> tuple:
    """The compensations auto measures between per quantized layer
    (:func:`cgx.policy.levels.probe.options_for`). The deciding exchange left to its default
    (``error_feedback=None``) measures none: it keeps the fixed default's residual setting,
    since residuals cost every plan step time and the probe weighs accuracy alone."""
    if deciding and compression.error_feedback is None:
        return ()
    return probe.options_for(compression.error_feedback, named_form(base.compensation))


class Auto(Mode):
    """Per-layer levels of every family, re-planned as the gradients' statistics change.

    Args:
        cfg: the shared settings.
        compression: the ``Compression.auto(...)`` settings.
        names, shapes, specs: the plan's tensors (a None spec: the rules keep it exact).
        base: the configuration the levels start from.
    """

    kind = GradMode.AUTO

    def __init__(self, cfg: Settings, compression, names, shapes, specs, base):
        super().__init__(cfg, compression)
        from cgx.compression.powersgd import PowerSGDCompressor
        from cgx.compression.topk import TopKCompressor
        self.names = list(names)
        deciding = compression.objective is Objective.TIME
        self.adaptive = AdaptiveSchedule(
            self.names, shapes, [s is not None for s in specs], compression,
            base if base.quantization_enabled else base.replace(bits=4),
            error_feedback=cfg.error_feedback,
            compensations=_compensations(compression, base, deciding),
            update_rule=cfg.update_rule, beta=cfg.store.compensator.settings.beta)
        # Layers planned to top-k or PowerSGD reduce through these (per-layer density and
        # rank set from the plan; with error feedback both keep their residuals, as
        # quantized layers do: one rule for every family; PowerSGD keeps its warm starts).
        self.topk = ErrorFeedback(TopKCompressor())
        self.powersgd = PowerSGDCompressor(min_compression_rate=0.0,
                                           error_feedback=cfg.error_feedback)
        self.casts = {f: FusedCast(f) for f in CASTS}
        self.planned = _planner_for(self.adaptive, compression, self.names, shapes,
                                    base) if compression.planner or deciding else None
        # objective="time": trials of whole plans decide what travels (cgx.policy.trials)
        self.decider = Decider(self.adaptive, self.planned, compression) if deciding else None
        self.last_step: Optional[int] = None

    def begin_step(self, step: int, red) -> None:
        """A sufficient-factor layer's exchange may be a step's first (engine thread, every
        rank): re-plan when due and set the plan that travels, its factor say included,
        before it."""
        self._replan_when_due(step, red)

    def _replan_when_due(self, step: int, red) -> None:
        """Re-plan when due (a collective, at the first reduction of a step on every rank);
        with trials, the plan they run or kept."""
        if step == self.last_step:
            return
        self.last_step = step
        sched, verbose = self.adaptive, red.config.verbose
        sched.measure_share(red.transport.rank, red.transport.size)
        if self.decider is not None:  # times the last step first: the round may end
            self.decider.tick(step, red.transport, verbose, red.timeline)
        if sched.due(step):
            old, since = list(sched.plan), time.perf_counter()
            hidden = ()
            if self.planned is not None:  # the planner first: exact where that is as fast
                self.planned.replan(red.transport, False, step=step, timeline=red.timeline)
                hidden = [i for i, c in enumerate(self.planned.chosen)
                          if not c and sched.candidates[i] is not None]
            # with trials, auto's own plan is the fewest bytes alone (the decider combines)
            sched.replan(step, red.transport, red.config.cpu_threads, verbose,
                         hidden=() if self.decider is not None else hidden)
            if self.decider is not None:
                self.decider.replanned(step, red.transport, verbose, red.timeline, since)
            self._collect_owed(old)
            self.cfg.store.set_kinds(sched.compensation)
        trial_plan = self.decider.plan_now(step, red.timeline) if self.decider else None
        if self.decider is not None:
            self.planned.factors_rule = self.decider.factors_now(step)
        if trial_plan is not None and trial_plan != sched.plan:
            old = list(sched.plan)
            sched.plan[:] = trial_plan
            self._collect_owed(old)

    def _collect_owed(self, old_plan: list) -> None:
        """After a re-plan: what the old compressor of each layer that changed family still
        owed, to be added once to the layer's next gradient."""
        holders = {Family.TOPK: self.topk, Family.POWERSGD: self.powersgd}
        for i, (before, now) in enumerate(zip(old_plan, self.adaptive.plan)):
            fb = Family.EXACT if before is None else before.family
            fn = Family.EXACT if now is None else now.family
            if fb is fn:
                continue
            n, holder, store = self.names[i], holders.get(fb), self.cfg.store
            store.owe(n, holder.take_residual(n) if holder is not None
                      else store.residuals.pop(n, None))

    def reduce(self, red, call: Call) -> None:
        self._replan_when_due(call.step, red)
        sched = self.adaptive
        chosen = sched.choices(call.step)
        chosen = [chosen[i] for i in call.idx]
        fam = [None if c is None else c.family for c in chosen]
        if not call.shadow:
            if sched.observing(call.step):  # the gradients alone (see cgx.policy.levels.stats)
                sched.observe(call.step, call.idx, call.work)
            self.cfg.store.add_owed(call.work, call.names)
        plain = [k for k in range(len(call.work))
                 if fam[k] not in SEPARATE and fam[k] is not Family.SUMMABLE]
        if plain:
            sub = Call([call.work[k] for k in plain], [call.idx[k] for k in plain],
                       [call.names[k] for k in plain], [], call.step, call.shadow, call.label)
            reduce_fused(self.cfg, red, sub, [chosen[k].spec(sched.rounding)
                                              if fam[k] is Family.QUANTIZE else None
                                              for k in plain])
        for family in SEPARATE:
            ks = [k for k in range(len(call.work)) if fam[k] is family]
            if not ks:
                continue
            ws, names = [call.work[k] for k in ks], [call.names[k] for k in ks]
            if family in CASTS:  # no state: a joined rank's zeros travel the same way
                reduce_family(self.cfg, red, self.casts[family], ws, names)
            else:
                self._reduce_family(red, family, ws, names, [chosen[k] for k in ks],
                                    call.shadow)
        self._reduce_registered(red, call, chosen)

    def _reduce_registered(self, red, call: Call, chosen: list) -> None:
        """The layers planned to a registered family: one allreduce of the payloads per
        level, in the plan's order on every rank (no state: a joined rank's zeros travel
        the same way)."""
        levels = list(dict.fromkeys(c for c in chosen if c is not None and c.custom))
        for c in levels:
            ks = [k for k, ck in enumerate(chosen) if ck == c]
            reduce_family(self.cfg, red, c.compressor(), [call.work[k] for k in ks],
                          [call.names[k] for k in ks])

    def _reduce_family(self, red, family: Family, ws: list, names: list, chosen: list,
                       shadow: bool) -> None:
        comp = self.topk if family is Family.TOPK else self.powersgd
        inner = comp.inner
        for n, c in zip(names, chosen):
            if family is Family.TOPK:
                inner.densities[n] = c.density
            else:
                inner.ranks[n] = c.rank
        if shadow:  # zeros for a joined rank: no residual sent, no state changed
            with comp.untouched(names):
                reduce_family(self.cfg, red, inner, ws, names)
        else:
            reduce_family(self.cfg, red, comp if self.cfg.error_feedback else inner, ws, names)

    def compressors(self) -> tuple:
        return (self.topk, self.powersgd)

    def state_dict(self) -> dict:
        state = {"adaptive": self.adaptive.state_dict(), "last_step": self.last_step,
                 "auto_topk": self.topk.state_dict(),
                 "auto_powersgd": self.powersgd.state_dict()}
        if self.planned is not None:
            state["planned"] = self.planned.state_dict()
        if self.decider is not None:
            state["decider"] = self.decider.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])
            self.cfg.store.set_kinds(self.adaptive.compensation, restored=True)
            self.last_step = state.get("last_step")
            if "auto_topk" in state:
                self.topk.load_state_dict(state["auto_topk"])
                self.powersgd.load_state_dict(state["auto_powersgd"])
        if self.planned is not None and "planned" in state:
            self.planned.load_state_dict(state["planned"])
        if self.decider is not None and "decider" in state:
            self.decider.load_state_dict(state["decider"])
