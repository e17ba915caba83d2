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
one float32 residual per compressed tensor (``cgx.exchange.residuals``): classic
under SGD, a moving average under Adam-type optimizers (``cgx.exchange.compensation``).
Each mode is a small object of ``cgx.exchange.modes`` (``cgx.exchange.per_layer`` for AUTO).

Example::

    plan = GradientPlan(["fc1/kernel", "fc1/bias"], [(784, 256), (256,)])
    out = session.run(plan.reduce, [g_kernel.clone(), g_bias.clone()], name="grads")
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from cgx import runtime, session
from cgx.policy.update_rule import UpdateRule, compensation_for
from cgx.comm.base import ReduceOp
from cgx.compression import Compression
from cgx.config import Config
from cgx.exchange.per_layer import Auto
from cgx.exchange.modes import Call, Fused, Mode, PerTensor, Planned, Settings, Summable
from cgx.policy import ExchangePolicy, GradMode
from cgx.policy import resolve as resolve_policy
from cgx.exchange.residuals import ResidualStore
from cgx.rules import LayerRules

STATE_FORMAT = 1


def make_mode(policy: ExchangePolicy, settings: Settings, names, shapes, specs) -> Mode:
    """The mode object that reduces the plan's tensors."""
    mode, comp, base = policy.mode, policy.compressor, policy.base
    if mode is GradMode.AUTO:
        return Auto(settings, comp, names, shapes, specs, base)
    if mode is GradMode.PLANNED:
        from cgx.policy.planner.schedule import PlannedSchedule
        return Planned(settings, comp, PlannedSchedule(names, shapes, specs, comp,
                                                       base.inner_reduction,
                                                       base.fusion_buffer_mb, place=True))
    if mode is GradMode.SUMMABLE:
        return Summable(settings, comp)
    if mode is GradMode.PER_TENSOR:
        return PerTensor(settings, comp)
    return Fused(settings, comp, mode)


