"""A DDP communication hook: cgx compression for ``DistributedDataParallel`` users.

Example::

    model = DDP(model)
    state = cgx.torch.CGXState(model)             # settings from CGX_* variables
    model.register_comm_hook(state, cgx.torch.cgx_hook)

The hook reduces each DDP bucket with the fused compressed allreduce (one
segment per parameter, each with its own per-layer spec) on a background
engine thread, so DDP's backward keeps running. ``cgx.init()`` is not needed:
the hook uses DDP's process group.
"""

from typing import Optional

import torch
import torch.distributed as dist

from cgx.adaptive.compensation import UpdateRule, update_rule_of
from cgx.comm.consistency import agree, signature
from cgx.compression import AutoCompression, Compression, default_policy, is_default, resolve
from cgx.exchange import ExchangeOptions, GradientPlan
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
            error budget (``cgx.adaptive``); auto also when ``CGX_COMPRESSION=auto``
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
        given = None if compression is None else resolve(compression)
        if given is None or is_default(given):
            given = default_policy(self.config)  # None: the uniform CGX_COMPRESSION_* level
        self.auto = isinstance(given, AutoCompression)
        module = model.module if hasattr(model, "module") else model
        named = list(module.named_parameters())
        # One GradientPlan over all parameters: the specs, the residuals, auto's levels.
        self.plan = GradientPlan(
            [n for n, _ in named], [tuple(p.shape) for _, p in named],
            _auto_settings(given, error_feedback) if self.auto
            else given if given is not None else Compression.none,
            rules=rules, update_rule=UpdateRule.UNKNOWN if optimizer is None
            else update_rule_of(optimizer),
            config=self.config if error_feedback is None or self.auto
            else self.config.replace(error_feedback=bool(error_feedback)))
        self.error_feedback = self.plan.error_feedback
        self.index = {id(p): i for i, (_, p) in enumerate(named)}
        # -- internal state (checkpointed) --
        self.iteration = 0  # buckets of one backward share it; advanced by bucket 0
        # -- runtime objects (not pickled) --
        self._reducer: Optional[Reducer] = None
        self.checked: set = set()  # bucket layouts every rank agreed on

    def reducer(self) -> Reducer:
        if self._reducer is None:
            from cgx import runtime
            board = runtime.progress_board() if runtime.is_initialized() else None
            self._reducer = Reducer(TorchTransport(self.process_group), self.config,
                                    board=board)
        return self._reducer

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
        state["checked"] = set()
        return state

    def __setstate__(self, state: dict) -> None:
        for old in ("plan", "index", "checked"):  # pickled by an earlier version
            if "_" + old in state:
                state[old] = state.pop("_" + old)
        self.__dict__.update(state)


def _auto_settings(comp, error_feedback: Optional[bool]):
    """The ``Compression.auto`` settings the hook plans with: ``comp`` (a copy when
    ``error_feedback`` overrides it: the caller's object is never changed)."""
    import copy
    if error_feedback is not None:
        comp = copy.copy(comp)
        comp.error_feedback = bool(error_feedback)
    return comp


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
        indices = [state.index[id(p)] for p in bucket.parameters()]
        # each gradient in its parameter's shape, as the optimizer's exchange sees it
        # (PowerSGD factors a matrix: flat, it would travel exact)
        grads = [g.view(state.plan.shapes[i]) for g, i in zip(bucket.gradients(), indices)]
        name = f"ddp.bucket{bucket.index()}"
        if state.config.check_consistency:
            _check_layout(state, name, grads, indices)
        outs = state.plan.reduce(list(grads), name=name, step=step, indices=indices,
                                  reducer=state.reducer())
        copy_back(grads, outs)
        fut.set_result(bucket.buffer())
    except BaseException as exc:
        fut.set_exception(exc)


def cgx_hook(state: CGXState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients, compressed per layer.

    Returns a future that completes when the engine thread has reduced the
    bucket; DDP launches buckets in a fixed order, which the engine keeps.
    """
    red = state.reducer()
    step = state.iteration  # all buckets of one backward share the step of their key
    if bucket.is_last():
        state.iteration += 1
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    # Ready marks on the timeline, and the planned mode's ready times.
    StepRecorder(state.plan, red).ready([state.index[id(p)] for p in bucket.parameters()],
                                         step, row=f"ddp.bucket{bucket.index()}")
    red.engine().submit(_reduce, (state, bucket, fut, step), label=f"ddp.bucket{bucket.index()}")
    return fut
