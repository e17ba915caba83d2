"""Keras callbacks of ``horovod.tensorflow.keras.callbacks``, for Keras 3.

* :class:`BroadcastGlobalVariablesCallback`: every rank starts from the root's
  weights and optimizer state.
* :class:`MetricAverageCallback`: epoch metrics averaged over ranks (put it
  before callbacks that read metrics: checkpoints, early stopping, LR plateaus).
* :class:`LearningRateScheduleCallback`, :class:`LearningRateWarmupCallback`:
  Horovod's schedules (``lr = initial_lr * multiplier(epoch)``), including the
  gradual warmup of Goyal et al. (2017) from ``initial_lr / size`` to ``initial_lr``.
* :class:`BestModelCheckpoint`: keeps the best model, written by rank 0 only.

Momentum correction. When the learning rate changes from ``a`` to ``b``,
Horovod scales the optimizer's momentum coefficient by ``b / a`` for one
batch. A Keras 3 optimizer's momentum is a Python float baked into the
compiled train step, so changing it between batches would do nothing; the
velocity buffers, however, are variables. Keras' SGD and RMSprop keep the
learning rate inside their velocity (``v = m * v - lr * g``), so multiplying
the velocity by ``b / a`` once gives exactly the update Horovod's correction
gives. Optimizers without such buffers (Adam, ...) need no correction.
"""

from __future__ import annotations

import numbers

import keras
import numpy as np
import tensorflow as tf

from cgx import runtime
from cgx.tensorflow.ops import allgather_object, allreduce, broadcast_variables
from cgx.tensorflow.variables import shared_model_variables, shared_optimizer_variables



