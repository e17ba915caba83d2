"""One layout's gradient exchange in the torch optimizer: buckets launched in order.

``DistributedOptimizer`` builds one :class:`BucketExchange` per layout (again after
freezing or ``add_param_group``). During backward its hooks report each ready
gradient (:meth:`BucketExchange.ready`); when bucket ``k`` and all buckets before it
are complete, ``k`` is handed to the engine thread, so every rank issues the same
collectives in the same order. ``synchronize()`` launches the rest
(:meth:`BucketExchange.launch_rest`) and waits.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from cgx import session
from cgx.comm.consistency import Signature, signature
from cgx.errors import CGXError
from cgx.exchange.buckets import compose_buckets
from cgx.ops import Average, group_size
from cgx.session import reducer_of
from cgx.torch import join


@dataclasses.dataclass
class StepState:
    """What one step of a DistributedOptimizer has seen and started; rebuilt at each step
    (and with the buckets)."""

    counts: list  # backward passes seen, per parameter
    ready: list  # parameters ready, per bucket
    next: int = 0  # the next bucket to launch (buckets launch in order)
    handles: list = dataclasses.field(default_factory=list)  # the engine's, in launch order

    @classmethod
    def fresh(cls, params: int, buckets: int) -> "StepState":
        return cls([0] * params, [0] * buckets)

    @property
    def started(self) -> bool:
        """Has this step seen a gradient or launched anything?"""
        return self.next > 0 or bool(self.handles) or any(self.counts)


def copy_back(grads: list, outs: list) -> None:
    """The reduced results into the gradients they came from (where not reduced in place)."""
    for g, o in zip(grads, outs):
        if o is not g:
            g.copy_(o.view_as(g))


def _ready_event(t: torch.Tensor) -> Optional["torch.cuda.Event"]:
    """On CUDA, an event the engine thread waits for: it must see what the backward
    stream produced."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def make_buckets(params: list, cap_bytes: int, user_groups: Optional[list], num_groups: int,
                 factors=None) -> list[list[int]]:
    """Fusion buckets in launch order (``cgx.exchange.buckets.compose_buckets``):
    ``user_groups`` as parameter indices, the factor layers' buckets of their own."""
    return compose_buckets([p.numel() * 4 for p in params], cap_bytes, user_groups=user_groups,
                           num_groups=num_groups,
                           factor_weights=factors.weights if factors else [],
                           factor_biases=factors.biases if factors else {})


def step_signature(owner_id: int, plan, params: list, buckets: list, compression, opts,
                   factors=None) -> Signature:
    """What every rank's step must agree on: the parameters, buckets and compression."""
    return signature("DistributedOptimizer step", f"DistributedOptimizer #{owner_id}",
                     names=plan.names, shapes=plan.shapes, dtypes=[p.dtype for p in params],
                     buckets=buckets, compression=compression, mode=plan.mode.value,
                     specs=plan.specs, op=opts.op, predivide=opts.predivide,
                     backward_passes_per_step=opts.backward_passes_per_step,
                     sufficient_factors=[plan.names[i] for i in
                                         (factors.weights if factors else [])])


@dataclasses.dataclass
class Layout:
    """What a BucketExchange exchanges, built by the optimizer's set-up."""

    owner_id: int  # the optimizer's id: labels, join's registry
    params: list  # trainable parameters, in index order
    names: list  # their names, by index
    buckets: list  # parameter indices per bucket, in launch order
    plan: object  # cgx.exchange.GradientPlan
    opts: object  # cgx.exchange.ExchangeOptions
    signature: object  # what every rank's step must agree on
    recorder: object  # cgx.exchange.step.StepRecorder
    sparse: object  # cgx.torch.sparse_gradients.SparseGradients
    factors: object = None  # cgx.torch.factor_layers.FactorLayers, or None


