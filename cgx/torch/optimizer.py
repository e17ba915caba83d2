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

Compression: ``compression=Compression.none`` (Horovod's default) means what
``CGX_COMPRESSION`` says: by default the deciding exchange (trials keep the fastest
measured plan within the error budget of 4-bit: :mod:`cgx.policy.trials`); with
``CGX_COMPRESSION=quantize``, max-min quantization with ``CGX_COMPRESSION_*``
settings (4 bits, bucket 1024 by default; ``CGX_COMPRESSION_QUANTIZATION_BITS=32``
turns it off); per-layer rules from ``rules=`` or ``CGX_COMPRESSION_CONFIG``. ``Compression.exact`` sends them uncompressed. Other compressors (``fp16``, ``bf16``,
``Compression.quantize(...)``, ``topk``, ``powersgd``) are used as given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from typing import Optional

import torch

from cgx import runtime
from cgx.compression import Compression, resolve
from cgx.errors import CGXError
from cgx.policy.update_rule import update_rule_of
from cgx.exchange import (ExchangeOptions, GradientPlan, GradMode,  # noqa: F401 - GradMode: API
                          check_wrapped_once)
from cgx.exchange.options import default_names, names_by_id
from cgx.exchange.step import StepRecorder
from cgx import session
from cgx.torch import join
from cgx.torch.bucket_exchange import BucketExchange, Layout, make_buckets, step_signature
from cgx.torch.factor_discovery import FactorDiscovery
from cgx.torch.factor_layers import FactorLayers
from cgx.torch.grad_hooks import GradHooks
from cgx.torch.sparse_gradients import SparseGradients
from cgx.torch.plan_views import PlanViews
from cgx.torch.wrapped_optimizer import WrappedOptimizer
from cgx.ops import Average, group_size
from cgx.process_sets import global_process_set

STATE_FORMAT = 1
# Horovod's sentence, which warning filters match.
STEP_AFTER_SYNCHRONIZE = ("optimizer.step() called without optimizer.skip_synchronize() context "
                          "after optimizer.synchronize(). The gradients are not reduced twice, "
                          "but wrap step() in skip_synchronize() to say so")
ZERO_GRAD_IN_FLIGHT = ("optimizer.zero_grad() was called after loss.backward() but before "
                       "optimizer.step() or optimizer.synchronize(); the gradients are still "
                       "being reduced. Call zero_grad() before backward() or after step()")


class DistributedOptimizer(PlanViews, WrappedOptimizer):
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
        sparse_as_dense: False (default, Horovod's): sparse gradients stay sparse
            (all-gathered, uncompressed); True: they travel densely, compressed, and are
            handed back sparse. See ``cgx.torch.sparse_gradients``.
        process_set: reduce over the ranks of this process set only (every rank of the
            set wraps an optimizer with it; see ``cgx.process_sets``). ``join()`` covers
            optimizers of the global set.
        rules: per-layer rules (dict, list or YAML path, see ``cgx.rules``).
        sufficient_factors: the model, to exchange the weight gradients of its
            ``nn.Linear`` layers as sufficient factors (Poseidon) whenever that moves
            fewer bytes and is exact; see ``cgx.torch.factor_layers``. Not given, the
            deciding default (and ``Compression.planned()``) finds the layers in the
            first step (``cgx.torch.factor_discovery``) and weighs factors in its
            trials; ``False`` turns that off.

    Example::

        opt = cgx.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters())
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None,
                 compression=Compression.none, backward_passes_per_step: int = 1,
                 op=Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups=None, sparse_as_dense: bool = False, process_set=global_process_set,
                 *, rules=None, sufficient_factors: "torch.nn.Module | bool | None" = None):
        _check_types(optimizer, sufficient_factors)
        if isinstance(groups, int):  # Horovod's spelling of num_groups
            num_groups, groups = groups, None
        self._opts = ExchangeOptions.checked(
            "DistributedOptimizer", op=op, gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step, num_groups=num_groups,
            sparse_as_dense=sparse_as_dense, process_set=process_set, rules=rules)
        self._adopt(optimizer)  # its param_groups and state, shared
        every = self._all_params()
        self._names = names_by_id(named_parameters, "named_parameters", required=every,
                                  unique=True)
        self._user_groups = _checked_groups(groups, every)
        self._compression = resolve(compression)
        self._factor_model = sufficient_factors
        self._step_count = 0  # part of the state: feeds the stochastic-rounding key
        self._init_runtime()

    def _init_runtime(self) -> None:
        """What is rebuilt rather than pickled: hooks, lock, sparse paths, the layout."""
        self._hooks = GradHooks()
        self._lock = threading.RLock()
        self._sparse = SparseGradients(self._opts.sparse_as_dense)
        self._factors: Optional[FactorLayers] = None
        self._found: list = []  # the layers factor discovery found: (name, module)
        self._discovery: Optional[FactorDiscovery] = None
        self._setup()
        if self._factor_model is None and self._plan.planned is not None and \
                group_size(self._opts.group) > 1:
            self._discovery = FactorDiscovery(self._exchange.layout.params)
            weakref.finalize(self, self._discovery.remove)

    # -- construction -------------------------------------------------------------

    @property
    def _parameter_names(self) -> dict:
        """Horovod's ``optimizer._parameter_names``: parameter -> name, for every parameter
        (names from ``named_parameters``, else Horovod's ``allreduce.noname.<group>.<index>``)."""
        return {p: self._names[id(p)] for p in self._all_params() if id(p) in self._names}

    def _setup(self) -> None:
        """The layout of the exchange (again after freezing or add_param_group): 1. the
        trainable parameters and their names; 2. the plan; 3. the factor layers; 4. the
        buckets; 5. the hooks; 6. what every rank must agree on."""
        if not runtime.is_initialized():
            raise CGXError("DistributedOptimizer needs cgx.torch.init() to be called first")
        cfg = runtime.config()
        groups = self._groups()
        self._trainable = tuple(p.requires_grad for g in groups for p in g["params"])
        params = [p for g in groups for p in g["params"] if p.requires_grad]
        self._names = default_names([g["params"] for g in groups], self._names, "allreduce")
        self._index = {id(p): i for i, p in enumerate(params)}
        self._plan = self._make_plan(params, cfg)
        self._capture_factors(params)
        user_groups = None if self._user_groups is None else [
            [self._index[id(p)] for p in g if id(p) in self._index] for g in self._user_groups]
        buckets = make_buckets(params, cfg.fusion_buffer_bytes, user_groups,
                               self._opts.num_groups, self._factors)
        self._hooks.install(params, self._on_grad)
        self._should_sync, self._synchronized, self._auto_synced = True, False, False
        owner = self._hooks.owner_id
        self._exchange = BucketExchange(Layout(
            owner, params, [self._names[id(p)] for p in params], buckets, self._plan,
            self._opts, step_signature(owner, self._plan, params, buckets, self._compression,
                                       self._opts, self._factors),
            StepRecorder(self._plan, session.reducer()), self._sparse, self._factors))
        join.register(owner, self)

    def _make_plan(self, params: list, cfg) -> GradientPlan:
        """The exchange of ``params``: `compression` mapped to a mode, per-layer specs and
        residuals (``cgx.exchange``); the previous plan's state carries over."""
        old_plan = self.__dict__.get("_plan")
        opts = self._opts
        plan = GradientPlan([self._names[id(p)] for p in params],
                            [tuple(p.shape) for p in params], self._compression,
                            op=opts.op, predivide=opts.predivide, rules=opts.rules,
                            config=cfg, group=opts.group,
                            update_rule=update_rule_of(self._optimizer))
        if old_plan is not None:
            plan.load_state_dict(old_plan.state_dict())
        return plan

    def _capture_factors(self, params: list) -> None:
        """Sufficient factors: hooks on the model's Linear layers, whose weights (with their
        biases) travel in buckets of their own (``cgx.torch.factor_layers``)."""
        if self._factors is not None:
            self._factors.remove()
        self._factors = None
        if isinstance(self._factor_model, torch.nn.Module):
            self._factors = FactorLayers(self._factor_model.named_modules(), params,
                                         self._index, self)
        elif self._found:
            self._factors = FactorLayers(self._found, params, self._index, self, self._names)

    def _finish_discovery(self) -> None:
        """After the first step: the layers found on every rank become the factor layers
        (a collective; a joined rank's shadow step takes part too)."""
        discovery, self._discovery = self._discovery, None
        if discovery is not None:
            self._found = discovery.finish(self._opts.group)
            if self._found:  # laid out again, in the middle of a step: its flags and
                # what the plan decided for it stay
                flags, old = (self._should_sync, self._synchronized, self._auto_synced), \
                    self._plan
                self._setup()
                self._should_sync, self._synchronized, self._auto_synced = flags
                self._plan.reduction.carry_step(old.reduction)

    def _trainable_changed(self) -> bool:
        """Did parameters get frozen or unfrozen since the buckets were built?"""
        return tuple(p.requires_grad for p in self._all_params()) != self._trainable

    def _before_groups_read(self) -> None:
        """Reading the groups while this step's gradients are still being reduced (as
        ``GradScaler.unscale_``/``GradScaler.step`` do) first finishes the exchange, so
        nobody reads a gradient in flight."""
        exchange = self.__dict__.get("_exchange")
        if exchange is not None and exchange.pending.handles and \
                threading.current_thread().name != "cgx-engine":
            self.synchronize()
            self._auto_synced = True

    # -- backward hooks ------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor, generation: int) -> None:
        with self._lock:
            if not self._hooks.current(p, generation):
                return  # a hook of an older layout, or another optimizer owns p now
            if not self._exchange.pending.started:  # the first gradient of a new step
                self._synchronized = self._auto_synced = False
                if self._trainable_changed():
                    # Parameters were frozen or unfrozen since the last step: new buckets
                    # (the same on every rank, which freeze the same way).
                    self._setup()
            i = self._index.get(id(p))
            if i is not None:
                self._exchange.ready(i, self._step_count)

    # -- the public optimizer API -------------------------------------------------------

    @property
    def timing(self) -> dict:
        """The last step's launch/start/end times of the buckets and factor exchanges."""
        return self._exchange.timing

    @property
    def sfb_used(self) -> dict:
        """The last step's sufficient-factor layers: weight name -> travelled as factors."""
        return self._factors.used if self._factors is not None else {}

    @property
    def _mode(self) -> GradMode:
        return self._plan.mode

    @property
    def _specs(self) -> list:
        return self._plan.specs

    def gradient_plan(self) -> GradientPlan:
        return self._plan

    def synchronize(self) -> None:
        """Finish the gradient exchange of this step: afterwards ``p.grad`` holds the average.

        Call it before gradient clipping, then step inside ``skip_synchronize()``.
        """
        with self._lock:
            if not self._exchange.pending.started and self._trainable_changed():
                self._setup()  # frozen/unfrozen since the last step, and no hook has fired
            exchange = self._exchange
            handles = exchange.launch_rest(self._step_count)
        try:
            # The time this thread waits: communication that backward did not hide.
            with exchange.layout.recorder.waiting() if handles else contextlib.nullcontext():
                for h in handles:
                    h.wait(session.wait_timeout())
            self._sparse.hand_back(exchange.layout.params)
        finally:
            exchange.reset()
            if self._factors is not None:
                self._factors.clear()
        self._synchronized = True
        self._finish_discovery()

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
                warnings.warn(STEP_AFTER_SYNCHRONIZE, stacklevel=2)
        elif self._should_sync:
            self.synchronize()
        self._synchronized = self._auto_synced = False
        self._step_count += 1
        return self._optimizer.step(closure) if closure is not None else self._optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._exchange.pending.handles:
            raise CGXError(ZERO_GRAD_IN_FLIGHT)
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self._synchronized = self._auto_synced = False
        if self._factors is not None:
            self._factors.clear()

    def add_param_group(self, param_group: dict) -> None:
        """Add parameters (the same on every rank, in the same order)."""
        exchange = self.__dict__.get("_exchange")
        if exchange is not None and exchange.pending.handles:
            raise CGXError("add_param_group() during a step: call it before backward()")
        self._optimizer.add_param_group(param_group)
        if "_hooks" in self.__dict__:  # not while torch.optim.Optimizer builds us
            self._setup()

    # -- elastic jobs (cgx.torch.elastic) -------------------------------------------------

    def discard_step(self) -> None:
        """Forget the step in flight (its collectives failed: a rank was lost)."""
        with self._lock:
            self._exchange.reset()

    def world_changed(self) -> None:
        """The job's world changed (``cgx.torch.elastic``): the exchange is laid out again
        on the new world, the plan's state (residuals, levels) carries over, and what was
        measured on the old world is measured again."""
        with self._lock:
            self._exchange.reset()
            self._setup()
            self._plan.world_changed(self._step_count)

    def owed_residual(self) -> float:
        """What this rank's error feedback still owes: the sum of absolute values of its
        residuals over every tensor (0.0 without error feedback)."""
        owed = (self._plan.residual(n) for n in self._plan.names)
        return float(sum(float(r.abs().sum()) for r in owed if r is not None))

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
        if extra is not None:
            self._step_count = int(_checked_format(extra)["step"])
            self._plan.load_state_dict(extra["plan"])

    # -- pickling: runtime objects (hooks, locks, handles) are rebuilt ----------------

    def __getstate__(self) -> dict:
        return _pickled(self, self._all_params())

    def __setstate__(self, state: dict) -> None:
        self._adopt(state["_optimizer"])
        plan_state = _unpickled(self.__dict__, state, self._all_params())
        if runtime.is_initialized():
            self._init_runtime()
            self._plan.load_state_dict(plan_state)

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self._optimizer).__name__}, "
                f"mode={self._plan.mode.value}, "
                f"buckets={len(self._exchange.layout.buckets)}, compression={self._compression!r})")

    # -- join: shadow steps for ranks that ran out of data --------------------------------

    def shadow_step(self) -> None:
        """Take part in one step of the other ranks with zero gradients (after join()). It
        counts as a step: what the plan decides by the step count (the deciding default's
        trials) stays the same on every rank."""
        with self._lock:
            exchange = self._exchange
            handles = exchange.shadow(self._step_count)
        for h in handles:
            h.wait(session.wait_timeout())
        exchange.reset()
        self._step_count += 1
        self._finish_discovery()


