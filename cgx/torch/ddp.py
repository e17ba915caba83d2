"""A DDP communication hook: cgx compression for ``DistributedDataParallel`` users.

Example::

    model = DDP(model)
    state = cgx.torch.CGXState(model)             # settings from CGX_* variables
    model.register_comm_hook(state, cgx.torch.cgx_hook)

The hook reduces each DDP bucket with the fused compressed allreduce (one
segment per parameter, each with its own per-layer spec) on a background
engine thread, so DDP's backward keeps running. ``cgx.init()`` is not needed:
the hook works on DDP's ranks, through a process group of its own made from DDP's at
the first bucket (DDP's reducer and the user's code issue collectives on DDP's group
from the training thread; sharing it with the engine thread would mix the two).
Every DDP setting works: ``find_unused_parameters``, ``static_graph``,
``gradient_as_bucket_view``, ``no_sync()``, ``join()`` (with its default divisor),
autocast with a ``GradScaler``, ``torch.compile``. At exit the engine stops and the
group is released, so a script needs no shutdown call.
"""

import atexit
import threading
import time
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx.policy.update_rule import UpdateRule, update_rule_of
from cgx.comm.consistency import agree, signature
from cgx.exchange import ExchangeOptions, GradientPlan
from cgx.policy import GradMode
from cgx.policy import resolve as resolve_policy
from cgx.torch.plan_views import PlanViews
from cgx.exchange.step import StepRecorder
from cgx.torch.bucket_exchange import copy_back
from cgx.collectives import Reducer
from cgx.comm.torch_dist import TorchTransport
from cgx.config import Config

STATE_FORMAT = 2  # 1: residuals beside the plan (still read)


class CGXState(PlanViews):
    """All the hook's state: settings, per-parameter specs, error-feedback residuals, counters.

    Args:
        model: the (DDP-wrapped or plain) module, for parameter names.
        process_group: DDP's process group (None: the default group).
        config: settings (default: ``Config.from_env()``).
        rules: per-layer rules (dict, list or YAML path; see ``cgx.rules``).
        error_feedback: keep residuals (default: ``config.error_feedback``; with auto,
            by the optimizer, see below). With auto, this wins over the optimizer and
            over ``Compression.auto(error_feedback=...)``.
        compression: any ``Compression`` of ``DistributedOptimizer`` (e.g.
            ``Compression.quantize(bits=4, rotate=True)``, ``Compression.fp16``), or
            ``"auto"`` / ``Compression.auto(...)``: per-layer levels chosen within an
            error budget (``cgx.policy.levels``); auto also when ``CGX_COMPRESSION=auto``
            (with the ``CGX_AUTO_*`` settings). None: the ``CGX_*`` variables' fixed
            per-layer specs. The object passed is not changed.
        optimizer: the ``torch.optim`` optimizer that applies the averaged gradients
            (auto only): as in ``DistributedOptimizer``, auto keeps error-feedback
            residuals under SGD and not under Adam-type optimizers. Without it (and
            without ``error_feedback``), ``CGX_COMPRESSION_ERROR_FEEDBACK`` decides.

    The state pickles (the process group and engine are rebuilt on first use),
    and ``state_dict()``/``load_state_dict()`` carry residuals, the step and the plan.
    """

    def __init__(self, model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 config: Optional[Config] = None, rules=None,
                 error_feedback: Optional[bool] = None, compression=None,
                 optimizer: Optional[torch.optim.Optimizer] = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"CGXState needs the model (a torch.nn.Module) for parameter names, "
                            f"got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be the torch.optim.Optimizer that applies the "
                            f"gradients, got {type(optimizer).__name__}")
        ExchangeOptions.checked("CGXState", rules=rules)  # bad rules fail here, not in a hook
        self.config = config or Config.from_env()
        self.process_group = process_group
        rule = UpdateRule.UNKNOWN if optimizer is None else update_rule_of(optimizer)
        policy = resolve_policy(compression, self.config, rule, error_feedback=error_feedback)
        self.auto = policy.mode is GradMode.AUTO
        # DDP's own settings the hook must honour (join's divisor); not pickled
        self._ddp = weakref.ref(model) if isinstance(model, DDP) else None
        module = model.module if hasattr(model, "module") else model
        named = list(module.named_parameters())
        # One GradientPlan over all parameters: the specs, the residuals, auto's levels.
        self.plan = GradientPlan([n for n, _ in named], [tuple(p.shape) for _, p in named],
                                 policy, rules=rules, update_rule=rule, config=self.config)
        self.error_feedback = self.plan.error_feedback
        self.index = {id(p): i for i, (_, p) in enumerate(named)}
        # -- internal state (checkpointed) --
        self.iteration = 0  # buckets of one backward share it; advanced by bucket 0
        # -- runtime objects (not pickled) --
        self._reducer: Optional[Reducer] = None
        self.checked: set = set()  # bucket layouts every rank agreed on

    def reducer(self) -> Reducer:
        """The engine and group this hook's exchanges run on (made at the first bucket):
        a group of its own over DDP's ranks, never DDP's group itself (see
        :func:`hook_reducer`)."""
        if self._reducer is None:
            self._reducer = hook_reducer(self.process_group, self.config)
        return self._reducer

    def stats(self):
        """What the hook's exchanges cost so far, as a ``cgx.collectives.ReduceStats``:
        ``wire_bytes`` this rank sent, ``ratio`` (an fp32 ring allreduce's bytes over
        them), seconds per phase. Hooks over the same ranks and settings share one engine,
        so their exchanges count together. Before the first bucket: all zeros."""
        from cgx.collectives import ReduceStats
        return self._reducer.snapshot() if self._reducer is not None else ReduceStats()

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "iteration": self.iteration,
                "plan": self.plan.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") not in (1, STATE_FORMAT):
            raise ValueError(f"CGXState checkpoint has format {state.get('format')}, expected "
                             f"{STATE_FORMAT}")
        self.iteration = int(state["iteration"])
        if "plan" in state:
            self.plan.load_state_dict(state["plan"])
        if state["format"] == 1:  # the residuals were kept beside the plan (same units)
            self.plan.residuals.residuals.update(
                {k: v.detach().clone() for k, v in state["residuals"].items()})

    def gradient_plan(self) -> GradientPlan:
        return self.plan

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["process_group"] = None  # process groups do not pickle; the default is used
        state["_reducer"] = None
        state["_ddp"] = None
        state["checked"] = set()
        return state

    def __setstate__(self, state: dict) -> None:
        for old in ("plan", "index", "checked"):  # pickled by an earlier version
            if "_" + old in state:
                state[old] = state.pop("_" + old)
        self.__dict__.update(state)