class BucketExchange:
    """Launches one layout's buckets as they fill, and the rest when asked."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.bucket_of = {i: b for b, idx in enumerate(layout.buckets) for i in idx}
        self.factor_set = frozenset(layout.factors.weights if layout.factors else ())
        self.pending = StepState.fresh(len(layout.params), len(layout.buckets))
        # Last step: bucket launch/start/end times and when each factor exchange began.
        self.timing: dict = {}

    def reset(self) -> None:
        """Forget the step (after its reductions finished)."""
        self.pending = StepState.fresh(len(self.layout.params), len(self.layout.buckets))
        self.layout.sparse.clear()

    # -- training thread -------------------------------------------------------------

    def ready(self, i: int, step: int) -> None:
        """Parameter ``i``'s gradient of this backward pass is accumulated."""
        if i not in self.bucket_of:
            return  # not ours
        passes = self.layout.opts.backward_passes_per_step
        c = self.pending.counts[i] + 1
        if c > passes:
            raise CGXError(f"gradients of '{self.layout.names[i]}' were computed more than "
                           f"backward_passes_per_step={passes} times before step(); raise "
                           "backward_passes_per_step to accumulate gradients locally")
        self.pending.counts[i] = c
        if c < passes:
            return
        b = self.bucket_of[i]
        self.layout.recorder.ready([i], step, f"opt{self.layout.owner_id}.bucket{b}",
                                   label=f"ready {self.layout.names[i]}")
        self.pending.ready[b] += 1
        buckets = self.layout.buckets
        while self.pending.next < len(buckets) and \
                self.pending.ready[self.pending.next] == len(buckets[self.pending.next]):
            self.launch(self.pending.next, step)
            self.pending.next += 1

    def launch_rest(self, step: int) -> list:
        """Launch the buckets not launched yet (gradients missing: zeros); returns every
        handle of the step, which the caller waits for."""
        while self.pending.next < len(self.layout.buckets):
            self.launch(self.pending.next, step)
            self.pending.next += 1
        handles, self.pending.handles = self.pending.handles, []
        return handles

    def shadow(self, step: int) -> list:
        """A joined rank's part in the others' step: every bucket with zeros (join_world()
        already did the status exchange); returns the handles."""
        for b in range(len(self.layout.buckets)):
            self.launch(b, step, zeros=True, status=False)
        handles, self.pending.handles = self.pending.handles, []
        return handles

    def _submit(self, label: str, fn, *args) -> None:
        self.pending.handles.append(
            session.submit(fn, *args, label=f"opt{self.layout.owner_id}.{label}"))

    def launch(self, b: int, step: int, zeros: bool = False, status: bool = True) -> None:
        """Hand bucket ``b`` to the engine thread (``zeros``: a joined rank's shadow step):
        1. the step's status exchange, with the first bucket; 2. a factor layer's bucket;
        3. sparse gradients, each alone; 4. the dense rest, fused."""
        lay = self.layout
        if b == 0:
            self.timing = {"launch": [], "start": [], "end": []}
            if lay.factors is not None:
                lay.factors.used = {}
            if status and group_size(lay.opts.group) > 1:
                # One tiny collective per step lets ranks that called join() follow.
                self._submit("step-status", join.status_exchange, lay.owner_id, lay.signature,
                             lay.opts.group)
        first = lay.buckets[b][0]
        if first in self.factor_set:
            event = None if zeros else _ready_event(lay.params[first])
            self.timing.setdefault("factors_launch", []).append(time.perf_counter())
            self._submit(f"factors{first}", self._exchange_factors, first, step, zeros, event)
            return
        dense = [i for i in lay.buckets[b] if not self._launch_sparse(i, zeros)]
        if dense:
            grads = [self._dense_grad(i, zeros) for i in dense]
            self.timing["launch"].append(time.perf_counter())
            self._submit(f"bucket{b}", self._reduce_bucket, b, step, grads,
                         _ready_event(grads[0]), zeros, dense)

    def _launch_sparse(self, i: int, zeros: bool) -> bool:
        """Hand parameter ``i``'s gradient to the sparse path if it takes it."""
        lay = self.layout
        p = lay.params[i]
        if not lay.sparse.travels_sparse(p, zeros):
            return False
        name = f"opt{lay.owner_id}.sparse.{lay.names[i]}"
        self._submit(f"sparse{i}", lay.sparse.reduce, i, lay.sparse.gradient(p, zeros),
                     lay.opts.op, name, lay.opts.group, zeros)
        return True

    def _dense_grad(self, i: int, zeros: bool) -> torch.Tensor:
        """Parameter ``i``'s gradient to reduce: zeros where it has none (kept as its
        gradient, unless this is a shadow step), dense where it came sparse."""
        p = self.layout.params[i]
        if zeros or p.grad is None:
            g = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if not zeros:
                p.grad = g
            return g
        return self.layout.sparse.dense(i, p)

    # -- engine thread -----------------------------------------------------------------

    def _reduce_bucket(self, b: int, step: int, grads: list, event, shadow: bool,
                       indices: list) -> None:
        self.timing["start"].append(time.perf_counter())
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        outs = self.layout.plan.reduce(grads, name=f"opt{self.layout.owner_id}.bucket{b}",
                                       step=step, indices=indices, shadow=shadow)
        copy_back(grads, outs)
        self.timing["end"].append(time.perf_counter())

    def _exchange_factors(self, i: int, step: int, shadow: bool, event) -> None:
        """One linear layer's weight (and bias) gradient, as factors or plainly; the
        planned exchange weighs the factors against the rest."""
        self.timing.setdefault("factors", []).append(time.perf_counter())
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        lay = self.layout
        indices = lay.factors.members(i)

        def plain(grads: list) -> None:
            outs = lay.plan.reduce(grads, name=f"opt{lay.owner_id}.factors.plain", step=step,
                                   indices=indices, shadow=shadow)
            if not shadow:
                copy_back(grads, outs)

        red = reducer_of(lay.opts.group)
        lay.plan.begin_step(step, red)  # this may be the step's first exchange
        planned = lay.plan.planned
        seen = self._before_factors(indices, step, shadow)
        went = lay.factors.exchange(i, lay.params, plain, red,
                                    lay.opts.backward_passes_per_step, lay.opts.op is Average,
                                    shadow, choose=planned.prefer_factors
                                    if planned is not None else None)
        if seen and went:
            # auto measures the layer's error at its levels, though the factors (exact) went:
            # the plans that send it compressed count that error
            lay.plan.adaptive.observe(step, *zip(*seen))
        if not shadow and planned is not None:
            planned.note_reduced(step)

    def _before_factors(self, indices: list, step: int, shadow: bool) -> list:
        """In auto's measuring window, the layer's own gradients (index, copy) before the
        factors overwrite them, at the steps auto reads them; else nothing."""
        adaptive = self.layout.plan.adaptive
        if shadow or adaptive is None or not adaptive.observing(step):
            return []
        params = self.layout.params
        return [(j, params[j].grad.detach().clone()) for j in indices
                if params[j].grad is not None and adaptive.wants(step, j)]