class GradientPlan:
    """Reduction recipe for a fixed list of gradients (names, shapes, compression).

    Args:
        names: one name per gradient (variable path); keys rules and state.
        shapes: one shape per gradient.
        compression: a ``compression=`` argument (see the module docstring), or the
            :class:`cgx.policy.ExchangePolicy` an adapter resolved it to.
        op: ``ReduceOp.AVERAGE`` or ``ReduceOp.SUM``.
        predivide: with AVERAGE, divide by this before the sum and by
            ``size / predivide`` after.
        rules: per-layer rules (dict, list or YAML path, see ``cgx.rules``).
        config: defaults (``cgx.runtime.config()`` when omitted).
        group: a process set from :func:`cgx.process_sets.resolve` (None: all ranks).
        update_rule: the optimizer's :class:`cgx.policy.update_rule.UpdateRule`;
            ``compression="auto"`` keeps residuals of quantized layers by it, and the
            residuals' :class:`~cgx.policy.update_rule.Compensation` follows it.

    Attributes:
        mode: the :class:`GradMode` chosen; ``reduction``: the mode's object.
        specs: one ``QuantSpec`` (compressed) or None (exact) per gradient;
            in PER_TENSOR mode a spec only marks the tensor as compressed.
        step: reductions done so far; the default stochastic-rounding step.
        residuals: the :class:`cgx.exchange.residuals.ResidualStore`.
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
        policy = compression if isinstance(compression, ExchangePolicy) else \
            resolve_policy(compression, cfg, update_rule)
        comp, mode, error_feedback = policy.compressor, policy.mode, policy.error_feedback
        layer_rules = LayerRules.from_config(policy.base, rules)
        self.policy = policy
        self.names = list(names)
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.compression, self.op, self.mode = comp, op, mode
        self.predivide = float(predivide)
        self.error_feedback = error_feedback
        self.specs = [layer_rules.spec_for(n, s) if mode not in (GradMode.EXACT,
                                                                  GradMode.SUMMABLE)
                      else None for n, s in zip(self.names, self.shapes)]
        if policy.rotate:
            self.specs = [s and dataclasses.replace(s, rotate=True) for s in self.specs]
        self.step = 0
        self.group = group
        self.residuals = ResidualStore(self.predivide,
                                       compensation_for(error_feedback, update_rule,
                                                        cfg.compensation))
        settings = Settings(op, self.predivide, error_feedback, self.residuals, update_rule)
        self.reduction = make_mode(policy, settings, self.names, self.shapes, self.specs)
        # Exact exchange for the first steps (Compression.quantize/topk(warmup_steps=...),
        # PowerSGD's start_step plays that role for it).
        self.warmup_steps = policy.warmup_steps

    @property
    def adaptive(self):
        """AUTO: the per-layer schedule (``cgx.policy.levels.AdaptiveSchedule``); else None."""
        return getattr(self.reduction, "adaptive", None)

    @property
    def planned(self):
        """PLANNED (and AUTO with the planner): the ``PlannedSchedule``; else None."""
        return getattr(self.reduction, "planned", None)

    @property
    def decider(self):
        """AUTO with ``objective="time"`` and PLANNED with trials: the trials'
        :class:`cgx.policy.trials.TrialDecider`; else None."""
        return getattr(self.reduction, "decider", None)

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
        step = self.step if step is None else int(step)
        self.step += 1
        red = reducer if reducer is not None else session.reducer_of(self.group)
        dev = red.transport.device
        work = [g if g.device == dev and g.is_contiguous() else g.contiguous().to(dev)
                for g in grads]
        call = Call(work, idx, [self.names[i] for i in idx], [self.specs[i] for i in idx],
                    step, shadow, name)
        if step < self.warmup_steps and self.mode in (GradMode.QUANTIZE, GradMode.PER_TENSOR):
            red.allreduce(work, None, op=self.op, prescale_factor=1.0 / self.predivide,
                          postscale_factor=self.predivide, name=name, step=step)
        else:
            self.reduction.reduce(red, call)
        return [w if w.device == g.device else w.to(g.device) for w, g in zip(work, grads)]

    def begin_step(self, step: int, red) -> None:
        """The planned exchange's start of ``step``: plan when due, check drift. Called at
        the first exchange of a step on every rank (engine thread): a reduction here, or
        a sufficient-factor layer's exchange (which may come first, or alone)."""
        self.reduction.begin_step(step, red)

    def world_changed(self, step: int) -> None:
        """The ranks changed (an elastic job): auto measures its layers' errors and decides
        again from ``step``, since plans timed on the old world say nothing of the new."""
        if self.adaptive is not None:
            self.adaptive.replan_soon(step)

    def compression_plan(self) -> list[dict]:
        """Per gradient: layer, shape, family, level, bytes, error, share of the error budget
        (``cgx.policy.levels.format_levels`` prints it). Outside AUTO mode: the fixed specs."""
        if self.adaptive is not None:
            return self.adaptive.rows()
        rows = []
        for n, s, spec in zip(self.names, self.shapes, self.reduction.specs_now(self.specs)):
            numel = math.prod(s)
            rows.append({"layer": n, "shape": s, "family": "exact" if spec is None else
                         "quantize", "level": "exact" if spec is None else
                         f"{spec.bits}-bit/{spec.bucket_size}",
                         "bytes": 4 * numel if spec is None else spec.nbytes(numel),
                         "error": 0.0, "share": 0.0})
        return rows

    def residual(self, name: str) -> Optional[torch.Tensor]:
        """What this rank's exchange of tensor ``name`` still owes (error feedback): the
        values dropped so far and not yet sent, flat float32 in the gradient's units, or
        None when nothing is held. Over any steps, the reduced outputs' sum plus the
        reduction of every rank's ``residual`` equals the reduction of the gradients'
        sum (to float32 rounding), whatever the plan did meanwhile. With the moving
        average compensation (``residuals.compensation``, adaptive optimizers) it is the
        average held instead, and that identity does not hold: what the average and its
        clip hold back is dropped (``cgx.exchange.compensation``)."""
        parts = self.residuals.held(name) + self.reduction.held(name)
        return sum(parts[1:], parts[0]) if parts else None

    @property
    def compressed_numel(self) -> int:
        """Values that travel compressed (the others go exact)."""
        return sum(math.prod(s) for s, spec in zip(self.shapes, self.specs) if spec is not None)

    # -- state: residuals, step and the compressor's own state ----------------------

    def state_dict(self) -> dict:
        state = {"format": STATE_FORMAT, "step": self.step,
                 "compression": self.compression.state_dict()}
        state.update(self.residuals.state_dict(with_owed=self.mode is GradMode.AUTO))
        state.update(self.reduction.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"expected a GradientPlan state of format {STATE_FORMAT} (from "
                             f"state_dict()), got {type(state).__name__}")
        self.step = int(state["step"])
        self.residuals.load_state_dict(state)
        self.compression.load_state_dict(state["compression"])
        self.reduction.load_state_dict(state)
