"""The outer loop of DiLoCo, once for both adapters: anchors, outer gradients, their
compressed exchange (overlapped with the inner steps), the outer optimizer, the state.

Framework-free: parameters are read and written through a :class:`ParamAccess` that
the adapter gives (torch: the parameters themselves; Keras: its variables' values), as
torch tensors, the core's currency. The outer gradient ``anchor - current`` of a
fragment is averaged by a :class:`cgx.exchange.GradientPlan` on the session's engine
thread (``compression=`` of cgx, residuals kept per parameter), so the next inner
steps run while it travels; its result lands ``delay`` steps later. The average is
the same on every rank, bit for bit (SRA's reduced chunks are quantized once by their
owner and every rank decodes the same bytes), and so are the anchors and the outer
optimizer's state: after a fragment lands (``mix=0``), every rank holds the same
values of its parameters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import statistics
import time
import warnings
from typing import Optional, Protocol, Sequence

import torch

from cgx import ops, runtime, session
from cgx.collectives import joining
from cgx.comm.consistency import signature, tensor_fields
from cgx.compression import Compression, fixed
from cgx.diloco.config import DiLoCoConfig
from cgx.diloco.schedule import FragmentSchedule
from cgx.errors import CollectiveMismatchError
from cgx.exchange import GradientPlan

STATE_FORMAT = 1
DIFFERENT_START = (
    "DiLoCo: the ranks began their local steps with different parameters; rank 0's were "
    "broadcast (a whole fp32 model), and this step's gradient was computed on each rank's "
    "own. Broadcast them before training: hvd.broadcast_parameters(model.state_dict(), "
    "root_rank=0) (torch) or hvd.callbacks.BroadcastGlobalVariablesCallback(0) (Keras)")


class ParamAccess(Protocol):
    """How the loop reaches the model's parameters (indices into the loop's list)."""

    def read(self, indices: Sequence[int]) -> list:
        """The current values, as torch tensors (the loop never writes into them)."""

    def write(self, indices: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        """Set the parameters to ``values`` (float32; cast as the parameter needs)."""


@dataclasses.dataclass
class LoopState:
    """Everything a checkpoint keeps (it pickles; tensors are copied in and out).

    Attributes:
        step: inner steps done, warm-up included.
        anchors: per parameter, float32: the values of the last sync (the same on every
            rank), None before the local steps begin.
        momentum: per parameter, the outer optimizer's buffer (None until used).
        sync_every: H in use; None while ``"auto"`` still calibrates.
        schedule_start: the local step the current schedule began after.
        landed: fragment -> (local step it lands at, its parameter indices, its averaged
            outer gradient): exchanges finished and not applied yet (a checkpoint taken
            while one travels waits for it and keeps it here).
        step_seconds: ``"auto"``: the calibration round's inner step times.
        momentum_lr: per parameter, the inner learning rate at its last outer step
            (``OuterSGD(follow_inner_lr=True)``; None before it has one, and before the
            local steps begin).
    """

    step: int = 0
    anchors: Optional[list] = None
    momentum: Optional[list] = None
    sync_every: Optional[int] = None
    schedule_start: int = 0
    landed: dict = dataclasses.field(default_factory=dict)
    step_seconds: list = dataclasses.field(default_factory=list)
    momentum_lr: Optional[list] = None


class OuterLoop:
    """DiLoCo's outer loop over a fixed list of parameters.

    Args:
        names: one name per parameter (keys residuals and per-layer rules).
        shapes: their shapes.
        config: the :class:`DiLoCoConfig`.
        group: a resolved process set (None: every rank).
        label: names the collectives (the same on every rank).

    The adapter calls, per inner step: :meth:`average_gradients` during the warm-up
    (synchronous data parallel), :meth:`before_inner_step`, the inner optimizer, then
    :meth:`after_inner_step`.
    """

    def __init__(self, names: Sequence[str], shapes: Sequence, config: DiLoCoConfig, *,
                 group=None, label: str = "diloco"):
        if not isinstance(config, DiLoCoConfig):
            raise TypeError(f"config must be a DiLoCoConfig, got {type(config).__name__}")
        config.check_parameters(len(names))
        self.config, self.group, self.label = config, group, label
        self.names = list(names)
        self.numels = [math.prod(s) for s in shapes]
        self.plan = GradientPlan(names, shapes, config.outer_compression(), group=group)
        self.warmup_plan = GradientPlan(
            names, shapes, fixed(config.warmup_compression or Compression.none,
                                 runtime.config_in_use()), group=group) \
            if config.warmup_steps else None
        self.state = LoopState(sync_every=None if config.auto else int(config.sync_every))
        self._inflight: dict = {}  # fragment -> (handle, lands at, indices)
        self._last_time: Optional[float] = None  # "auto": when the last inner step ended
        self._schedule: Optional[FragmentSchedule] = None  # for _schedule_key (H, start)
        self._schedule_key: Optional[tuple] = None
        self._inner_lr: Optional[list] = None  # per parameter, given by after_inner_step
        self.choice = None  # "auto": the cgx.diloco.auto.RoundChoice made

    @property
    def follows_inner_lr(self) -> bool:
        """Does the outer step need ``inner_lr`` (``OuterSGD(follow_inner_lr=True)``)?"""
        opt = self.config.outer_optimizer
        return opt is not None and opt.follow_inner_lr

    # -- where the run is ----------------------------------------------------------------

    @property
    def in_warmup(self) -> bool:
        """Is the next inner step a synchronous one (gradients averaged)?"""
        return self.state.step < self.config.warmup_steps

    @property
    def local_step(self) -> int:
        """Local steps done (the warm-up left out)."""
        return max(0, self.state.step - self.config.warmup_steps)

    @property
    def schedule(self) -> FragmentSchedule:
        st, cfg = self.state, self.config
        h = st.sync_every if st.sync_every is not None else \
            max(cfg.calibrate_steps, cfg.fragments, cfg.delay + 1)
        key = (h, st.schedule_start)
        if self._schedule_key != key:
            self._schedule = FragmentSchedule.make(self.numels, cfg.fragments, h, cfg.delay,
                                                   st.schedule_start)
            self._schedule_key = key
        return self._schedule

    def next_event(self) -> int:
        """The value of :attr:`LoopState.step` after which :meth:`after_inner_step` next has
        work (a sync, a landing, a calibration step); a caller may skip it at other steps
        (the Keras adapter runs it only then)."""
        st, warm = self.state, self.config.warmup_steps
        s = self.local_step
        if st.sync_every is None:
            return st.step + 1
        due = [self.schedule.next_sync(s)]
        due += [at for _, at, _ in self._inflight.values() if at > s]
        due += [at for at, _, _ in st.landed.values() if at > s]
        return warm + min(due)

    # -- the steps -----------------------------------------------------------------------

    def average_gradients(self, grads: list, step: Optional[int] = None) -> list:
        """Warm-up: ``grads`` (owned by the caller, overwritten) averaged over the ranks,
        synchronous data parallel. ``step``: the inner steps done (default: as counted)."""
        step = self.state.step if step is None else int(step)
        return session.run(self.warmup_plan.reduce, grads, name=f"{self.label}.warmup",
                           step=step, label=f"{self.label}.warmup")

    def before_inner_step(self, access: ParamAccess, step: Optional[int] = None) -> None:
        """At the first local step: the anchors become rank 0's parameters, and so do the
        parameters themselves. ``step``: the inner steps done (default: as counted here).

        The ranks first compare digests of their parameters: where they already hold the
        same values (``broadcast_parameters`` at the start), the broadcast, a whole fp32
        model sent by rank 0, is skipped. Where they differ it runs, with a warning: the
        step's gradient was computed on each rank's own parameters."""
        if step is not None:
            self.state.step = int(step)
        if self.state.anchors is not None or self.in_warmup:
            return
        values = [v.detach().to(torch.float32, copy=True).contiguous()
                  for v in access.read(range(len(self.names)))]
        digests = ops.allgather_object(_digest(values), name=f"{self.label}.anchors.digest",
                                       group=self.group)
        if len(set(digests)) > 1:
            warnings.warn(DIFFERENT_START, stacklevel=3)
            root = 0 if self.group is None else self.group.ranks[0]
            session.run(ops.broadcast_tensors, values, root, name=f"{self.label}.anchors",
                        group=self.group, label=f"{self.label}.anchors")
            access.write(range(len(values)), values)
        self.state.anchors = values
        self.state.momentum = [None] * len(values)
        self.state.momentum_lr = [None] * len(values)
        self._last_time = time.perf_counter()

    def after_inner_step(self, access: ParamAccess, step: Optional[int] = None,
                         inner_lr=None) -> None:
        """After the inner optimizer's step: start the fragments due, apply those that
        land, and (``"auto"``) time the step or choose H.

        Args:
            step: the inner steps done now, for a caller that skips the steps without
                events (:meth:`next_event`); default: one more than before.
            inner_lr: the inner optimizer's learning rate now, one number or one per
                parameter; needed by ``OuterSGD(follow_inner_lr=True)``.
        """
        self._set_inner_lr(inner_lr)
        st = self.state
        st.step = st.step + 1 if step is None else int(step)
        s = self.local_step
        if s == 0 or st.anchors is None:
            return
        for f in self.schedule.syncing(s):
            self._launch(f, access, s)
        due = [f for f, (_, at, _) in self._inflight.items() if at <= s]
        due += [f for f, (at, _, _) in st.landed.items() if at <= s]
        for f in sorted(set(due)):
            self._apply(f, access)
        if st.sync_every is None:
            self._calibrate(s)

    def _set_inner_lr(self, inner_lr) -> None:
        if inner_lr is None:
            self._inner_lr = None
            return
        try:
            lrs = [float(inner_lr)] * len(self.names) if isinstance(inner_lr, (int, float)) \
                else [float(x) for x in inner_lr]
        except (TypeError, ValueError):
            lrs = []
        if len(lrs) != len(self.names) or not all(math.isfinite(x) and x >= 0 for x in lrs):
            raise ValueError(f"inner_lr must be one finite number >= 0 or one per parameter "
                             f"({len(self.names)}), got {inner_lr!r}")
        self._inner_lr = lrs

    def _launch(self, f: int, access: ParamAccess, s: int) -> None:
        if f in self._inflight or f in self.state.landed:
            self._apply(f, access)  # its last exchange lands before the next one starts
        idx = self.schedule.groups[f]
        anchors = self.state.anchors
        deltas = [anchors[i] - v.detach().to(anchors[i].device, torch.float32)
                  for i, v in zip(idx, access.read(idx))]
        red = session.reducer_of(self.group)  # here, not on the engine: see _exchange
        handle = session.submit(self._exchange, red, f, list(idx), deltas, self.state.step,
                                label=f"{self.label}.fragment{f}")
        self._inflight[f] = (handle, s + self.config.delay, list(idx))

    def _exchange(self, red, f: int, idx: list, deltas: list, step: int) -> list:
        """Engine thread: the status exchange every functional collective starts with (the
        ranks agree on fragment, step and shapes; while a rank has called ``join()`` it is
        refused), then the outer gradients averaged through the plan.

        ``red`` comes from the caller's thread: an exchange still queued when the job
        shuts down must not ask the session for it, as shutdown holds the session's lock
        while the engine drains its queue."""
        name = f"{self.label}.fragment{f}"
        tr = red.transport
        if tr.size > 1:
            sig = signature("allreduce", name, fragment=f, step=step,
                            **tensor_fields(deltas)) if red.config.check_consistency else None
            if joining.exchange(tr, joining.OTHER, sig).joined:
                raise CollectiveMismatchError(
                    f"DiLoCo's outer exchange '{name}' cannot run while a rank has called "
                    "join(): every rank takes the same number of inner steps")
        return self.plan.reduce(deltas, name=name, step=step, indices=idx, reducer=red)

    def _take(self, f: int) -> tuple:
        if f in self._inflight:
            handle, at, idx = self._inflight.pop(f)
            return at, idx, handle.wait(session.wait_timeout())
        return self.state.landed.pop(f)

    def _apply(self, f: int, access: ParamAccess) -> None:
        _, idx, outs = self._take(f)
        self._outer_step(idx, outs)
        anchors, mix = self.state.anchors, self.config.mix
        if mix:
            values = [a.mul(1 - mix).add_(v.detach().to(a.device, torch.float32), alpha=mix)
                      for a, v in zip((anchors[i] for i in idx), access.read(idx))]
        else:
            values = [anchors[i] for i in idx]
        access.write(idx, values)

    def _outer_step(self, idx: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
        """The anchors move by the outer optimizer's step on the averaged outer gradient."""
        opt, st = self.config.outer_optimizer, self.state
        for i, d in zip(idx, outs):
            a = st.anchors[i]
            d = d.detach().to(a.device, torch.float32).view_as(a)
            if opt is None:
                a.sub_(d)
                continue
            if opt.momentum:
                buf = st.momentum[i]
                if buf is None:
                    buf = st.momentum[i] = torch.zeros_like(a)
                buf.mul_(opt.momentum * self._momentum_scale(i))
                buf.add_(d)
                d = d.add(buf, alpha=opt.momentum) if opt.nesterov else buf
            a.add_(d, alpha=-opt.lr)

    def _momentum_scale(self, i: int) -> float:
        """``follow_inner_lr``: inner lr now over that of parameter ``i``'s last outer step
        (1 otherwise, and at the first outer step or after a zero rate)."""
        if not self.follows_inner_lr:
            return 1.0
        if self._inner_lr is None:
            raise ValueError("OuterSGD(follow_inner_lr=True) needs the inner learning rate: "
                             "pass inner_lr= to OuterLoop.after_inner_step")
        st, now = self.state, self._inner_lr[i]
        then, st.momentum_lr[i] = st.momentum_lr[i], now
        return 1.0 if not then else now / then

    # -- sync_every="auto" ---------------------------------------------------------------

    def _calibrate(self, s: int) -> None:
        now = time.perf_counter()
        if self._last_time is not None:
            self.state.step_seconds.append(now - self._last_time)
        self._last_time = now
        if s < self.schedule.sync_every:
            return
        from cgx.diloco import auto
        step_s = statistics.median(self.state.step_seconds or [0.0])
        self.choice = auto.choose_for(self, step_s)
        self.config.check_round(self.choice.sync_every)
        self.state.sync_every, self.state.schedule_start = self.choice.sync_every, s

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The loop's state (waits for exchanges in flight and keeps their results)."""
        for f in list(self._inflight):
            self.state.landed[f] = self._take(f)
        st = self.state
        copy = _copied
        return {"format": STATE_FORMAT, "step": st.step, "anchors": copy(st.anchors),
                "momentum": copy(st.momentum), "sync_every": st.sync_every,
                "schedule_start": st.schedule_start,
                "landed": {f: (at, list(idx), copy(outs))
                           for f, (at, idx, outs) in st.landed.items()},
                "step_seconds": list(st.step_seconds), "plan": self.plan.state_dict(),
                "momentum_lr": None if st.momentum_lr is None else list(st.momentum_lr),
                "warmup_plan": None if self.warmup_plan is None
                else self.warmup_plan.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"expected a DiLoCo state of format {STATE_FORMAT} (from "
                             f"state_dict()), got {type(state).__name__}")
        anchors = state["anchors"]
        if anchors is not None and len(anchors) != len(self.names):
            raise ValueError(f"the checkpoint holds {len(anchors)} parameters, this model "
                             f"{len(self.names)}")
        self._inflight.clear()
        lrs = state.get("momentum_lr")  # absent from states saved before it existed
        if lrs is None and anchors is not None:
            lrs = [None] * len(anchors)
        self.state = LoopState(int(state["step"]), _copied(anchors), _copied(state["momentum"]),
                               state["sync_every"], int(state["schedule_start"]),
                               {f: (at, list(idx), _copied(outs))
                                for f, (at, idx, outs) in state["landed"].items()},
                               list(state["step_seconds"]),
                               None if lrs is None else list(lrs))
        self.plan.load_state_dict(state["plan"])
        if self.warmup_plan is not None and state.get("warmup_plan") is not None:
            self.warmup_plan.load_state_dict(state["warmup_plan"])
        self._last_time = None


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    """A digest of the tensors' bytes (equal values, equal digests; 16 bytes of BLAKE2b)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _copied(tensors):
    if tensors is None:
        return None
    return [None if t is None else t.detach().clone() for t in tensors]