def _check_types(optimizer, factor_model) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    check_wrapped_once(optimizer, DistributedOptimizer)
    if factor_model not in (None, False) and not isinstance(factor_model, torch.nn.Module):
        raise TypeError(f"sufficient_factors= takes the model (a torch.nn.Module) or False, "
                        f"got {type(factor_model).__name__}")


def _checked_format(extra: dict) -> dict:
    if extra.get("format") != STATE_FORMAT:
        raise ValueError(f"checkpoint cgx state has format {extra.get('format')}, this cgx "
                         f"reads {STATE_FORMAT}")
    return extra


def _checked_groups(groups, params: list) -> Optional[list]:
    """Horovod's ``groups=``: explicit buckets (lists of the optimizer's parameters)."""
    if groups is None:
        return None
    groups = [list(g) for g in groups]
    known = {id(p) for p in params}
    if any(id(p) not in known for g in groups for p in g):
        raise ValueError("groups holds a parameter the optimizer does not have")
    return groups


def _pickled(opt: DistributedOptimizer, params: list) -> dict:
    """What a pickled DistributedOptimizer keeps: the wrapped optimizer, the options (less
    the process set: a copy reduces over all ranks), names and groups by position, the
    compression and its state, the step count."""
    d = opt.__dict__
    groups = d["_user_groups"]
    return {"_optimizer": d["_optimizer"], "_compression": d["_compression"],
            "_step_count": d["_step_count"],
            "_opts": dataclasses.replace(d["_opts"], process_set=None, group=None),
            "_plan_state": d["_plan"].state_dict(),
            "_names_by_order": [d["_names"].get(id(p)) for p in params],
            "_user_groups": None if groups is None else [[params.index(p) for p in g]
                                                          for g in groups]}


def _unpickled(d: dict, state: dict, params: list) -> dict:
    """Fill ``d`` (the new optimizer's ``__dict__``) from a pickled state, also one pickled
    by an earlier version (options as separate fields); returns the plan's state."""
    opts = state.get("_opts")
    if opts is None:
        opts = ExchangeOptions(
            state.get("_op", ExchangeOptions.op), state.get("_predivide", 1.0),
            state.get("_passes_per_step", state.get("_bpps", 1)), state.get("_num_groups", 0),
            state.get("_sparse_as_dense", False), rules=state.get("_rules_source"))
    groups = state.get("_user_groups")
    d.update(_optimizer=state["_optimizer"], _compression=state["_compression"],
             _step_count=state["_step_count"], _opts=opts,
             _names={id(p): n for p, n in zip(params, state["_names_by_order"])
                     if n is not None},
             _user_groups=None if groups is None else [[params[i] for i in g] for g in groups],
             # The model is not pickled with the optimizer: sufficient factors start off.
             _factor_model=None)
    return state["_plan_state"]
