"""``DistributedOptimizer``: compressed, overlapped gradient exchange for any torch optimizer.

How a step runs:

1. Parameters are cut into *buckets* (reverse registration order, which is
   roughly the order backward produces gradients; the first bucket is small
   so communication starts early; the others up to ``CGX_FUSION_BUFFER_SIZE_MB``).
2. During ``loss.backward()``, a post-accumulate-grad hook marks a parameter
   ready after ``backward_passes_per_step`` passes; when bucket ``k`` and all
   buckets before it are ready, its reduction is submitted to the engine
   thread (wait-free backprop): it runs while backward continues.
3. ``step()`` (or ``synchronize()``) submits what is left, in bucket order,
   with zero gradients for parameters that got none, waits, and then runs
   the wrapped optimizer.

Buckets are launched strictly in index order, so every rank issues the same
collectives in the same order, also when a parameter is unused on one rank.

Compression: ``compression=Compression.none`` (Horovod's default) means *the
environment decides*: max-min quantization with ``CGX_COMPRESSION_*``
settings (4 bits, bucket 1024 by default; ``CGX_COMPRESSION_QUANTIZATION_BITS=32``
turns it off), with per-layer rules from ``rules=`` or
``CGX_COMPRESSION_CONFIG``. ``Compression.exact`` sends them uncompressed. Other compressors (``fp16``, ``bf16``,
``Compression.quantize(...)``, ``topk``, ``powersgd``) are used as given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from cgx import runtime
from cgx.comm.consistency import Signature, signature
from cgx.compression import Compression, resolve
from cgx.errors import CGXError
from cgx.adaptive.compensation import update_rule_of
from cgx.exchange import (ExchangeOptions, GradientPlan, GradMode,  # noqa: F401 - GradMode: API
                          check_wrapped_once)
from cgx.exchange.buckets import compose_buckets
from cgx import session
from cgx.torch import join
from cgx.ops import Average, group_size, resolve_process_set
from cgx.process_sets import global_process_set
from cgx.session import reducer_of

STATE_FORMAT = 1


_registry_ids = iter(range(1, 1 << 62))
# id(parameter) -> (weakref to it, registry id of the optimizer whose hook it carries, hook
# handle). A parameter reports its gradient to one DistributedOptimizer: a new one over the
# same model (a notebook re-run, a new learning rate) takes it over and removes the old hook.
_owners: dict = {}


@dataclasses.dataclass
class StepState:
    """What one step of a DistributedOptimizer has seen and started; rebuilt at each step
    (and with the buckets)."""

    counts: list  # backward passes seen, per parameter
    ready: list  # parameters ready, per bucket
    next: int = 0  # the next bucket to launch (buckets launch in order)
    handles: list = dataclasses.field(default_factory=list)  # the engine's, in launch order
    sparse_out: dict = dataclasses.field(default_factory=dict)  # sparse results, by index
    # sparse_as_dense: index -> sparse dims of a sparse gradient reduced densely this step;
    # it is handed back sparse, the layout its optimizer (SparseAdam) expects.
    densified: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def fresh(cls, params: int, buckets: int) -> "StepState":
        return cls([0] * params, [0] * buckets)


def _grad_hook(opt_ref, generation: int, p: torch.Tensor) -> None:
    """Post-accumulate-grad hook; holds the optimizer weakly, so a dropped one is released."""
    opt = opt_ref()
    if opt is not None:
        opt._on_grad(p, generation)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Same arguments as ``horovod.torch.DistributedOptimizer``, plus ``rules``.

    Args:
        optimizer: any ``torch.optim.Optimizer`` (not modified, reachable as ``.optimizer``).
        named_parameters: ``model.named_parameters()``; names key per-layer rules,
            compression state and error messages.
        compression: see the module docstring.
        backward_passes_per_step: backward passes accumulated locally per step.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with Average, divide by this before the
            sum and by ``size / factor`` after (guards low-precision overflow).
        num_groups: cut the parameters into this many buckets (0: by size).
        groups: explicit buckets, a list of lists of parameters.
        sparse_as_dense: False (default, Horovod's): sparse gradients (e.g. of
            ``nn.Embedding(sparse=True)``) stay sparse: every rank's indices and values
            are all-gathered, uncompressed, and ``p.grad`` becomes the (uncoalesced)
            sparse average, so ``torch.optim.SparseAdam`` works. True: they are made
            dense and travel with the other gradients (compressed), and ``p.grad`` is
            handed back sparse, as Horovod does (``SparseAdam`` needs it so).
        process_set: reduce over the ranks of this process set only (every rank of the
            set wraps an optimizer with it; see ``cgx.process_sets``). ``join()`` covers
            optimizers of the global set.
        rules: per-layer rules (dict, list or YAML path, see ``cgx.rules``).
        sufficient_factors: the model, to exchange the weight gradients of its
            ``nn.Linear`` layers as sufficient factors (Poseidon) whenever that moves
            fewer bytes: ``K x P x (M + N) < M x N`` for K rows per rank, P ranks and
            an M x N weight. The rebuilt average is exact (the bias's too, from the
            output gradients); each layer's exchange starts as soon as its gradient
            is ready, beside the rest of backward. The factors go only when the
            layer's product is the weight's whole gradient on every rank; otherwise
            the layer takes the plain path for the step (used twice in a forward,
            unused on a rank, its weight also used elsewhere: ``F.linear`` on it, a
            custom autograd function, a gradient hook). A weight or bias registered
            in several modules (tied embedding and output layer, shared ``nn.Linear``)
            always takes the plain path. See ``cgx.torch.factor_capture``.

    Example::

        opt = cgx.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters())
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 compression=Compression.none, backward_passes_per_step: int = 1,
                 op=Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups=None, sparse_as_dense: bool = False, process_set=global_process_set,
                 *, rules=None, sufficient_factors: "torch.nn.Module | None" = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        check_wrapped_once(optimizer, DistributedOptimizer)
        self._group = resolve_process_set(process_set)
        opts = ExchangeOptions.checked(
            "DistributedOptimizer", op=op, gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step, num_groups=num_groups,
            sparse_as_dense=sparse_as_dense)
        # Adopt the wrapped optimizer's param_groups and state objects (shared, not
        # copied): LR schedulers and GradScaler see one set of groups.
        self._optimizer = optimizer
        torch.optim.Optimizer.__setstate__(self, {"defaults": optimizer.defaults,
                                                  "state": optimizer.state,
                                                  "param_groups": optimizer.param_groups})
        self._passes_per_step = opts.backward_passes_per_step
        self._op = opts.op
        self._predivide = opts.predivide
        self._num_groups = opts.num_groups
        self._sparse_as_dense = opts.sparse_as_dense
        self._names = self._name_params(named_parameters)
        self._user_groups = self._check_groups(groups)
        self._compression = resolve(compression)
        self._rules_source = rules
        if sufficient_factors is not None and not isinstance(sufficient_factors,
                                                             torch.nn.Module):
            raise TypeError(f"sufficient_factors= takes the model (a torch.nn.Module), got "
                            f"{type(sufficient_factors).__name__}")
        self._factor_model = sufficient_factors
        self._step_count = 0  # part of the state: feeds the stochastic-rounding key
        self._registry_id = next(_registry_ids)
        self._setup()

    # -- construction -------------------------------------------------------------

    def _name_params(self, named_parameters) -> dict:
        params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            return self._default_names({})
        named = list(named_parameters)
        if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually model.named_parameters()")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"named_parameters has duplicate names: {dups}")
        by_id = {id(p): n for n, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"named_parameters was given, but {len(missing)} parameter(s) of the "
                             "optimizer are not in it; pass model.named_parameters() of the "
                             "model whose parameters the optimizer holds")
        return by_id

    def _default_names(self, names: dict) -> dict:
        """``names`` (id(param) -> name) with Horovod's name for each parameter it lacks:
        ``allreduce.noname.<group>.<index in the group>``."""
        out = dict(names)
        for i, g in enumerate(self._groups()):
            for j, p in enumerate(g["params"]):
                out.setdefault(id(p), f"allreduce.noname.{i}.{j}")
        return out

    @property
    def _parameter_names(self) -> dict:
        """Horovod's ``optimizer._parameter_names``: parameter -> name, for every parameter
        (names from ``named_parameters``, else Horovod's ``allreduce.noname.<group>.<index>``)."""
        return {p: self._names[id(p)] for g in self._groups() for p in g["params"]
                if id(p) in self._names}

    def _check_groups(self, groups):
        if groups is None:
            return None
        if isinstance(groups, int):
            if groups < 0:
                raise ValueError(f"groups={groups} must be >= 0")
            self._num_groups = groups
            return None
        groups = [list(g) for g in groups]
        known = {id(p) for g in self.param_groups for p in g["params"]}
        for g in groups:
            for p in g:
                if id(p) not in known:
                    raise ValueError("groups holds a parameter the optimizer does not have")
        return groups

    def _setup(self) -> None:
        """Buckets, specs and hooks (again after add_param_group)."""
        cfg = runtime.config() if runtime.is_initialized() else None
        if cfg is None:
            raise CGXError("DistributedOptimizer needs cgx.torch.init() to be called first")
        self._config = cfg
        groups = self._groups()
        self._trainable = tuple(p.requires_grad for g in groups for p in g["params"])
        params = [p for g in groups for p in g["params"] if p.requires_grad]
        self._names = self._default_names(self._names)
        self._params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        # Parameters whose gradients came sparse (sparse_as_dense=False): they travel as
        # Horovod's sparse allreduce; a joined rank sends empty ones for them.
        self._sparse_ids = getattr(self, "_sparse_ids", set())
        self._plan = self._make_plan(params, cfg)
        self._capture_factors(params)
        self._factor_set = frozenset(self._factor_index)
        self.sfb_used: dict = {}  # last step: weight name -> travelled as factors
        self._buckets = self._make_buckets(params, cfg.fusion_buffer_bytes)
        self._bucket_of = {}
        for b, idx in enumerate(self._buckets):
            for i in idx:
                self._bucket_of[i] = b
        if not hasattr(self, "_lock"):
            self._lock = threading.RLock()
        self._reset_step_state()
        self._install_hooks(params)
        self._should_sync = True
        self._synchronized = False
        self._auto_synced = False
        # Last step: bucket launch/start/end times and when each factor exchange began.
        self.timing: dict[str, Any] = {}
        self._signature = self._make_signature()
        self._timeline = session.reducer().timeline
        self._digest = self._signature.digest()
        join.register(self._registry_id, self)

    def _make_plan(self, params: list, cfg) -> GradientPlan:
        """The exchange of ``params``: `compression` mapped to a mode, per-layer specs and
        residuals (``cgx.exchange``); the previous plan's state carries over."""
        old_plan = getattr(self, "_plan", None)
        plan = GradientPlan([self._names[id(p)] for p in params],
                            [tuple(p.shape) for p in params], self._compression,
                            op=self._op, predivide=self._predivide, rules=self._rules_source,
                            config=cfg, group=getattr(self, "_group", None),
                            update_rule=update_rule_of(self._optimizer))
        if old_plan is not None:
            plan.load_state_dict(old_plan.state_dict())
        return plan

    def _capture_factors(self, params: list) -> None:
        """Sufficient factors: hooks on the model's Linear layers (``_factor_index``: their
        weights, ``_factor_bias``: weight index -> bias index). Their weights travel in
        buckets of their own, as factors or plainly when that is not worth it."""
        if getattr(self, "_capture", None) is not None:
            self._capture.remove()
            self._capture_release.detach()
        self._capture = None
        self._factor_index: list = []
        if self._factor_model is not None:
            from cgx.torch.factor_capture import FactorCapture
            self._capture = FactorCapture(self._factor_model, {id(p) for p in params})
            # Without this optimizer, the hooks would go on recording for nobody.
            self._capture_release = weakref.finalize(self, self._capture.remove)
            self._factor_index = [i for i, p in enumerate(params)
                                  if id(p) in self._capture.captures]
        # A factor layer's trainable bias travels with its weight: rebuilt from the
        # gathered output gradients when the factors go, reduced beside it otherwise.
        self._factor_bias: dict = {}  # weight index -> bias index
        for i in self._factor_index:
            bias = self._capture.captures[id(params[i])].module.bias
            if bias is not None and id(bias) in self._index:
                self._factor_bias[i] = self._index[id(bias)]

    def _install_hooks(self, params: list) -> None:
        """One post-accumulate-grad hook per parameter, of this layout's generation; a
        parameter another DistributedOptimizer had is taken over."""
        self._generation = getattr(self, "_generation", 0) + 1
        self._remove_hooks()
        ref = weakref.ref(self)
        for p in params:
            old = _owners.get(id(p))
            if old is not None and old[0]() is p and old[1] != self._registry_id:
                old[2].remove()  # another DistributedOptimizer had this parameter
            h = p.register_post_accumulate_grad_hook(
                functools.partial(_grad_hook, ref, self._generation))
            _owners[id(p)] = (weakref.ref(p), self._registry_id, h)
            self._hooks.append(h)

    def _remove_hooks(self) -> None:
        for h in getattr(self, "_hooks", ()):
            h.remove()
        self._hooks = []

    def _make_signature(self) -> Signature:
        """What every rank's step must agree on: the parameters, buckets and compression."""
        plan = self._plan
        return signature("DistributedOptimizer step", f"DistributedOptimizer #{self._registry_id}",
                         names=plan.names, shapes=plan.shapes,
                         dtypes=[p.dtype for p in self._params], buckets=self._buckets,
                         compression=self._compression, mode=plan.mode.value,
                         specs=plan.specs, op=self._op, predivide=self._predivide,
                         backward_passes_per_step=self._passes_per_step,
                         sufficient_factors=[plan.names[i] for i in self._factor_index])

    def _trainable_changed(self) -> bool:
        """Did parameters get frozen or unfrozen since the buckets were built?"""
        return tuple(p.requires_grad for g in self._groups()
                     for p in g["params"]) != self._trainable

    @property
    def param_groups(self) -> list:
        """The wrapped optimizer's parameter groups.

        Reading them while this step's gradients are still being reduced (as
        ``GradScaler.unscale_``/``GradScaler.step`` do) first finishes the
        exchange, so nobody reads a gradient in flight.
        """
        pending = self.__dict__.get("_pending")
        if pending is not None and pending.handles and \
                threading.current_thread().name != "cgx-engine":
            self.synchronize()
            self._auto_synced = True
        return self._groups()

    @param_groups.setter
    def param_groups(self, value) -> None:
        inner = self.__dict__.get("_optimizer")
        if inner is not None:
            inner.param_groups = value

    def _groups(self) -> list:
        # Always the wrapped optimizer's own list: its load_state_dict() replaces it.
        inner = self.__dict__.get("_optimizer")
        return inner.param_groups if inner is not None else []

    @property
    def state(self):
        """The wrapped optimizer's state (shared, also after its ``load_state_dict()``)."""
        inner = self.__dict__.get("_optimizer")
        return inner.state if inner is not None else {}

    @state.setter
    def state(self, value) -> None:
        inner = self.__dict__.get("_optimizer")
        if inner is not None:
            inner.state = value

    def _make_buckets(self, params, cap_bytes) -> list[list[int]]:
        """Fusion buckets in launch order (``cgx.exchange.buckets.compose_buckets``)."""
        groups = None
        if self._user_groups is not None:
            groups = [[self._index[id(p)] for p in g if id(p) in self._index]
                      for g in self._user_groups]
        return compose_buckets([p.numel() * 4 for p in params], cap_bytes, user_groups=groups,
                               num_groups=self._num_groups, factor_weights=self._factor_index,
                               factor_biases=self._factor_bias)

    def _reset_step_state(self) -> None:
        self._pending = StepState.fresh(len(self._params), len(self._buckets))

    # -- backward hooks ------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor, generation: int) -> None:
        with self._lock:
            owner = _owners.get(id(p))
            if generation != self._generation or owner is None or \
                    owner[1] != self._registry_id:
                return  # a hook of an older layout, or another optimizer owns p now
            step = self._pending
            if step.next == 0 and not step.handles and not any(step.counts):
                # The first gradient of a step: a new step begins.
                self._synchronized = self._auto_synced = False
                if self._trainable_changed():
                    # Parameters were frozen or unfrozen since the last step: new buckets
                    # (the same on every rank, which freeze the same way).
                    self._setup()
            i = self._index.get(id(p))
            if i is None or i not in self._bucket_of:
                return  # not ours
            c = self._pending.counts[i] + 1
            if c > self._passes_per_step:
                raise CGXError(f"gradients of '{self._names[id(p)]}' were computed more than "
                               f"backward_passes_per_step={self._passes_per_step} times before "
                               "step(); raise backward_passes_per_step to accumulate gradients "
                               "locally")
            self._pending.counts[i] = c
            if c == self._passes_per_step:
                planned = self._plan.planned
                if planned is not None:  # ready times: the plan's input, then drift checks
                    planned.note_ready(i, self._step_count)
                b = self._bucket_of[i]
                if self._timeline.enabled:
                    self._timeline.instant(f"ready {self._names[id(p)]}",
                                           row=f"opt{self._registry_id}.bucket{b}")
                self._pending.ready[b] += 1
                self._launch_ready()

    def _launch_ready(self) -> None:
        step = self._pending
        while step.next < len(self._buckets) and \
                step.ready[step.next] == len(self._buckets[step.next]):
            self._launch(step.next)
            step.next += 1

    def _launch(self, b: int, zeros: bool = False, status: bool = True) -> None:
        if b == 0:
            self.timing = {"launch": [], "start": [], "end": []}
            self.sfb_used = {}  # this step's: weight name -> travelled as factors
            if status and group_size(self._group) > 1:
                # One tiny collective per step lets ranks that called join() follow.
                self._pending.handles.append(session.submit(join.status_exchange, self._registry_id,
                                                    self._signature, self._group,
                                                    label="step-status"))
        if self._buckets[b][0] in self._factor_set:
            i = self._buckets[b][0]
            event = None
            if not zeros and self._params[i].is_cuda:
                event = torch.cuda.Event()  # the factors come from the backward stream
                event.record()
            self.timing.setdefault("factors_launch", []).append(time.perf_counter())
            self._pending.handles.append(session.submit(self._exchange_factors, i, zeros, event,
                                                label=f"opt{self._registry_id}.factors{i}"))
            return
        grads, dense_idx = [], []
        for i in self._buckets[b]:
            p = self._params[i]
            if not zeros and p.grad is not None and p.grad.is_sparse and \
                    not self._sparse_as_dense:
                self._sparse_ids.add(id(p))
            if id(p) in self._sparse_ids and (zeros or (p.grad is not None and
                                                        p.grad.is_sparse)):
                # Horovod's sparse path: every rank's (indices, values) gathered, no densifying.
                g = p.grad if not zeros else torch.sparse_coo_tensor(
                    torch.zeros((p.dim(), 0), dtype=torch.int64), torch.zeros((0,) + tuple(
                        p.shape[1:]), dtype=p.dtype), p.shape).to(p.device)
                self._pending.handles.append(session.submit(self._reduce_sparse, i, g, zeros,
                                                    label=f"opt{self._registry_id}.sparse{i}"))
                continue
            if zeros or p.grad is None:
                g = torch.zeros_like(p, memory_format=torch.contiguous_format)
                if not zeros:
                    p.grad = g
            else:
                if p.grad.is_sparse:
                    self._pending.densified[i] = p.grad.sparse_dim()
                    p.grad = p.grad.to_dense()
                g = p.grad
            grads.append(g)
            dense_idx.append(i)
        if not grads:
            return
        event = None
        if grads and grads[0].is_cuda:
            # The engine thread must see the gradients the backward stream produced.
            event = torch.cuda.Event()
            event.record()
        self.timing["launch"].append(time.perf_counter())
        self._pending.handles.append(session.submit(self._reduce_bucket, b, grads, event, zeros,
                                            dense_idx,
                                            label=f"opt{self._registry_id}.bucket{b}"))

    # -- the reduction of one bucket (engine thread) -----------------------------------

    def _reduce_bucket(self, b: int, grads: list, event, shadow: bool, indices: list) -> None:
        self.timing["start"].append(time.perf_counter())
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        outs = self._plan.reduce(grads, name=f"opt{self._registry_id}.bucket{b}",
                                 step=self._step_count, indices=indices, shadow=shadow)
        for g, o in zip(grads, outs):
            if o is not g:
                g.copy_(o.view_as(g))
        self.timing["end"].append(time.perf_counter())

    def _reduce_sparse(self, i: int, grad: torch.Tensor, shadow: bool) -> None:
        """Engine thread: Horovod's sparse allreduce of one gradient (indices and values
        allgathered; values divided by the number of ranks for Average)."""
        from cgx.ops import sparse_reduce
        name = f"opt{self._registry_id}.sparse.{self._names[id(self._params[i])]}"
        out = sparse_reduce(grad, self._op, name, self._group)
        if not shadow:
            self._pending.sparse_out[i] = out

    def _exchange_factors(self, i: int, shadow: bool, event) -> None:
        """Engine thread: one linear layer's weight (and bias) gradient, as factors or
        plainly."""
        from cgx.sufficient_factors import exchange_layer
        self.timing.setdefault("factors", []).append(time.perf_counter())
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        idx = [i] + ([self._factor_bias[i]] if i in self._factor_bias else [])
        params = [self._params[j] for j in idx]
        if shadow:
            grads = [torch.zeros_like(p) for p in params]
        else:
            for p in params:
                if p.grad is None:  # no gradient on this rank: it contributes zeros
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]

        def plain() -> None:
            outs = self._plan.reduce(grads, name=f"opt{self._registry_id}.factors.plain",
                                     step=self._step_count, indices=idx, shadow=shadow)
            for g, o in zip(grads, outs):
                if o is not g and not shadow:
                    g.copy_(o.view_as(g))

        red = reducer_of(self._group)
        self._plan.begin_step(self._step_count, red)  # this may be the step's first exchange
        planned = self._plan.planned  # the planned exchange weighs factors against the rest
        choose = planned.prefer_factors if planned is not None else None
        cap = self._capture.captures[id(params[0])]
        used = exchange_layer(cap, params[0], red.transport, self._passes_per_step,
                              self._op is Average, plain, record=red.add_stats, choose=choose,
                              shadow=shadow, bias=params[1] if len(params) > 1 else None)
        if not shadow:
            self.sfb_used[cap.name] = used
            if planned is not None:
                planned.note_reduced(self._step_count)

    # -- the public optimizer API -------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    @property
    def _mode(self) -> GradMode:
        return self._plan.mode

    @property
    def _specs(self) -> list:
        return self._plan.specs

    def compression_plan(self) -> list[dict]:
        """Per parameter: layer, shape, family, level, bytes, error and share of the error
        budget of the current plan (``compression="auto"``; else the fixed settings).

        Example::

            from cgx.adaptive import format_levels
            print(format_levels(opt.compression_plan()))
        """
        return self._plan.compression_plan()

    def exchange_plan(self):
        """The planner's decision with ``compression=Compression.planned(...)``: a
        :class:`cgx.planner.ExchangePlan` (``cgx.planner.format_exchange`` prints it per tensor), or
        None while the first steps are traced (and in other modes)."""
        return self._plan.planned.plan if self._plan.planned is not None else None

    def exchange_checks(self) -> list:
        """With ``Compression.planned(...)``: every drift check so far, as
        :class:`cgx.planner.schedule.DriftCheck` (step, predicted and measured step time,
        whether it re-planned); empty in other modes."""
        return list(self._plan.planned.checks) if self._plan.planned is not None else []

    def synchronize(self) -> None:
        """Finish the gradient exchange of this step: afterwards ``p.grad`` holds the average.

        Call it before gradient clipping, then step inside ``skip_synchronize()``.
        """
        with self._lock:
            if self._pending.next == 0 and not self._pending.handles and self._trainable_changed():
                self._setup()  # frozen/unfrozen since the last step, and no hook has fired
            while self._pending.next < len(self._buckets):
                self._launch(self._pending.next)
                self._pending.next += 1
            handles = self._pending.handles
            self._pending.handles = []
        t0 = time.perf_counter()
        try:
            for h in handles:
                h.wait(session.wait_timeout())
            for i, g in self._pending.sparse_out.items():
                self._params[i].grad = g
            for i, dims in self._pending.densified.items():
                self._params[i].grad = self._params[i].grad.to_sparse(dims)
        finally:
            self._reset_step_state()
            if self._capture is not None:
                self._capture.clear()
        if handles:
            # The time this thread waited: communication that backward did not hide.
            from cgx.collectives.reducer import ReduceStats
            session.reducer().add_stats(ReduceStats(
                steps=1, exposed_seconds=time.perf_counter() - t0))
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside this block ``step()`` does not synchronize (already done by ``synchronize()``)."""
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = True

    def step(self, closure=None):
        """Synchronize (unless inside ``skip_synchronize()``) and run the wrapped optimizer."""
        if self._should_sync and self._synchronized:
            # Already reduced: by synchronize(), or by a read of param_groups
            # (GradScaler.unscale_). Reducing again would reduce the results.
            if not self._auto_synced:
                # Horovod's sentence, which warning filters match.
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). The gradients are not "
                              "reduced twice, but wrap step() in skip_synchronize() to say so",
                              stacklevel=2)
        elif self._should_sync:
            self.synchronize()
        self._synchronized = self._auto_synced = False
        self._step_count += 1
        return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending.handles:
            raise CGXError("optimizer.zero_grad() was called after loss.backward() but before "
                           "optimizer.step() or optimizer.synchronize(); the gradients are "
                           "still being reduced. Call zero_grad() before backward() or after "
                           "step()")
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self._synchronized = self._auto_synced = False
        if getattr(self, "_capture", None) is not None:
            self._capture.clear()

    def add_param_group(self, param_group: dict) -> None:
        """Add parameters (the same on every rank, in the same order)."""
        if getattr(self, "_handles", None):
            raise CGXError("add_param_group() during a step: call it before backward()")
        self._optimizer.add_param_group(param_group)
        if hasattr(self, "_hooks"):
            self._setup()

    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus cgx's (residuals, compressor state, step count)."""
        sd = self._optimizer.state_dict()
        sd["cgx"] = {"format": STATE_FORMAT, "step": self._step_count,
                     "plan": self._plan.state_dict()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        sd = dict(state_dict)
        extra = sd.pop("cgx", None)
        self._optimizer.load_state_dict(sd)
        if extra is None:
            return
        if extra.get("format") != STATE_FORMAT:
            raise ValueError(f"checkpoint cgx state has format {extra.get('format')}, this cgx "
                             f"reads {STATE_FORMAT}")
        self._step_count = int(extra["step"])
        self._plan.load_state_dict(extra["plan"])

    # -- pickling: runtime objects (hooks, locks, handles) are rebuilt ----------------

    def __getstate__(self) -> dict:
        keep = ("_optimizer", "_passes_per_step", "_op", "_predivide", "_num_groups",
                "_sparse_as_dense", "_user_groups", "_compression", "_rules_source", "_step_count")
        state = {k: self.__dict__[k] for k in keep if k in self.__dict__}
        state["_plan_state"] = self._plan.state_dict()
        params = [p for g in self._optimizer.param_groups for p in g["params"]]
        state["_names_by_order"] = [self._names.get(id(p)) for p in params]
        state["_user_groups"] = None if self._user_groups is None else [
            [params.index(p) for p in g] for g in self._user_groups]
        return state

    def __setstate__(self, state: dict) -> None:
        opt = state["_optimizer"]
        if "_bpps" in state:  # pickled by an earlier version
            state["_passes_per_step"] = state.pop("_bpps")
        torch.optim.Optimizer.__setstate__(self, {"defaults": opt.defaults, "state": opt.state,
                                                  "param_groups": opt.param_groups})
        self.__dict__.update(state)
        params = [p for g in opt.param_groups for p in g["params"]]
        self._names = {id(p): n for p, n in zip(params, state.pop("_names_by_order"))
                       if n is not None}
        if self._user_groups is not None:
            self._user_groups = [[params[i] for i in g] for g in self._user_groups]
        self._registry_id = next(_registry_ids)
        self._group = None  # a process set is not pickled: the copy reduces over all ranks
        # The model is not pickled with the optimizer: sufficient factors start off.
        self._factor_model = None
        plan_state = self.__dict__.pop("_plan_state")
        if runtime.is_initialized():
            self._setup()
            self._plan.load_state_dict(plan_state)

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self._optimizer).__name__}, "
                f"mode={self._plan.mode.value}, "
                f"buckets={len(self._buckets)}, compression={self._compression!r})")

    # -- join: shadow steps for ranks that ran out of data --------------------------------

    def shadow_step(self) -> None:
        """Take part in one step of the other ranks with zero gradients (after join())."""
        with self._lock:
            for b in range(len(self._buckets)):
                # join_world() already did this step's status exchange.
                self._launch(b, zeros=True, status=False)
            handles, self._pending.handles = self._pending.handles, []
        for h in handles:
            h.wait(session.wait_timeout())
        self._reset_step_state()
