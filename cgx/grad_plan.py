"""How a list of gradients travels: the compression mode, per-tensor specs, residuals.

Framework-free (torch tensors and the cgx core only): both adapters'
optimizers (``cgx.torch.DistributedOptimizer``, the Keras ``DistributedOptimizer``
and ``DistributedGradientTape``) hand their gradients over as torch tensors and
run :meth:`GradientPlan.reduce` on the engine thread. A ``compression=``
argument maps to a :class:`GradMode`:

=====================================  ==========  ====================================
``compression=``                       mode        what travels
=====================================  ==========  ====================================
``Compression.none`` (the default)     QUANTIZE    the environment decides: ``CGX_*``
                                                   quantization, per-layer rules
                                                   (EXACT with ``..._BITS=32``)
``Compression.exact``                  EXACT       plain fused allreduce
``Compression.quantize(...)``          QUANTIZE    its bits/bucket/rounding, with rules
``fp16``, ``bf16``, Horovod-style      SUMMABLE    cast payloads, one plain allreduce
``topk(...)``, ``powersgd(...)``       PER_TENSOR  the compressor's own reduction, batched per bucket
=====================================  ==========  ====================================

In QUANTIZE mode, :meth:`cgx.rules.LayerRules.spec_for` decides per tensor
(by name and shape) whether it is quantized and how; small and 1-D tensors
travel exact. Error feedback (``CGX_COMPRESSION_ERROR_FEEDBACK=1`` with
``Compression.none``, or ``Compression.quantize(error_feedback=True)``) keeps
one float32 residual per compressed tensor in this object.

Example::

    plan = GradientPlan(["fc1/kernel", "fc1/bias"], [(784, 256), (256,)])
    out = session.run(plan.reduce, [g_kernel.clone(), g_bias.clone()], name="grads")
"""

from __future__ import annotations

import contextlib
import enum
import math
from typing import Optional, Sequence

import torch

from cgx import runtime
from cgx import process_sets
from cgx.comm.base import ReduceOp
from cgx.adaptive import AdaptiveSchedule
from cgx.adaptive.candidates import Family
from cgx.adaptive.compensation import UpdateRule, error_feedback_for
from cgx.compression.planned import PlannedCompression
from cgx.compression import (AutoCompression, Compression, CompressorKind, ErrorFeedback,
                             ExactCompressor, QuantizeCompressor, as_compressor)
from cgx.quant.codec import FLOAT_DTYPES, QuantSpec
from cgx.config import CompressionMode, Config
from cgx.rules import LayerRules

FIRST_BUCKET_BYTES = 1 << 20  # small first bucket: its reduction starts early in backward


