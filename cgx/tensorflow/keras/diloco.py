"""``hvd.DiLoCo`` for Keras 3: DiLoCo-style local steps inside ``model.fit``.

A ``keras.optimizers.Optimizer`` that wraps the inner optimizer (as
``DistributedOptimizer`` does): Keras' compiled train step applies the inner update,
and on the steps where the outer loop (:class:`cgx.diloco.OuterLoop`, shared with
torch) has work - a fragment's exchange starting or landing, the first local step - one
``tf.py_function`` hands it the variables' values and assigns what it returns. The
warm-up's synchronous steps average the gradients through the loop's plan.

Its state (anchors, outer momentum, residuals, counters, exchanges in flight) is saved
with the optimizer by ``model.save``/``save_weights``/``ModelCheckpoint`` (one extra
entry beside the optimizer's variables); each rank keeps its own error-feedback
residuals, so each rank saves and loads its own file for a bit-exact resume.

Example::

    opt = hvd.DiLoCo(keras.optimizers.AdamW(1e-3), sync_every=50)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
"""

from __future__ import annotations

import pickle

import keras
import numpy as np
import tensorflow as tf
import torch
from keras.src.utils import tracking

from cgx.diloco import DiLoCoConfig, OuterLoop, OuterSGD
from cgx.process_sets import global_process_set
from cgx.tensorflow._bridge import copy_to_torch, run_collective, to_tf, to_torch
from cgx.tensorflow.gradients import variable_name
from cgx.tensorflow.ops import resolve_process_set
from cgx.tensorflow.keras.wrapped import DelegatesToInner

STATE_KEY = "cgx_diloco"  # the loop's pickled state, beside the variables in a save


class KerasValues:
    """The loop's view (:class:`cgx.diloco.ParamAccess`) of the variables' values handed to
    a ``py_function``; what it writes is returned and assigned by the graph."""

    __slots__ = ("inputs", "outputs")

    def __init__(self, values):
        self.inputs = list(values)
        self.outputs: dict = {}

    def read(self, indices) -> list:
        return [self.outputs[i] if i in self.outputs else to_torch(self.inputs[i])
                for i in indices]

    def write(self, indices, values) -> None:
        for i, v in zip(indices, values):
            self.outputs[i] = v.detach().to(to_torch(self.inputs[i]).dtype, copy=True)

    def results(self) -> list:
        return [to_tf(self.outputs[i]) if i in self.outputs else x
                for i, x in enumerate(self.inputs)]


