"""``hvd.elastic`` for PyTorch: training that survives lost ranks and takes in new ones.

Horovod's API (``@hvd.elastic.run``, ``TorchState``, ``ObjectState``, ``ElasticSampler``,
``state.commit()``), on :mod:`cgx.elastic`. Start the job with ``cgxrun -np N --min-np M
[--max-np K] [--host-discovery-script S]`` (docs/elastic.md)::

    import cgx.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch): ...
                state.sampler.record_batch(state.batch, batch_size)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

What a change of world does to cgx's own state (:class:`OptimizerStateHandler`): each
rank keeps its own error-feedback residuals (rolled back to the commit with the rest of
the optimizer's state); a new rank starts with none; what a lost rank owed at the last
commit is dropped, and counted (``state.dropped_owed``, a line on rank 0's stderr); the exchange's layout is rebuilt for the new world, and ``compression="auto"``
measures and decides again, since a different number of ranks is a different link.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Optional

import torch

from cgx import runtime, session
from cgx.elastic import HostsUpdatedInterrupt, run_fn
from cgx.elastic.state import ObjectState, State
from cgx.torch.optimizer import DistributedOptimizer
from cgx.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                 broadcast_parameters)

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler"]


def run(func):
    """Horovod's ``@hvd.elastic.run``: call ``func(state, ...)`` until it returns; after a
    failed collective roll back to the last commit, and after any change of world sync
    the state from the senior rank (:mod:`cgx.elastic.run`)."""
    return run_fn(func, session.reinit, runtime.rank, runtime.size)


# -- what TorchState does for each kind of value ---------------------------------------------

class StateHandler:
    """One tracked value: copy it at commit, put the copy back, send it from the root."""

    def __init__(self, value) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root: int) -> None:
        raise NotImplementedError

    def world_changed(self) -> None:
        """After a change of world, before the sync (no collectives)."""


class ModelStateHandler(StateHandler):
    def save(self) -> None:
        self._saved = {k: v.detach().clone() for k, v in self.value.state_dict().items()}

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def sync(self, root: int) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=root)


class OptimizerStateHandler(StateHandler):
    """A torch optimizer or cgx's ``DistributedOptimizer`` (whose per-rank state, the
    error-feedback residuals, stays each rank's own through the sync)."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        if isinstance(self.value, DistributedOptimizer):
            self.value.discard_step()  # its collectives failed
        self.value.load_state_dict(copy.deepcopy(self._saved))  # the copy stays the commit

    def sync(self, root: int) -> None:
        broadcast_optimizer_state(self.value, root_rank=root)

    def world_changed(self) -> None:
        if isinstance(self.value, DistributedOptimizer):
            self.value.world_changed()

    def owed(self) -> float:
        return self.value.owed_residual() if isinstance(self.value, DistributedOptimizer) \
            else 0.0


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: at a sync, the samples any rank has processed this
    epoch are processed for all."""

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self, root: int) -> None:
        sd = self.value.state_dict()
        if runtime.size() > 1:
            sd["processed_indices"] = set().union(*allgather_object(sd["processed_indices"]))
        self.value.load_state_dict(broadcast_object(sd, root_rank=root))


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState``: a model, an optimizer, samplers and plain
    values, kept across changes of world. Keyword arguments that are modules, optimizers
    or :class:`ElasticSampler` get their handler; the rest are plain values.

    ``dropped_owed`` (see :class:`cgx.elastic.State`) is here the sum of absolute values
    of the error-feedback residuals, in gradient units, that lost ranks owed at their
    last commit; rank 0 prints it when a rank is lost.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer=None, **kwargs):
        kwargs.update({k: v for k, v in (("model", model), ("optimizer", optimizer))
                       if v is not None})
        handlers = {k: _handler(v) for k, v in kwargs.items()}
        self._handlers = {k: h for k, h in handlers.items() if h is not None}
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._handlers})
        for name, h in self._handlers.items():
            setattr(self, name, h.value)

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and handlers[name].value is not value:  # its handler follows
            handlers[name] = _handler(value)
        super().__setattr__(name, value)

    def save(self) -> None:
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self) -> None:
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def owed(self) -> float:
        return float(sum(h.owed() for h in self._handlers.values()
                         if isinstance(h, OptimizerStateHandler)))

    def sync_from(self, root: int) -> None:
        # Optimizers first: a rank with no optimizer state yet takes a zero-gradient step
        # to make it (Horovod's way), which weight decay would leave in its parameters.
        handlers = sorted(self._handlers.items(),
                          key=lambda kv: not isinstance(kv[1], OptimizerStateHandler))
        for _, h in handlers:
            h.sync(root)
        super().sync_from(root)

    def on_reset(self) -> None:
        for h in self._handlers.values():
            h.world_changed()
        super().on_reset()


def _handler(value) -> Optional[StateHandler]:
    if isinstance(value, ElasticSampler):
        return SamplerStateHandler(value)
    if isinstance(value, torch.optim.Optimizer):
        return OptimizerStateHandler(value)
    if isinstance(value, torch.nn.Module):
        return ModelStateHandler(value)
    return None


# -- the sampler ---------------------------------------------------------------------------

class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``hvd.elastic.ElasticSampler``: shards what is left of the epoch over the
    current world; samples recorded as processed (:meth:`record_batch`) are not given
    out again after a change of world.

    Args:
        dataset: anything with ``len()``.
        shuffle: a new order each epoch (seeded by ``seed + epoch``, the same on every rank).
        seed: the shuffle's seed.
    """

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set = set()
        self.indices: list = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch ``batch_idx`` (of this rank's order) is processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices) -> None:
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list:
        start = batch_idx * batch_size
        return self.indices[start:min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Shard the samples not yet processed over the current world."""
        up = runtime.is_initialized()
        self.num_replicas, self.rank = (runtime.size(), runtime.rank()) if up else (1, 0)
        self.remaining_indices = [i for i in range(len(self.dataset))
                                  if i not in self.processed_indices]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        order = list(self.remaining_indices)
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        if order:
            while len(order) < self.total_size:  # every rank gets as many samples
                order += order[:self.total_size - len(order)]
        self.indices = order[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

