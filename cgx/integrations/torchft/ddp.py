"""torchft's fault-tolerant DDP with cgx's compressed exchange.

torchft (``torchft.Manager``, its lighthouse and ``torchft.ddp.DistributedDataParallel``)
keeps training when a replica group dies: every step the live groups form a quorum, a
group whose collective failed discards that step, and a group that comes back is healed
live from a peer's state. This module is torchft's DDP wrapper with cgx's exchange in
place of ``manager.allreduce``: each DDP bucket is reduced compressed (``Compression.*``,
per layer, with error feedback) over the quorum's process group.

    manager = torchft.manager.Manager(pg=torchft.process_group.ProcessGroupGloo(),
                                      min_replica_size=1, load_state_dict=load,
                                      state_dict=save, ...)
    model = cgx.integrations.torchft.DistributedDataParallel(
        manager, model, compression=cgx.torch.Compression.quantize(bits=4))
    optimizer = torchft.optim.OptimizerWrapper(manager, optimizer)

What a change of quorum does to cgx's state:

* The exchange runs on a cgx engine over the quorum's group, made again when the
  quorum changes (a different number of groups is a different link) or after a failure.
  The step that keys stochastic rounding is the manager's, the same on every group.
* A failed exchange is reported to the manager (``manager.report_error``), which then
  discards the step on every group, as its own allreduce does; the step's later buckets
  send nothing. Whenever the manager discards a step (this group's failure, another's,
  too few replicas), the next step first puts cgx's state back to what it was before
  it (residuals, PowerSGD's factors and counters), so the discarded gradient leaves
  nothing behind.
* The residuals are each group's own: a healed group starts with none. The rest of
  cgx's state (PowerSGD's warm start, its counters) travels with the heal, under the
  ``"cgx"`` key of the manager's state dict, and is applied before the healing group's
  first exchange.
* A group that is not participating (healing) sends zeros, and the sum is divided by
  the number of participants, as torchft's allreduce does.
* A program error (a wrong argument, a cgx error that is not a failed collective) is
  raised in backward, as DDP's own hook would.

The compression is a fixed one (``CGX_COMPRESSION=decide``, the default, becomes the
uniform ``CGX_COMPRESSION_*`` quantization): a plan decided on measurements would differ
between a healed group and the others.
"""

import copy
import dataclasses
from typing import Optional

import torch
from torch.nn import parallel

from cgx.collectives import Reducer
from cgx.comm.base import ReduceOp
from cgx.compression import fixed
from cgx.config import Config
from cgx.errors import CGXError, CommunicationError
from cgx.exchange import ExchangeOptions, GradientPlan
from cgx.exchange.per_rank import with_per_rank, without_per_rank
from cgx.integrations.torchft.transport import TorchftTransport
from cgx.policy import GradMode
from cgx.policy import resolve as resolve_policy
from cgx.torch.bucket_exchange import copy_back

__all__ = ["DistributedDataParallel", "TorchftState"]