def ready_order_buckets(nbytes: Sequence[int], cap_bytes: int,
                        first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Fusion buckets in the order backward produces gradients (the last parameter's
    first): consecutive indices of ``nbytes`` (float32 bytes per gradient, in parameter
    order) until a bucket would exceed ``cap_bytes``; the first bucket is capped at
    ``first_bytes`` so that its exchange starts early. A gradient larger than the cap
    gets a bucket of its own."""
    buckets, cur, size = [], [], 0
    limit = min(cap_bytes, first_bytes)
    for i in range(len(nbytes) - 1, -1, -1):
        if cur and size + nbytes[i] > limit:
            buckets.append(cur)
            cur, size, limit = [], 0, cap_bytes
        cur.append(i)
        size += nbytes[i]
    if cur:
        buckets.append(cur)
    return buckets

STATE_FORMAT = 1


class GradMode(enum.Enum):
    """How a list of gradients travels."""

    EXACT = "exact"  # plain fused allreduce
    QUANTIZE = "quantize"  # fused compressed allreduce (SRA/ring/allgather), per-layer specs
    SUMMABLE = "summable"  # cast payloads (fp16, bf16, Horovod-style), fused plain allreduce
    PER_TENSOR = "per_tensor"  # top-k, PowerSGD: the compressor's own reduction, per bucket
    AUTO = "auto"  # per-layer levels chosen within an error budget (cgx.adaptive)
    PLANNED = "planned"  # per tensor exact or quantized, as the planner decides (cgx.planner)


def unique_names(names: Sequence[Optional[str]], prefix: str) -> list[str]:
    """``names`` with None filled in and repeats made unique (``w``, ``w.1``, ``w.2``).

    Names key compressor state (residuals, warm starts), so two tensors must
    never share one; the suffixes depend only on the order, the same on every rank.
    """
    out, seen = [], {}
    for i, n in enumerate(names):
        n = n if n else f"{prefix}.noname.{i}"
        k = seen.get(n, 0)
        seen[n] = k + 1
        out.append(n if k == 0 else f"{n}.{k}")
    return out


def _layer_errors(names, specs, work, threads: int):
    """``ReduceStats`` holding this rank's relative compression error per compressed layer.

    Hidden cost: one quantize pass (with write-back) of a copy of each compressed
    gradient; it runs only every ``CGX_STATS_EVERY`` steps.
    """
    from cgx.adaptive.stats import quantization_error
    from cgx.collectives.reducer import ReduceStats
    errors = {}
    for n, s, w in zip(names, specs, work):
        if s is None or w.numel() == 0:
            continue
        norm = float(w.detach().float().norm())
        errors[n] = quantization_error(w, s, threads) / norm if norm > 0 else 0.0
    return ReduceStats(layer_error=errors)


@contextlib.contextmanager
def _untouched(comp, names: Sequence[str]):
    """Per-tensor state of ``names`` in ``comp`` (residuals, PowerSGD's warm starts and
    counters) as it was before the block; residuals are held out during it, so a joined
    rank's zeros go out as zeros."""
    tables = [getattr(comp, t) for t in ("_residuals", "_q", "_steps", "_draws")
              if hasattr(comp, t)]
    saved = [{n: t[n] for n in names if n in t} for t in tables]
    for n in names:
        comp._residuals.pop(n, None)
    try:
        yield
    finally:
        for t, kept in zip(tables, saved):
            for n in names:
                t.pop(n, None)
            t.update(kept)


class GradientPlan:
    """Reduction recipe for a fixed list of gradients (names, shapes, compression).

    Args:
        names: one name per gradient (variable path); keys rules and state.
        shapes: one shape per gradient.
        compression: a ``compression=`` argument (see the module docstring).
        op: ``ReduceOp.AVERAGE`` or ``ReduceOp.SUM``.
        predivide: with AVERAGE, divide by this before the sum and by
            ``size / predivide`` after.
        rules: per-layer rules (dict, list or YAML path, see ``cgx.rules``).
        config: defaults (``cgx.runtime.config()`` when omitted).
        group: a process set from :func:`cgx.process_sets.resolve` (None: all ranks).
        update_rule: the optimizer's :class:`cgx.adaptive.compensation.UpdateRule`;
            ``compression="auto"`` keeps residuals of quantized layers by it.

    Attributes:
        mode: the :class:`GradMode` chosen.
        specs: one ``QuantSpec`` (compressed) or None (exact) per gradient;
            in PER_TENSOR mode a spec only marks the tensor as compressed.
        step: reductions done so far; the default stochastic-rounding step.
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]],
                 compression=Compression.none, *, op: ReduceOp = ReduceOp.AVERAGE,
                 predivide: float = 1.0, rules=None, config: Optional[Config] = None,
                 group=None, update_rule: UpdateRule = UpdateRule.UNKNOWN):
        if len(names) != len(shapes):
            raise ValueError(f"got {len(names)} names for {len(shapes)} shapes; pass one "
                             "name per gradient")
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"gradients reduce with op Average or Sum, got {op!r}")
        cfg = config if config is not None else runtime.config()
        comp = as_compressor(compression)
        inner = comp.compressor if isinstance(comp, ErrorFeedback) else comp
        base, error_feedback = cfg, False
        if comp.kind is CompressorKind.NONE and cfg.compression is CompressionMode.AUTO:
            comp = AutoCompression(alpha=cfg.auto_alpha, window=cfg.auto_window,
                                   adjust_every=cfg.auto_adjust_every)
        if isinstance(comp, ExactCompressor):
            mode = GradMode.EXACT
        elif isinstance(comp, AutoCompression):
            mode = GradMode.AUTO
            error_feedback = error_feedback_for(comp.error_feedback, update_rule,
                                                cfg.error_feedback)
        elif isinstance(comp, PlannedCompression):
            mode = GradMode.PLANNED
            base = cfg.replace(bits=comp.bits, bucket_size=comp.bucket_size)
            error_feedback = comp.error_feedback
        elif comp.kind is CompressorKind.NONE:
            mode = GradMode.QUANTIZE if cfg.quantization_enabled else GradMode.EXACT
            error_feedback = cfg.error_feedback
        elif isinstance(inner, QuantizeCompressor):
            mode = GradMode.QUANTIZE
            base = cfg.replace(bits=inner.bits, bucket_size=inner.bucket_size,
                               rounding=inner.rounding)
            error_feedback = isinstance(comp, ErrorFeedback)
        elif comp.summable:
            mode = GradMode.SUMMABLE
        else:
            mode = GradMode.PER_TENSOR
        layer_rules = LayerRules.from_config(base, rules)
        self.names = list(names)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.compression = comp
        self.op = op
        self.predivide = float(predivide)
        self.mode = mode
        self.error_feedback = error_feedback
        self.specs = [layer_rules.spec_for(n, s)
                      if mode in (GradMode.QUANTIZE, GradMode.PER_TENSOR, GradMode.AUTO,
                                  GradMode.PLANNED)
                      else None for n, s in zip(self.names, self.shapes)]
        self.step = 0
        self.group = group
        self._residuals: dict[str, torch.Tensor] = {}
        # AUTO: the per-layer plan; layers the rules leave exact are not planned.
        self.adaptive = AdaptiveSchedule(
            self.names, self.shapes, [s is not None for s in self.specs], comp,
            cfg if cfg.quantization_enabled else cfg.replace(bits=4),
            error_feedback=error_feedback) if mode is GradMode.AUTO else None
        # AUTO: layers planned to top-k or PowerSGD reduce through these (per-layer density
        # and rank set from the plan; with error feedback both keep their residuals, as
        # quantized layers do: one rule for every family; PowerSGD keeps its warm starts).
        self._auto_topk = self._auto_psgd = None
        self._owed: dict[str, torch.Tensor] = {}  # AUTO: residuals to send once (family change)
        if mode is GradMode.AUTO:
            from cgx.compression.powersgd import PowerSGDCompressor
            from cgx.compression.topk import TopKCompressor
            self._auto_topk = ErrorFeedback(TopKCompressor())
            self._auto_psgd = PowerSGDCompressor(min_compression_rate=0.0,
                                                 error_feedback=error_feedback)
        # PLANNED: traced first, then each tensor exact or quantized (cgx.planner).
        self.planned = None
        if mode is GradMode.PLANNED:
            from cgx.planner.schedule import PlannedSchedule
            self.planned = PlannedSchedule(self.names, self.shapes, self.specs, comp,
                                           base.inner_reduction, base.fusion_buffer_mb)
        elif mode is GradMode.AUTO and comp.planner:
            # AUTO with the planner: traced like the planned mode; consulted at each plan.
            from cgx.planner.schedule import PlannedSchedule
            d = self.adaptive.default
            bits, bucket = (d.bits, d.bucket_size) if d.family is Family.QUANTIZE else (4, 1024)
            self.planned = PlannedSchedule(
                self.names, self.shapes, [QuantSpec(bits, bucket) if c is not None else None
                                          for c in self.adaptive.candidates],
                PlannedCompression(bits=bits, bucket_size=bucket, calibrate_steps=2,
                                   assume_gbit=comp.assume_gbit, replan_every=0),
                base.inner_reduction, base.fusion_buffer_mb)
        self._last_step: Optional[int] = None
        # Exact exchange for the first steps (Compression.quantize/topk(warmup_steps=...),
        # PowerSGD's start_step plays that role for it).
        self.warmup_steps = int(getattr(comp, "warmup_steps", 0) or 0)

    def reduce(self, grads: list, *, name: str, step: Optional[int] = None,
               indices: Optional[Sequence[int]] = None, shadow: bool = False,
               reducer=None) -> list:
        """Reduce ``grads`` over all ranks; runs on the engine thread (``session.run``).

        Args:
            grads: contiguous torch tensors, owned by the caller (they are
                overwritten; the results may be these same tensors).
            name: the collective's label, the same on every rank (feeds the
                stochastic-rounding key).
            step: stochastic-rounding step (default: :attr:`step`); callers
                whose step survives checkpoints (an optimizer's iterations) pass it.
            indices: which of the plan's tensors ``grads`` are (default: all,
                in order); a bucketed caller reduces one bucket per call.
            shadow: zeros reduced on behalf of ranks that still train (join):
                error-feedback residuals are left alone.
            reducer: the Reducer to use (default: the session's, or the process set's);
                the DDP hook passes its own.

        Returns:
            The reduced tensors, shaped like ``grads``.
        """
        idx = list(range(len(self.names))) if indices is None else list(indices)
        if len(grads) != len(idx):
            raise ValueError(f"plan is for {len(idx)} gradients, got {len(grads)}")
        names = [self.names[i] for i in idx]
        specs = [self.specs[i] for i in idx]
        step = self.step if step is None else int(step)
        self.step += 1
        red = reducer if reducer is not None else process_sets.reducer_of(self.group)
        dev = red.transport.device
        work = [g if g.device == dev and g.is_contiguous() else g.contiguous().to(dev)
                for g in grads]
        pre, post = 1.0 / self.predivide, self.predivide
        if step < self.warmup_steps and self.mode in (GradMode.QUANTIZE, GradMode.PER_TENSOR):
            red.allreduce(work, None, op=self.op, prescale_factor=pre, postscale_factor=post,
                          name=name, step=step)
            return [w if w.device == g.device else w.to(g.device) for w, g in zip(work, grads)]
        if self.mode is GradMode.AUTO:
            self._reduce_auto(red, work, idx, step, shadow, name)
            return [w if w.device == g.device else w.to(g.device) for w, g in zip(work, grads)]
        if self.mode is GradMode.PLANNED:
            self.begin_step(step, red)
            planned = self.planned.specs()
            specs = [planned[i] for i in idx]
        if self.mode in (GradMode.EXACT, GradMode.QUANTIZE, GradMode.PLANNED):
            self._reduce_quantized(red, work, names, specs, step, shadow, name)
            if self.planned is not None and not shadow:
                self.planned.note_reduced(step)
        elif self.mode is GradMode.SUMMABLE:
            comp = self.compression
            pairs = [comp.compress_for_reduction(w.mul_(pre) if pre != 1.0 else w,
                                                 red.transport, n)
                     for n, w in zip(names, work)]
            red.allreduce([p for p, _ in pairs], None, op=ReduceOp.SUM, name=name)
            scale = post / red.transport.size if self.op is ReduceOp.AVERAGE else post
            for w, (payload, ctx) in zip(work, pairs):
                w.copy_(comp.decompress(payload, ctx).view_as(w))
                if scale != 1.0:
                    w.mul_(scale)
        else:
            plain = [k for k, s in enumerate(specs) if s is None]
            if plain:
                red.allreduce([work[k] for k in plain], None, op=self.op, name=name,
                              prescale_factor=pre, postscale_factor=post)
            # The compressed tensors of this call in as few collectives as the family
            # allows (top-k: one allgather; PowerSGD: one allreduce of P, one of Q).
            packed = [k for k, s in enumerate(specs) if s is not None]
            if packed:
                self._reduce_family(red, self.compression, [work[k] for k in packed],
                                    [names[k] for k in packed])
        return [w if w.device == g.device else w.to(g.device) for w, g in zip(work, grads)]

    def begin_step(self, step: int, red) -> None:
        """The planned exchange's start of ``step``: plan when due, check drift. Called at
        the first exchange of a step on every rank (engine thread): a reduction here, or
        a sufficient-factor layer's exchange (which may come first, or alone)."""
        if self.mode is GradMode.PLANNED and step != self._last_step:
            self._last_step = step
            self.planned.begin_step(step, red.transport, red.config.verbose, red.timeline)

    def _reduce_quantized(self, red, work: list, names: list, specs: list, step: int,
                          shadow: bool, name: str) -> None:
        """One fused reducer call: each tensor quantized by its spec, or exact (None)."""
        # The reducer quantizes float32/16/bf16 only; float64 travels exact.
        specs = [s if s is not None and w.dtype in FLOAT_DTYPES else None
                 for s, w in zip(specs, work)]
        if red.config.stats_every and step % red.config.stats_every == 0 and not shadow:
            red.add_stats(_layer_errors(names, specs, work, red.config.cpu_threads))
        residuals = None
        if self.error_feedback and not shadow:
            self._send_owed_exact(work, names, specs)
            residuals = [self._residual(n, w) if s is not None else None
                         for n, s, w in zip(names, specs, work)]
        red.allreduce(work, specs, op=self.op, prescale_factor=1.0 / self.predivide,
                      postscale_factor=self.predivide, name=name, residuals=residuals,
                      step=step)

    def _send_owed_exact(self, work: list, names: list, specs: list) -> None:
        """A tensor that travels exact this time (the plan changed, or auto chose exact)
        sends what its quantization still owed with it, and keeps no residual: a residual
        held through exact steps would come back stale when the tensor is quantized again.
        Residuals are in input units (see ``cgx.collectives.algorithms.ReduceContext``),
        i.e. after the ``1 / predivide`` prescale: ``predivide`` times that in gradient units."""
        for w, n, s in zip(work, names, specs):
            if s is None and n in self._residuals:
                e = self._residuals.pop(n)
                if e.numel() == w.numel():
                    w.view(-1).add_(e.to(w.device, w.dtype), alpha=self.predivide)

    def _reduce_family(self, red, comp, ws: list, names: list) -> None:
        """Top-k or PowerSGD tensors in as few collectives as the family allows, in place;
        counted in the reducer's statistics (the bytes sent by the transport itself)."""
        pre, post = 1.0 / self.predivide, self.predivide
        if pre != 1.0:
            for w in ws:
                w.mul_(pre)
        outs = comp.allreduce_many(ws, red.transport, names, self.op)
        for w, o in zip(ws, outs):
            w.copy_(o.view_as(w))
            if post != 1.0:
                w.mul_(post)
        from cgx.collectives.reducer import ReduceStats
        numel, world = sum(w.numel() for w in ws), red.transport.size
        red.add_stats(ReduceStats(calls=1, numel=numel,
                                  input_bytes=sum(w.numel() * w.element_size() for w in ws),
                                  seconds={"_fp32_wire": float(2 * (world - 1) * 4 * numel
                                                               // world)}))

    def _reduce_auto(self, red, work: list, idx: list, step: int, shadow: bool,
                     name: str) -> None:
        """AUTO mode, engine thread: re-plan when due (a collective, at the first reduction
        of a step on every rank), record the window's statistics, and reduce each family's
        tensors of this call together: quantized and exact ones in one fused call, top-k
        ones in one allgather, PowerSGD ones in two allreduces (that order on every rank).

        Residuals stay with their family while a layer keeps it (a new quantization
        level or top-k density or PowerSGD rank keeps them; PowerSGD also keeps its warm
        start). When a layer changes family, what its old compressor still owed is added
        once to its next gradient, which the new compressor then carries (and, with
        error feedback, owes in its turn). Every family's residual is in input units
        (after the ``1 / predivide`` prescale), so what is owed is exactly what was
        dropped, whichever chunk of the fused reduction the values fell in."""
        sched = self.adaptive
        if step != self._last_step:
            self._last_step = step
            if sched.due(step):
                old = list(sched.plan)
                hidden = ()
                if self.planned is not None:  # the planner first: exact where that is as fast
                    self.planned.replan(red.transport, False, step=step, timeline=red.timeline)
                    hidden = [i for i, c in enumerate(self.planned.chosen)
                              if not c and self.adaptive.candidates[i] is not None]
                sched.replan(step, red.transport, red.config.cpu_threads, red.config.verbose,
                             hidden=hidden)
                self._collect_residuals(old)
        chosen = sched.choices(step)
        chosen = [chosen[i] for i in idx]
        names = [self.names[i] for i in idx]
        Q, T, P = Family.QUANTIZE, Family.TOPK, Family.POWERSGD
        fam = [None if c is None else c.family for c in chosen]
        if not shadow:
            if sched.observing(step):  # the gradients alone (see cgx.adaptive.stats)
                sched.observe(step, idx, work)
            for k, n in enumerate(names):
                e = self._owed.pop(n, None)
                if e is not None and e.numel() == work[k].numel():
                    work[k].view(-1).add_(e.to(work[k].device, work[k].dtype))
        groups = {f: [k for k in range(len(work)) if fam[k] is f] for f in (T, P)}
        plain = [k for k in range(len(work)) if fam[k] not in (T, P)]
        if plain:
            self._reduce_quantized(red, [work[k] for k in plain], [names[k] for k in plain],
                                   [chosen[k].spec(sched.rounding) if fam[k] is Q else None
                                    for k in plain], step, shadow, name)
        for f, comp in ((T, self._auto_topk), (P, self._auto_psgd)):
            ks = groups[f]
            if not ks:
                continue
            inner = comp.compressor if isinstance(comp, ErrorFeedback) else comp
            for k in ks:
                if f is T:
                    inner.densities[names[k]] = chosen[k].density
                else:
                    inner.ranks[names[k]] = chosen[k].rank
            ws, ns = [work[k] for k in ks], [names[k] for k in ks]
            if shadow:  # zeros for a joined rank: no residual sent, no state changed
                with _untouched(inner if f is P else comp, ns):
                    self._reduce_family(red, inner, ws, ns)
            else:
                self._reduce_family(red, comp if self.error_feedback else inner, ws, ns)

    def _collect_residuals(self, old_plan: list) -> None:
        """After a re-plan: what the old compressor of each layer that changed family still
        owed, to be added once to the layer's next gradient."""
        for i, (before, now) in enumerate(zip(old_plan, self.adaptive.plan)):
            fb = Family.EXACT if before is None else before.family
            fn = Family.EXACT if now is None else now.family
            if fb is fn:
                continue
            n = self.names[i]
            holder = {Family.TOPK: self._auto_topk._residuals,
                      Family.POWERSGD: self._auto_psgd._residuals}.get(fb, self._residuals)
            e = holder.pop(n, None)
            if e is not None:
                # in gradient units: the next gradient is prescaled again on its way
                flat = e.reshape(-1).to(torch.float32) * self.predivide
                old = self._owed.get(n)
                self._owed[n] = flat if old is None else old + flat

    def compression_plan(self) -> list[dict]:
        """Per gradient: layer, shape, family, level, bytes, error, share of the error budget
        (``cgx.adaptive.format_plan`` prints it). Outside AUTO mode: the fixed specs."""
        if self.adaptive is not None:
            return self.adaptive.rows()
        rows = []
        specs = self.planned.specs() if self.planned is not None else self.specs
        for n, s, spec in zip(self.names, self.shapes, specs):
            numel = math.prod(s)
            rows.append({"layer": n, "shape": s, "family": "exact" if spec is None else
                         "quantize", "level": "exact" if spec is None else
                         f"{spec.bits}-bit/{spec.bucket_size}",
                         "bytes": 4 * numel if spec is None else spec.nbytes(numel),
                         "error": 0.0, "share": 0.0})
        return rows

    def _residual(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The plan's float32 residual of ``name`` (zeros when it has none yet)."""
        e = self._residuals.get(name)
        if e is None or e.numel() != w.numel() or e.device != w.device:
            e = torch.zeros(w.numel(), dtype=torch.float32, device=w.device)
            self._residuals[name] = e
        return e

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """What this rank's exchange of tensor ``name`` still owes (error feedback): the
        values dropped so far and not yet sent, flat float32 in the gradient's units, or
        None when nothing is held. Over any steps, the reduced outputs' sum plus the
        reduction of every rank's ``residual`` equals the reduction of the gradients'
        sum (to float32 rounding), whatever the plan did meanwhile."""
        held = [(self._residuals.get(name), self.predivide), (self._owed.get(name), 1.0)]
        for comp in (self.compression, self._auto_topk, self._auto_psgd):
            if callable(getattr(comp, "residual", None)):
                held.append((comp.residual(name), self.predivide))
        parts = [e.detach().reshape(-1).to(torch.float32) * f for e, f in held if e is not None]
        return sum(parts[1:], parts[0]) if parts else None

    @property
    def compressed_numel(self) -> int:
        """Values that travel compressed (the others go exact)."""
        return sum(math.prod(s) for s, spec in zip(self.shapes, self.specs) if spec is not None)

    # -- state: residuals, step and the compressor's own state ----------------------

    def state_dict(self) -> dict:
        state = {"format": STATE_FORMAT, "step": self.step,
                 "residuals": {k: v.detach().clone() for k, v in self._residuals.items()},
                 "compression": self.compression.state_dict()}
        if self.adaptive is not None:
            state["adaptive"] = self.adaptive.state_dict()
            state["last_step"] = self._last_step
            state["owed"] = {k: v.detach().clone() for k, v in self._owed.items()}
            state["auto_topk"] = self._auto_topk.state_dict()
            state["auto_powersgd"] = self._auto_psgd.state_dict()
        if self.planned is not None:
            state["planned"] = self.planned.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"expected a GradientPlan state of format {STATE_FORMAT} (from "
                             f"state_dict()), got {type(state).__name__}")
        self.step = int(state["step"])
        self._residuals = {k: v.detach().clone() for k, v in state["residuals"].items()}
        self.compression.load_state_dict(state["compression"])
        if self.adaptive is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])
            self._last_step = state.get("last_step")
            self._owed = {k: v.detach().clone() for k, v in state.get("owed", {}).items()}
            if "auto_topk" in state:
                self._auto_topk.load_state_dict(state["auto_topk"])
                self._auto_psgd.load_state_dict(state["auto_powersgd"])
        if self.planned is not None and "planned" in state:
            self.planned.load_state_dict(state["planned"])