@keras.saving.register_keras_serializable(package="cgx")
class DiLoCo(DelegatesToInner, keras.optimizers.Optimizer):
    """Wraps a Keras optimizer: local steps, and every ``sync_every`` steps the outer
    gradient averaged (compressed) over the ranks and applied by the outer optimizer.

    Args: as :class:`cgx.torch.DiLoCo` (``optimizer`` first; no model: the variables are
    the ones Keras applies gradients to). ``outer_optimizer`` is saved as its four
    fields; a ``compression`` other than the default is not saved (pass it again to
    ``load_model`` through ``custom_objects`` if needed).
    """

    def __init__(self, optimizer, sync_every=50, fragments: int = 1, delay=None,
                 outer_optimizer=OuterSGD(), compression=None, warmup_steps: int = 0,
                 warmup_compression=None, mix: float = 0.0, calibrate_steps: int = 5,
                 assume_gbit=None, name=None, process_set=global_process_set):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a Keras 3 optimizer (keras.optimizers.*), got "
                            f"{type(optimizer).__name__}")
        config = DiLoCoConfig(sync_every, fragments, delay, outer_optimizer, compression,
                              warmup_steps, warmup_compression, mix, calibrate_steps,
                              assume_gbit)
        group = resolve_process_set(process_set)
        super().__init__(learning_rate=0.0, name=name or f"DiLoCo{type(optimizer).__name__}")
        self._config, self._group = config, group
        self._loop = None  # the OuterLoop, made with the variables (build)
        self._pending_state = None  # a loaded state, for the loop once it exists
        self.inner_optimizer = optimizer  # last: attribute reads fall through from here on

    @property
    def loop(self) -> OuterLoop:
        """The outer loop (after the first step or ``build``)."""
        return self._loop

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super().build(var_list)
        names = [variable_name(v, f"var{i}") for i, v in enumerate(var_list)]
        self._loop = OuterLoop(names, [tuple(v.shape) for v in var_list], self._config,
                               group=self._group, label=self.name)
        if self._pending_state is not None:
            self._loop.load_state_dict(self._pending_state)
            self._pending_state = None
        self._next_event = self.add_variable(shape=(), dtype="int64", name="cgx_next_event",
                                             initializer=keras.initializers.Constant(
                                                 self._loop.next_event()))

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """The inner update (of averaged gradients during the warm-up), and the outer loop's
        work on the steps that have some."""
        grads = list(grads)
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                 for g, v in zip(grads, trainable_variables)]
        it = tf.convert_to_tensor(self.inner_optimizer.iterations)
        warm = self._config.warmup_steps
        if warm:
            grads = tf.cond(it < warm, lambda: self._averaged(grads, it), lambda: list(grads))
        lr = tf.cast(self.inner_optimizer.learning_rate, tf.float64)  # this step's (schedule)
        tf.cond(tf.equal(it, warm), lambda: self._run(trainable_variables, it, lr, begin=True),
                lambda: tf.constant(False))
        self.inner_optimizer.apply(grads, trainable_variables)
        done = tf.convert_to_tensor(self.inner_optimizer.iterations)
        tf.cond(tf.equal(done, tf.convert_to_tensor(self._next_event)),
                lambda: self._run(trainable_variables, done, lr, begin=False),
                lambda: tf.constant(False))

    def _averaged(self, grads, it):
        def body(step, *gs):
            outs = self._loop.average_gradients([copy_to_torch(g) for g in gs], int(step))
            return [to_tf(o) for o in outs]
        return run_collective(body, [it] + list(grads), [g.dtype for g in grads],
                              [g.shape for g in grads], f"{self.name}.warmup")

    def _run(self, variables, step, lr, begin: bool):
        """One ``py_function``: the loop's work at ``step`` (``lr``: the inner learning rate
        of the step just taken); the variables take its results."""
        def body(step, lr, *values):
            access = KerasValues(values)
            if begin:
                self._loop.before_inner_step(access, int(step))
            else:
                follow = self._loop.follows_inner_lr
                self._loop.after_inner_step(access, int(step),
                                            inner_lr=float(lr) if follow else None)
            return access.results() + [tf.constant(self._loop.next_event(), tf.int64)]
        values = [tf.convert_to_tensor(v) for v in variables]
        outs = run_collective(body, [step, lr] + values, [v.dtype for v in values] + [tf.int64],
                              [v.shape for v in values] + [tf.TensorShape([])],
                              f"{self.name}.{'begin' if begin else 'outer'}")
        for v, o in zip(variables, outs):
            v.assign(o)
        self._next_event.assign(outs[-1])
        return tf.constant(True)

    # -- checkpoints ------------------------------------------------------------------------

    def save_own_variables(self, store):
        super().save_own_variables(store)
        state = self._loop.state_dict() if self._loop is not None else self._pending_state
        if state is not None:
            store[STATE_KEY] = np.frombuffer(pickle.dumps(_to_cpu(state)), dtype=np.uint8)

    @tracking.no_automatic_dependency_tracking
    def load_own_variables(self, store):
        keys = [k for k in store.keys() if k != STATE_KEY]
        super().load_own_variables({k: store[k] for k in keys})
        if STATE_KEY in store.keys():
            state = pickle.loads(np.asarray(store[STATE_KEY]).tobytes())
            if self._loop is None:
                self._pending_state = state
            else:
                self._loop.load_state_dict(state)

    def get_config(self):
        c, outer = self._config, self._config.outer_optimizer
        return {"name": self.name,
                "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                "sync_every": c.sync_every, "fragments": c.fragments, "delay": c.delay,
                "outer_optimizer": None if outer is None else
                [outer.lr, outer.momentum, outer.nesterov, outer.follow_inner_lr],
                "warmup_steps": c.warmup_steps, "mix": c.mix,
                "calibrate_steps": c.calibrate_steps, "assume_gbit": c.assume_gbit}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"),
                                                      custom_objects=custom_objects)
        outer = config.pop("outer_optimizer")
        return cls(inner, outer_optimizer=None if outer is None else OuterSGD(*outer),
                   **config)


def _to_cpu(state):
    """The state with its tensors on the CPU (a pickle that loads anywhere)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_cpu(v) for v in state)
    return state