def _check_int(value, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
    return int(value)


def _innermost(optimizer):
    while getattr(optimizer, "inner_optimizer", None) is not None:
        optimizer = optimizer.inner_optimizer
    return optimizer


def _is_variable(v) -> bool:
    import tensorflow as tf
    return isinstance(v, (tf.Variable, keras.Variable))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's variables and the optimizer's state from ``root_rank``.

    Runs when training starts: the optimizer is built first if the model is
    (Keras 3 would build it at the first batch). Only for a model that is not
    built before ``fit`` does it run after the first batch, as Horovod does.
    Per-rank state (gradient accumulators) is not broadcast.

    Args:
        root_rank: the rank whose values every rank takes.
        device: accepted for compatibility, ignored.
        local_variables: variables (or one) that stay per rank, e.g. of model-parallel
            layers: not broadcast (Horovod's argument).
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = _check_int(root_rank, "root_rank", 0)
        self.broadcast_done = False
        self._local_vars: set = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        elif not all(_is_variable(v) for v in local_variables):
            raise ValueError("All local variables must be of tf.Variable type.")
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var) -> None:
        """Leave ``var`` out of the broadcast (it differs per rank on purpose)."""
        self._local_vars.add(id(var))

    def _broadcast(self) -> None:
        variables = shared_model_variables(self.model, self._local_vars)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            # Gradient accumulators hold this rank's own partial sums: never copied.
            variables += shared_optimizer_variables(optimizer)
        broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built and self.model.built and \
                self.model.trainable_variables:
            # Keras 3 (without a tf.distribute strategy) builds the optimizer at the
            # first batch; build it now so its state is broadcast before training.
            optimizer.build(self.model.trainable_variables)
        if optimizer is None or optimizer.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


class StatsCallback(keras.callbacks.Callback):
    """Adds cgx's communication statistics of each epoch to the epoch's ``logs``.

    So ``History`` and a ``keras.callbacks.TensorBoard`` placed *after* it in the
    callbacks list record them: ``cgx_bytes_sent``, ``cgx_bytes_sent_per_step``,
    ``cgx_compression_ratio``, ``cgx_exposed_comm_s_per_step``, ``cgx_seconds_<phase>``,
    and with ``layer_errors=True`` ``cgx_layer_error_<layer>``.

    Args:
        layer_errors: also log each layer's relative compression error.
    """

    def __init__(self, layer_errors: bool = False):
        super().__init__()
        self.layer_errors = bool(layer_errors)
        self._last = None

    def on_train_begin(self, logs=None):
        from cgx import session
        self._last = session.stats()

    def on_epoch_end(self, epoch, logs=None):
        from cgx import session
        from cgx.stats import scalars
        now = session.stats()
        values = scalars(now, since=self._last)
        self._last = now
        if logs is None:
            return
        for name, value in values.items():
            if name.startswith("cgx/layer_error/") and not self.layer_errors:
                continue
            logs[name.replace("/", "_")] = value


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each numeric epoch metric in ``logs`` by its average over ranks.

    One exact allreduce per epoch (plus a check that every rank reports the
    same metric names, which would otherwise pair up the wrong values).

    Args:
        device: accepted for compatibility, ignored.
    """

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if not logs or runtime.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _is_scalar(v))
        everyone = allgather_object(keys, name="MetricAverageCallback.keys")
        if any(other != keys for other in everyone):
            raise ValueError(f"MetricAverageCallback: ranks report different metrics "
                             f"({everyone}); every rank must compile the same metrics and "
                             "run validation alike")
        if not keys:
            return
        values = tf.constant([float(np.asarray(logs[k])) for k in keys], dtype=tf.float64)
        averaged = allreduce(values, name="MetricAverageCallback").numpy()
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


def _is_scalar(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Real):
        return True
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - not array-like: leave it alone
        return False
    return arr.ndim == 0 and np.issubdtype(arr.dtype, np.number)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set ``lr = initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    Args:
        initial_lr: the learning rate the multiplier scales (usually the
            scaled one, e.g. ``0.01 * hvd.size()``).
        multiplier: a constant (the lr is ``initial_lr * multiplier`` in the
            range, set at each epoch start) or a function of the epoch
            (fractional with ``staircase=False``).
        start_epoch: first epoch of the range.
        end_epoch: first epoch after it (None: to the end).
        staircase: adjust at each epoch start (True) or at every batch.
        momentum_correction: rescale momentum buffers when the lr changes
            (see the module docstring).
        steps_per_epoch: batches per epoch (staircase=False only; default:
            from Keras' ``params['steps']``).

    Example::

        LearningRateScheduleCallback(initial_lr=0.1 * hvd.size(), multiplier=0.1,
                                     start_epoch=30, end_epoch=60)
    """

    def __init__(self, initial_lr, multiplier, start_epoch: int = 0, end_epoch=None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch=None):
        super().__init__()
        if isinstance(initial_lr, bool) or not isinstance(initial_lr, numbers.Real) \
                or not initial_lr > 0:
            raise ValueError(f"initial_lr must be a number > 0 (the learning rate the "
                             f"multiplier scales), got {initial_lr!r}")
        self.start_epoch = _check_int(start_epoch, "start_epoch", 0)
        if end_epoch is not None:
            _check_int(end_epoch, "end_epoch", self.start_epoch + 1)
        if steps_per_epoch is not None:
            _check_int(steps_per_epoch, "steps_per_epoch", 1)
        if callable(multiplier):
            self._multiplier = multiplier
        elif isinstance(multiplier, numbers.Real) and not isinstance(multiplier, bool):
            self._constant = float(multiplier)
            self._multiplier = self._constant_multiplier
            staircase = True
        else:
            raise TypeError(f"multiplier must be a number or a function of the epoch, got "
                            f"{multiplier!r}")
        self.initial_lr = float(initial_lr)
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None

    def _constant_multiplier(self, epoch):
        return self._constant

    def multiplier(self, epoch) -> float:
        return self._multiplier(epoch)

    def _autodetect_steps_per_epoch(self) -> int:
        steps = (self.params or {}).get("steps")
        if steps:
            return int(steps)
        raise ValueError(f"{type(self).__name__} could not tell the number of batches per epoch "
                         "(Keras gives none for this dataset); pass steps_per_epoch=")

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = float(np.asarray(keras.ops.convert_to_numpy(optimizer.learning_rate)))
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        if self.momentum_correction and old_lr > 0 and new_lr != old_lr:
            _scale_velocity(optimizer, new_lr / old_lr)

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        epoch = self.current_epoch
        if epoch is None or epoch < self.start_epoch or (
                self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(np.asarray(keras.ops.convert_to_numpy(
                self.model.optimizer.learning_rate)))


def _scale_velocity(optimizer, factor: float) -> None:
    inner = _innermost(optimizer)
    momentum = getattr(inner, "momentum", 0.0)
    if not isinstance(momentum, numbers.Real) or momentum <= 0:
        return
    buffers = getattr(inner, "momentums", None) or getattr(inner, "_momentums", None) or []
    for buf in buffers:
        if buf is not None:
            buf.assign(buf * factor)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warmup: from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs``.

    The lr grows linearly per batch; at the end of epoch ``warmup_epochs - 1``
    it is ``initial_lr``.

    Args:
        initial_lr: the learning rate after warmup (usually ``base_lr * hvd.size()``).
        warmup_epochs: epochs of warmup.
        momentum_correction: see :class:`LearningRateScheduleCallback`.
        steps_per_epoch: batches per epoch (default: from Keras).
        verbose: 1 prints a line (rank 0) when the warmup ends.
    """

    def __init__(self, initial_lr, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch=None, verbose: int = 0):
        self.warmup_epochs = _check_int(warmup_epochs, "warmup_epochs", 1)
        super().__init__(initial_lr, self._warmup, start_epoch=0, end_epoch=self.warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def _warmup(self, epoch: float) -> float:
        # Shifted by one batch so that each epoch ends on a round value.
        epoch += 1.0 / self.steps_per_epoch
        size = runtime.size()
        return 1.0 / size * (epoch * (size - 1) / self.warmup_epochs + 1)

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and runtime.rank() == 0:
            lr = float(np.asarray(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the best model so far (by ``monitor``) to ``filepath``, on rank 0 only.

    ``keras.callbacks.ModelCheckpoint(save_best_only=True)`` that only rank 0
    runs. Put :class:`MetricAverageCallback` before it so that "best" is
    judged on metrics averaged over ranks.

    Args:
        monitor, verbose, mode, save_freq: as ``ModelCheckpoint``.
        filepath: where to save (``.keras``, or ``.weights.h5`` with
            ``save_weights_only=True``); required.
        save_weights_only: save weights only.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto", save_freq="epoch", *,
                 filepath=None):
        if filepath is None:
            raise ValueError("BestModelCheckpoint needs filepath=, e.g. "
                             "BestModelCheckpoint(monitor='val_loss', filepath='best.keras')")
        super().__init__(filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)

    @staticmethod
    def _saves() -> bool:
        return runtime.rank() == 0

    def on_train_batch_end(self, batch, logs=None):
        if self._saves():
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self._saves():
            super().on_epoch_end(epoch, logs)


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "StatsCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint",
           "AdaptivePlanCallback"]


class AdaptivePlanCallback(keras.callbacks.Callback):
    """``compression="auto"``: re-plan the per-layer levels at the end of every
    ``every_epochs`` epochs (from the ``window`` steps that follow), as the data or the
    learning rate change; the plan is also kept in the model's saved optimizer config.

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.Adam(), compression="auto")
        model.fit(..., callbacks=[hvd.callbacks.AdaptivePlanCallback()])
    """

    def __init__(self, every_epochs: int = 1):
        super().__init__()
        self.every_epochs = _check_int(every_epochs, "every_epochs", 1)

    def on_epoch_end(self, epoch, logs=None):
        if (epoch + 1) % self.every_epochs:
            return
        from cgx.tensorflow.keras.optimizer import DistributedOptimizer
        opt = getattr(self.model, "optimizer", None)
        while opt is not None and not isinstance(opt, DistributedOptimizer):
            opt = getattr(opt, "inner_optimizer", None)
        if opt is None:
            raise ValueError("AdaptivePlanCallback needs a model compiled with a cgx "
                             "DistributedOptimizer")
        opt.replan()