# The hook's reducers, one per set of DDP ranks, backend and settings: (key) -> Reducer.
_hook_reducers: dict = {}
_hook_lock = threading.Lock()
_atexit_registered = False
RETIRE_S = 0.05  # at exit, the pause that lets Gloo's workers retire the last collective


def hook_reducer(process_group: Optional[dist.ProcessGroup], config: Config) -> Reducer:
    """The Reducer for hooks on ``process_group``'s ranks, over a twin group of those ranks
    (``TorchTransport.twin``), made once and shared by every hook state over the same ranks
    and settings (one engine thread keeps their collectives in one order).

    DDP's reducer issues collectives of its own on its group from the training thread (the
    unused-parameter map under ``find_unused_parameters=True``, the first iteration of
    ``static_graph``, ``join()``'s shadow passes), as may the user's code; the engine
    sending on that group at the same time would interleave with them differently on
    different ranks (a hang, or Gloo's "Received data size doesn't match").
    """
    ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    key = (ranks, str(dist.get_backend(process_group)), config)
    with _hook_lock:
        red = _hook_reducers.get(key)
        if red is None:
            for (r, b, _cfg) in _hook_reducers:
                if (r, b) == key[:2] and len(ranks) != dist.get_world_size():
                    raise ValueError(
                        f"a cgx DDP hook over the process group of ranks {list(ranks)} "
                        "already runs with other settings (config); every CGXState over "
                        "one sub-group must use the same Config")
            from cgx import runtime
            board = runtime.progress_board() if runtime.is_initialized() else None
            red = Reducer(TorchTransport.twin(process_group, config.timeout_s), config,
                          board=board)
            global _atexit_registered
            if not _atexit_registered:
                atexit.register(close_hook_reducers)
                _atexit_registered = True
            _hook_reducers[key] = red
        return red


