"""torchft's fault-tolerant DDP with cgx's compressed exchange.

torchft (``torchft.Manager``, its lighthouse and ``torchft.ddp.DistributedDataParallel``)
keeps training when a replica group dies: every step the live groups form a quorum, a
group whose collective failed discards that step, and a group that comes back is healed
live from a peer's state. This module is torchft's DDP wrapper with cgx's exchange in
place of ``manager.allreduce``: each DDP bucket is reduced compressed (``Compression.*``,
per layer, with error feedback) over the quorum's process group.

    manager = torchft.manager.Manager(pg=torchft.process_group.ProcessGroupGloo(), min_replica_size=1,
                              load_state_dict=load, state_dict=save, ...)
    model = cgx.integrations.torchft.DistributedDataParallel(
        manager, model, compression=cgx.torch.Compression.quantize(bits=4))
    optimizer = torchft.optim.OptimizerWrapper(manager, optimizer)

What a change of quorum does to cgx's state:

* The exchange runs on a cgx engine over the quorum's group, made again when the
  quorum changes (a different number of groups is a different link) or after a failure.
* A failed exchange is reported to the manager (``manager.report_error``), which then
  discards the step on every group, as its own allreduce does. The error-feedback
  residuals are put back to what they were before that step, so the discarded gradient
  leaves nothing behind.
* The residuals are each group's own: a healed group starts with none. The rest of
  cgx's state (the step, PowerSGD's warm start) travels with the heal, under the
  ``"cgx"`` key of the manager's state dict.
* A group that is not participating (healing) sends zeros, and the sum is divided by
  the number of participants, as torchft's allreduce does.

The compression is a fixed one (``CGX_COMPRESSION=decide``, the default, becomes the
uniform ``CGX_COMPRESSION_*`` quantization): a plan decided on measurements would differ
between a healed group and the others.
"""

import copy
from typing import Optional

import torch
from torch.nn import parallel

from cgx.collectives import Reducer
from cgx.comm.base import ReduceOp
from cgx.compression import fixed
from cgx.config import Config
from cgx.errors import CGXError
from cgx.exchange import ExchangeOptions, GradientPlan
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
        self.iteration = 0
        self.discarded = 0  # steps whose exchange failed (the manager discarded them)
        self._reducer: Optional[Reducer] = None
        self._quorum = None
        self._broken = False  # an exchange failed: its engine is made again at the next step
        self._before_step: Optional[dict] = None  # the residuals when this step began
        manager.register_state_dict_fn("cgx", self.load_shared_state, self.shared_state)

    # -- what a heal carries ---------------------------------------------------------

    def shared_state(self) -> dict:
        """cgx's state a healing group takes from a peer: all but the residuals."""
        state = self.plan.state_dict()
        state["residuals"], state["owed"] = {}, {}
        return {"iteration": self.iteration, "plan": state}

    def load_shared_state(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        self.plan.load_state_dict(state["plan"])  # residuals: none, this group's own

    # -- the engine of this quorum ---------------------------------------------------

    def reducer(self) -> Reducer:
        """The engine over this step's quorum (made again when the quorum changed)."""
        pg = self.manager._pg
        quorum = (getattr(self.manager, "_quorum_id", None), pg.size(), pg.rank())
        if self._reducer is None or quorum != self._quorum or self._broken:
            self.close()
            self._reducer = Reducer(TorchftTransport(pg, quorum_id=quorum[0]), self.config)
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

    def failed(self, exc: BaseException) -> None:
        """An exchange failed: the manager discards the step; the residuals go back."""
        if self._before_step is not None:
            self.plan.residuals.load_state_dict(self._before_step)
        self.discarded += 1
        self._broken = True  # closed and made again by the next step's thread, not this one
        self.manager.report_error(exc if isinstance(exc, Exception) else CGXError(str(exc)))


def torchft_hook(state: TorchftState, bucket) -> torch.futures.Future[torch.Tensor]:
    # (no `from __future__ import annotations` here: DDP checks this annotation's value)
    """DDP communication hook: the bucket averaged over the quorum's participants."""
    manager = state.manager
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    if manager.errored() is not None:  # the step is lost already: as torchft, no-op
        fut.set_result(bucket.buffer())
        return fut
    manager.wait_quorum()
    participants = manager.num_participants()
    if not manager.is_participating():
        bucket.buffer().zero_()
    step = state.iteration
    if bucket.index() == 0 or state._before_step is None:
        state._before_step = copy.deepcopy(state.plan.residuals.state_dict(with_owed=True))
    if bucket.is_last():
        state.iteration += 1
    try:
        red = state.reducer()
    except Exception as exc:  # noqa: BLE001 - the quorum's group is not usable
        state.failed(exc)
        fut.set_result(bucket.buffer())
        return fut
    red.engine().submit(_reduce, (state, red, bucket, fut, step, participants),
                        label=f"torchft.bucket{bucket.index()}")
    return fut


def _reduce(state: TorchftState, red: Reducer, bucket, fut, step: int,
            participants: int) -> None:
    try:
        pairs = sorted(zip((state.index[id(p)] for p in bucket.parameters()),
                           bucket.gradients()), key=lambda pair: pair[0])
        indices = [i for i, _ in pairs]
        grads = [g.view(state.plan.shapes[i]) for i, g in pairs]
        outs = state.plan.reduce(list(grads), name=f"torchft.bucket{bucket.index()}",
                                 step=step, indices=indices, reducer=red)
        for o in outs:
            o.div_(max(1, participants))
        copy_back(grads, outs)
    except BaseException as exc:  # noqa: BLE001 - reported to torchft, which skips the step
        state.failed(exc)
    finally:
        fut.set_result(bucket.buffer())


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