class TorchftState:
    """The exchange's state for one torchft replica group.

    Args:
        manager: the group's ``torchft.Manager``.
        model: the module, for parameter names and shapes.
        compression: a fixed ``Compression`` (default: the ``CGX_*`` settings).
        config: settings (default: ``Config.from_env()``).
        rules: per-layer rules (``cgx.rules``).

    Attributes:
        discarded: steps this group's exchange failed in (the manager discarded them).
        undone: steps discarded by the manager, for whatever reason, whose changes to
            cgx's state were undone.
    """

    def __init__(self, manager, model: torch.nn.Module, compression=None,
                 config: Optional[Config] = None, rules=None) -> None:
        ExchangeOptions.checked("torchft DistributedDataParallel", rules=rules)
        self.manager = manager
        self.config = config or Config.from_env()
        policy = resolve_policy(fixed(compression, self.config), self.config)
        if policy.mode in (GradMode.AUTO, GradMode.PLANNED):
            raise ValueError(
                "cgx on torchft takes a fixed compression (e.g. Compression.quantize(bits=4)):"
                " a plan decided on measurements would differ between a healed replica "
                "group and the others")
        named = list(model.named_parameters())
        self.plan = GradientPlan([n for n, _ in named], [tuple(p.shape) for _, p in named],
                                 policy, op=ReduceOp.SUM, rules=rules, config=self.config)
        self.index = {id(p): i for i, (_, p) in enumerate(named)}
        self.discarded = 0
        self.undone = 0
        self._reducer: Optional[Reducer] = None
        self._quorum = None
        self._broken = False  # an exchange failed: its engine is made again at the next step
        self._step: Optional[_Step] = None  # the step whose buckets are being reduced
        self._snapshot: Optional[tuple] = None  # (manager step, cgx's state) at its start
        self._loaded_early = None  # the heal's state applied before the step (its id)
        manager.register_state_dict_fn("cgx", self.load_shared_state, self.shared_state)

    # -- what a heal carries ---------------------------------------------------------

    def shared_state(self) -> dict:
        """cgx's state a healing group takes from a peer: all but the residuals (the
        plan's and a compressor's own, such as PowerSGD's)."""
        return {"plan": without_per_rank(self.plan.state_dict())}

    def load_shared_state(self, state: dict) -> None:
        if self._loaded_early is not None and self._loaded_early == id(state):
            self._loaded_early = None  # applied before this step's exchange already
            return
        self.plan.load_state_dict(with_per_rank(state["plan"], self.plan.state_dict()))

    def _heal_before_the_exchange(self) -> None:
        """torchft's asynchronous quorum applies a heal's state after the step; the peer
        sent cgx's state from before it, so a healing group takes it before its exchange
        (the step's collectives then change it on both alike)."""
        if not getattr(self.manager, "_healing", False):
            return
        pending = getattr(self.manager, "_pending_state_dict", None) or {}
        shared = pending.get("user", {}).get("cgx") if isinstance(pending, dict) else None
        if shared is not None and self._loaded_early != id(shared):
            self._loaded_early = None
            self.load_shared_state(shared)
            self._loaded_early = id(shared)

    # -- one step --------------------------------------------------------------------

    def begin_step(self) -> Optional["_Step"]:
        """At the step's first bucket (DDP launches bucket 0 first): the quorum, the heal,
        undoing a discarded step, the engine. None: the step is lost already."""
        manager = self.manager
        if manager.errored() is not None:
            return None
        manager.wait_quorum()
        self._heal_before_the_exchange()
        now = manager.current_step()
        if self._snapshot is not None and self._snapshot[0] == now:
            # the step that began at `now` did not commit: what it changed is undone
            self.plan.load_state_dict(self._snapshot[1])
            self.undone += 1
        self._snapshot = (now, copy.deepcopy(self.plan.state_dict()))
        try:
            red = self.reducer()
        except Exception as exc:  # noqa: BLE001 - this quorum's group is not usable
            step = _Step(now, None, 0, False)
            self.failed(step, exc)
            return step
        return _Step(now, red, manager.num_participants(), manager.is_participating())

    def failed(self, step: "_Step", exc: BaseException) -> None:
        """The step's exchange failed: the manager discards it on every group (and the
        next step undoes what it changed); its later buckets send nothing."""
        if step.failed:
            return
        step.failed = True
        self.discarded += 1
        self.manager.report_error(exc if isinstance(exc, Exception) else CGXError(str(exc)))
        self._broken = True  # closed and made again at the next step, by its thread

    # -- the engine of this quorum ---------------------------------------------------

    def reducer(self) -> Reducer:
        """The engine over this step's quorum (made again when the quorum changed)."""
        pg = self.manager._pg
        quorum = (getattr(self.manager, "_quorum_id", None), pg.size(), pg.rank())
        if self._reducer is None or quorum != self._quorum or self._broken:
            self.close()
            # torchft's group times its collectives out; cgx's watchdog stays out of it
            config = dataclasses.replace(self.config, timeout_s=WATCHDOG_OFF_S)
            self._reducer = Reducer(TorchftTransport(pg, quorum_id=quorum[0]), config)
            self._quorum, self._broken = quorum, False
        return self._reducer

    def close(self) -> None:
        if self._reducer is not None:
            self._reducer.close()
        self._reducer = None

    def stats(self):
        """What this quorum's exchanges cost so far (``cgx.collectives.ReduceStats``)."""
        from cgx.collectives import ReduceStats
        return self._reducer.snapshot() if self._reducer is not None else ReduceStats()