def close_hook_reducers() -> None:
    """Stop the hooks' engines and release their groups (at exit, and by tests): after
    the last step, a script that never calls a shutdown function exits cleanly."""
    with _hook_lock:
        reducers = list(_hook_reducers.values())
        _hook_reducers.clear()
    for red in reducers:
        red.close()
    if reducers:
        # The engines have left, but a Gloo worker may still be dropping the last
        # reference to a tensor of the last collective: made in Python, it needs the GIL,
        # which after finalization has begun it cannot take (the process then aborts:
        # "terminate called without an active exception"). A pause lets it finish.
        time.sleep(RETIRE_S)
    for red in reducers:
        red.transport.close()


def _check_join(state: CGXState) -> None:
    """The hook averages over every rank of the group, as ``ddp.join()`` does by default;
    its other divisor (the ranks not yet joined) it does not offer."""
    ddp = state._ddp() if getattr(state, "_ddp", None) is not None else None
    if ddp is not None and getattr(ddp, "_divide_by_initial_world_size", True) is False:
        raise ValueError("cgx_hook averages over all ranks of DDP's group, as "
                         "ddp.join(divide_by_initial_world_size=True) (the default) does; "
                         "it does not support divide_by_initial_world_size=False: leave the "
                         "default")


def _check_layout(state: CGXState, name: str, grads, indices) -> None:
    """Once per bucket layout (DDP launches the same buckets in the same order on every
    rank, and rebuilds them everywhere alike): the ranks agree on it."""
    plan = state.plan
    specs = ["auto"] * len(indices) if state.auto else [plan.specs[i] for i in indices]
    sig = signature("DDP bucket", name, names=[plan.names[i] for i in indices],
                    shapes=[tuple(g.shape) for g in grads],
                    dtypes=[g.dtype for g in grads], specs=specs,
                    error_feedback=state.error_feedback)
    if sig.digest() not in state.checked:
        agree(state.reducer().transport, sig, recoverable=False)
        state.checked.add(sig.digest())


def _reduce(state: CGXState, bucket: dist.GradBucket, fut: torch.futures.Future,
            step: int) -> None:
    try:
        indices, grads = _in_model_order(state, bucket)
        name = f"ddp.bucket{bucket.index()}"
        if state.config.check_consistency:
            _check_layout(state, name, grads, indices)
        outs = state.plan.reduce(list(grads), name=name, step=step, indices=indices,
                                  reducer=state.reducer())
        copy_back(grads, outs)
        fut.set_result(bucket.buffer())
    except BaseException as exc:
        fut.set_exception(exc)


def _in_model_order(state: CGXState, bucket: dist.GradBucket) -> tuple:
    """The bucket's parameter indices and gradients, in the model's parameter order, each
    gradient in its parameter's shape, as the optimizer's exchange sees it (PowerSGD
    factors a matrix: flat, it would travel exact).

    DDP's first iteration lists a bucket's parameters in another order than the buckets it
    rebuilds after it; the fused layout, and so the stochastic rounding, follows the order
    it is given. In one order, a run resumed from a checkpoint (a first iteration again)
    rounds as the uninterrupted run did."""
    pairs = sorted(zip((state.index[id(p)] for p in bucket.parameters()), bucket.gradients()),
                   key=lambda pair: pair[0])
    return [i for i, _ in pairs], [g.view(state.plan.shapes[i]) for i, g in pairs]


def cgx_hook(state: CGXState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients, compressed per layer.

    Returns a future that completes when the engine thread has reduced the
    bucket; DDP launches buckets in a fixed order, which the engine keeps.
    """
    _check_join(state)
    red = state.reducer()
    step = state.iteration  # all buckets of one backward share the step of their key
    if bucket.is_last():
        state.iteration += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    # Ready marks on the timeline, and the planned mode's ready times.
    StepRecorder(state.plan, red).ready(sorted(state.index[id(p)] for p in bucket.parameters()),
                                         step, row=f"ddp.bucket{bucket.index()}")
    red.engine().submit(_reduce, (state, bucket, fut, step), label=f"ddp.bucket{bucket.index()}")
    # DDP reads the future's value in C++, where an exception set as a Python result is
    # only "Unable to cast ... to Tensor"; raised in a callback, it is the future's error.
    return fut.then(_bucket_or_raise)


def _bucket_or_raise(fut: torch.futures.Future) -> torch.Tensor:
    return fut.wait()
