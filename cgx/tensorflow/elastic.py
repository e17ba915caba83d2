"""``hvd.elastic`` for TensorFlow and Keras: training that survives lost ranks and takes
in new ones.

Horovod's API (``@hvd.elastic.run``, ``TensorFlowKerasState``, ``TensorFlowState``,
``ObjectState``, ``state.commit()``) on :mod:`cgx.elastic`, as ``cgx.torch.elastic`` is
for PyTorch. Start the job with ``cgxrun -np N --min-np M [--max-np K]
[--host-discovery-script S]`` (docs/guides/elastic.md). Keras users import
``cgx.tensorflow.keras`` as ``hvd``, whose ``hvd.elastic`` adds ``KerasState`` and the
commit and progress callbacks.

A failed collective inside a graph (``model.fit``, a ``tf.function``) reaches Python as
TensorFlow's own error (``UnknownError``); :func:`run` finds the
:class:`~cgx.errors.CommunicationError` behind it (:mod:`cgx.tensorflow.failures`), rolls
back and forms a new world, and raises every other error.

What a change of world does to cgx's own state (a Keras ``DistributedOptimizer``): as in
``cgx.torch.elastic``, each rank keeps its own error-feedback residuals (kept at each
commit, not Keras variables), a new rank starts with none, what a lost rank owed at the
last commit is counted in ``state.dropped_owed``, and ``compression="auto"`` decides
again. The model's train, test and predict functions are traced again on the new world.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import tensorflow as tf

from cgx import runtime, session
from cgx.elastic import HostsUpdatedInterrupt, run_fn
from cgx.elastic.state import ObjectState, State
from cgx.exchange.per_rank import with_per_rank, without_per_rank
from cgx.tensorflow import failures
from cgx.tensorflow.ops import broadcast_object, broadcast_variables
from cgx.tensorflow.variables import (distributed_inside, shared_model_variables,
                                      shared_optimizer_variables)

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "State", "TensorFlowKerasState",
           "TensorFlowState", "run"]


def run(func):
    """Horovod's ``@hvd.elastic.run``: call ``func(state, ...)`` until it returns; after a
    failed collective roll back to the last commit, and after any change of world sync
    the state from the senior rank (:mod:`cgx.elastic.run`)."""

    @functools.wraps(func)
    def failures_named(state, *args, **kwargs):
        failures.clear()
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as e:
            failure = failures.failure_behind(e)
            if failure is None:
                raise
            raise failure from e

    return run_fn(failures_named, session.reinit, runtime.rank, runtime.size)


def _copies(variables) -> list:
    """Host copies of the variables' values (a CPU tensor's numpy() may share its buffer)."""
    return [np.copy(v.numpy()) for v in variables]


def _assign(variables, values) -> None:
    for var, value in zip(variables, values):
        var.assign(value)


class TensorFlowKerasState(ObjectState):
    """Horovod's ``TensorFlowKerasState``: a built Keras model, its optimizer (the
    compiled one by default) and plain values, kept across changes of world.

    Args:
        model: a built Keras 3 model (``model.build(input_shape)`` or one call).
        optimizer: default ``model.optimizer``; built here if it is not yet.
        backend: accepted for Horovod's signature (Keras 3 has no sessions).
        kwargs: plain values, then attributes (``epoch=0, batch=0``).

    Every rank's copy of the model's variables and the optimizer's is synced from the
    senior rank, and so is a ``DistributedOptimizer``'s exchange state (its steps,
    PowerSGD's warm start), but the per-rank parts: the RNG state of dropout layers, and
    a ``DistributedOptimizer``'s gradient accumulators (``backward_passes_per_step``) and
    its error-feedback residuals.
    """

    def __init__(self, model, optimizer=None, backend=None, **kwargs) -> None:
        if not getattr(model, "built", True):
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        if self.optimizer is not None and not self.optimizer.built and \
                model.trainable_variables:
            # Keras builds it at the first batch; a rank that joins must hold the same
            # variables as the others when they are synced.
            self.optimizer.build(model.trainable_variables)
        self._cgx = distributed_inside(self.optimizer)
        self._save_model()
        super().__init__(**kwargs)

    def _optimizer_variables(self) -> list:
        return list(self.optimizer.variables) if self.optimizer is not None else []

    def _save_model(self) -> None:
        self._saved_model = _copies(self.model.variables)
        self._saved_optimizer = _copies(self._optimizer_variables())
        self._saved_exchange = copy.deepcopy(self._cgx.exchange_state()) \
            if self._cgx is not None else None

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        if self._cgx is not None:
            self._cgx.discard_step()  # its collectives failed
            self._cgx.load_exchange_state(copy.deepcopy(self._saved_exchange))
        _assign(self.model.variables, self._saved_model)
        _assign(self._optimizer_variables(), self._saved_optimizer)
        super().restore()

    def sync_from(self, root: int) -> None:
        local = getattr(self._cgx, "_local_vars", frozenset())  # register_local_var's
        variables = shared_model_variables(self.model, local)
        if self.optimizer is not None:
            variables += shared_optimizer_variables(self.optimizer, pending=True)
        broadcast_variables(variables, root)
        if self._cgx is not None:
            # The exchange's shared state (steps, PowerSGD's warm start) is the root's, as
            # every rank must hold alike; the residuals stay each rank's own.
            own = self._cgx.exchange_state()
            shared = broadcast_object(without_per_rank(own), root_rank=root)
            self._cgx.load_exchange_state(with_per_rank(shared, own))
        super().sync_from(root)

    def owed(self) -> float:
        return self._cgx.owed_residual() if self._cgx is not None else 0.0

    def on_reset(self) -> None:
        if self._cgx is not None:
            self._cgx.world_changed()
        for fn in ("train_function", "test_function", "predict_function"):
            if hasattr(self.model, fn):  # traced on the old world: trace again
                setattr(self.model, fn, None)
        super().on_reset()


class TensorFlowState(ObjectState):
    """Horovod's ``TensorFlowState``: a list of ``tf.Variable`` (and plain values).

    Args:
        variables: the variables to keep; in a ``tf.compat.v1`` graph, default all
            global variables.
        session: in a ``tf.compat.v1`` graph, the session that holds their values
            (default: the default session).
        kwargs: plain values, then attributes.
    """

    def __init__(self, variables=None, session=None, **kwargs) -> None:
        eager = tf.executing_eagerly()
        if variables is None and eager:
            raise ValueError("TensorFlowState(variables=...) needs the variables when "
                             "executing eagerly (e.g. model.variables)")
        self.variables = list(variables if variables is not None
                              else tf.compat.v1.global_variables())
        self.session = None if eager else (session or tf.compat.v1.get_default_session())
        if not eager and self.session is None:
            raise ValueError("TensorFlowState in a tf.compat.v1 graph needs a session: pass "
                             "session=, or create it inside `with sess.as_default():`")
        self._bcast_ops: dict = {}  # (root, world size) -> its broadcast op, made once
        self._save_values()
        super().__init__(**kwargs)

    def _save_values(self) -> None:
        self._values = self.session.run(self.variables) if self.session is not None else \
            _copies(self.variables)

    def save(self) -> None:
        self._save_values()
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.variables, self._values):
            if self.session is not None:
                var.load(value, self.session)
            else:
                var.assign(value)
        super().restore()

    def sync_from(self, root: int) -> None:
        if self.session is None:
            broadcast_variables(self.variables, root)
        else:  # one op per root and world (a graph op keeps the world it was built in)
            key = (root, runtime.size())
            if key not in self._bcast_ops:
                with self.session.graph.as_default():
                    self._bcast_ops[key] = broadcast_variables(self.variables, root)
            try:
                self.session.run(self._bcast_ops[key])
            except tf.errors.OpError as e:  # a failed broadcast: the run loop's to handle
                failure = failures.failure_behind(e)
                if failure is None:
                    raise
                raise failure from e
        super().sync_from(root)