WATCHDOG_OFF_S = 7 * 24 * 3600.0


class _Step:
    """One step's exchange, shared by its buckets."""

    def __init__(self, step: int, reducer: Optional[Reducer], participants: int,
                 participating: bool) -> None:
        self.step, self.reducer = step, reducer
        self.participants, self.participating = participants, participating
        self.failed = False


def torchft_hook(state: TorchftState, bucket) -> torch.futures.Future[torch.Tensor]:
    # (no `from __future__ import annotations` here: DDP checks this annotation's value)
    """DDP communication hook: the bucket averaged over the quorum's participants."""
    if bucket.index() == 0 or state._step is None:
        state._step = state.begin_step()
    step = state._step
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if step is None or step.failed or state.manager.errored() is not None:
        fut.set_result(bucket.buffer())  # the step is lost: as torchft's allreduce, a no-op
        return fut
    if not step.participating:
        bucket.buffer().zero_()
    try:
        step.reducer.engine().submit(_reduce, (state, step, bucket, fut),
                                     label=f"torchft.bucket{bucket.index()}")
    except Exception as exc:  # noqa: BLE001 - the engine refused: an earlier failure
        state.failed(step, exc)
        fut.set_result(bucket.buffer())
    return fut.then(_bucket_or_raise)


def _reduce(state: TorchftState, step: _Step, bucket, fut) -> None:
    try:
        if step.failed or state.manager.errored() is not None:
            return  # a bucket before it failed: send nothing more this step
        pairs = sorted(zip((state.index[id(p)] for p in bucket.parameters()),
                           bucket.gradients()), key=lambda pair: pair[0])
        indices = [i for i, _ in pairs]
        grads = [g.view(state.plan.shapes[i]) for i, g in pairs]
        # A healing group sends zeros and keeps its (empty) residuals: shadow.
        outs = state.plan.reduce(list(grads), name=f"torchft.bucket{bucket.index()}",
                                 step=step.step, indices=indices, reducer=step.reducer,
                                 shadow=not step.participating)
        for o in outs:
            o.div_(max(1, step.participants))
        copy_back(grads, outs)
    except Exception as exc:  # noqa: BLE001 - sorted below
        if not _is_failure(exc):
            fut.set_exception(exc)  # the program's error: raised in backward
            return
        state.failed(step, exc)  # reported to torchft, which discards the step
    finally:
        if not fut.done():
            fut.set_result(bucket.buffer())


def _is_failure(exc: BaseException) -> bool:
    """A collective that failed (Gloo's and the transport's RuntimeError, cgx's
    CommunicationError), as opposed to a program error (cgx's other errors included)."""
    return isinstance(exc, CommunicationError) or (
        isinstance(exc, RuntimeError) and not isinstance(exc, CGXError))


def _bucket_or_raise(fut: torch.futures.Future) -> torch.Tensor:
    return fut.wait()


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torchft's ``DistributedDataParallel`` with cgx's compressed exchange.

    As torchft's: DDP runs on a dummy one-rank group (its own start-up broadcast is
    soaked up; torchft's manager syncs the weights at step 0) with
    ``find_unused_parameters=True``, so that DDP never rebuilds its buckets and a healed
    group's buckets match the others'. The exchange is cgx's (:class:`TorchftState`,
    reachable as ``.cgx_state``).

    Args:
        manager: the replica group's ``torchft.Manager``.
        module: the model.
        compression, config, rules: see :class:`TorchftState`.
        kwargs: DDP's other arguments.
    """

    def __init__(self, manager, module: torch.nn.Module, compression=None,
                 config: Optional[Config] = None, rules=None, **kwargs) -> None:
        from torchft.process_group import ProcessGroupDummy
        state = TorchftState(manager, module, compression, config, rules)
        super().__init__(module, process_group=ProcessGroupDummy(0, 1),
                         find_unused_parameters=True, **kwargs)
        self.cgx_state = state
        self.register_comm_hook(state, torchft_hook)
