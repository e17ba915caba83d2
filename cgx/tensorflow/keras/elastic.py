"""``hvd.elastic`` for Keras: ``KerasState`` and Horovod's three elastic callbacks.

One ``model.fit`` per epoch resumes a rolled-back epoch at the batch it was committed
at (Keras 3 fixes an epoch's length when ``fit`` starts)::

    import cgx.tensorflow.keras as hvd
    hvd.init()
    model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=...)
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            model.fit(data(state.epoch, skip=state.batch), steps_per_epoch=steps - state.batch,
                      initial_epoch=state.epoch, epochs=state.epoch + 1, callbacks=callbacks)

    train(state)

Horovod's one ``fit(epochs=epochs - state.epoch)`` call works too; a rolled-back epoch
then starts again at its first batch.

The callbacks do not depend on their order in the list: a commit that falls due at the
end of a batch or an epoch is made when the next batch or epoch begins (or when ``fit``
ends), after every callback has updated ``state.batch`` and ``state.epoch``; the model
is the same then.
"""

from __future__ import annotations

import keras

from cgx.tensorflow.elastic import (HostsUpdatedInterrupt, ObjectState, State,
                                    TensorFlowKerasState, run)

__all__ = ["CommitStateCallback", "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "State", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """Horovod's ``hvd.elastic.KerasState``: a built Keras model, its optimizer and
    plain values (``KerasState(model, epoch=0, batch=0)``), kept across changes of
    world; see :class:`cgx.tensorflow.elastic.TensorFlowKerasState`."""

    def __init__(self, model, optimizer=None, **kwargs) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at every epoch's end.

    A commit copies the state to host memory and is where ranks waiting to join come
    in; a failure costs the batches since the last one."""

    def __init__(self, state, batches_per_commit: int = 1) -> None:
        super().__init__()
        if isinstance(batches_per_commit, bool) or not isinstance(batches_per_commit, int) \
                or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be an int >= 1, got "
                             f"{batches_per_commit!r}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit
        self._due = False

    def on_train_begin(self, logs=None):
        # The same count on every rank after each change of world.
        self.batches_remaining = self.batches_per_commit
        self._due = False

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self._due = True
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self._due = True
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_begin(self, batch, logs=None):
        self._commit_if_due()

    def on_epoch_begin(self, epoch, logs=None):
        self._commit_if_due()

    def on_train_end(self, logs=None):
        self._commit_if_due()

    def _commit_if_due(self) -> None:
        if self._due:
            self._due = False
            self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of batches done in the current epoch (0 at its
    end), counting those done before a rollback when ``fit`` resumed the epoch at
    ``state.batch``."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self._start = 0

    def on_train_begin(self, logs=None):
        self._start = self.state.batch  # fit resumes the epoch here

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._start + batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._start = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs finished, across changes of world:
    ``fit``'s own epoch index restarts with every call."""

    def __init__(self, state) -> None:
        super().__init__()
        self.state = state
        self._first = None  # (state.epoch, fit's epoch index) when this fit began
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs=None):
        self._first = None
        self.initial_epoch = self.state.epoch

    def on_epoch_begin(self, epoch, logs=None):
        if self._first is None:
            self._first = epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + (epoch - self._first) + 1
