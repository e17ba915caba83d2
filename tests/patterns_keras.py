"""Keras training patterns for the reference-equivalence harness (see equivalence.py).

``shard`` works on torch tensors; these patterns hand it a row index and slice
their NumPy arrays with the result, so rank r trains on the r-th part of every
global batch, as in the torch patterns.

Variants (``init(variant)``, ``run_patterns(..., variant=...)``): ``"plain"``, and
``"auto-exact"``, where the patterns of ``AUTO_PATTERNS`` exchange with ``Compression.auto``
restricted to the exact candidate (``families=("exact",)``, plans every 2 steps from 1-step
windows, every kernel planned however small): auto's path with nothing compressed. The
sufficient-factor patterns take a fixed compression and stay out of it.
"""

from __future__ import annotations

import os

import numpy as np
import torch

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

STEPS = 4
GLOBAL_BATCH = 12


VARIANTS = ("plain", "auto-exact")
_variant = "plain"  # set by init(): what _compression() gives


def init(variant: str = "plain"):
    global _variant
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    _variant = variant
    if variant == "auto-exact":  # before init: the rules then plan the small kernels too
        os.environ["CGX_COMPRESSION_MINIMAL_SIZE"] = "0"
    import cgx.tensorflow.keras as hvd
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    return hvd


def _global_data(n_batches, seed=5):
    g = np.random.default_rng(seed)
    x = g.normal(size=(n_batches * GLOBAL_BATCH, 10)).astype("float32")
    y = (x @ g.normal(size=(10, 3))).astype("float32")
    return x, y


def _my_rows(shard, n_batches):
    """Indices of this rank's rows, batch after batch (the global order in the reference)."""
    idx = torch.arange(n_batches * GLOBAL_BATCH).view(n_batches, GLOBAL_BATCH)
    return torch.cat([shard(row) for row in idx]).numpy()


def _model(seed=0):
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(3)])


def _compression(hvd):
    if _variant == "auto-exact":
        return hvd.Compression.auto(families=("exact",), window=1, adjust_every=2)
    return hvd.Compression.exact


def _weights(model):
    return [torch.from_numpy(np.asarray(w)) for w in model.get_weights()]


def fit_with_callbacks_and_validation(hvd, shard, **groups):
    import keras
    x, y = _global_data(STEPS)
    rows = _my_rows(shard, STEPS)
    # Different initial weights per rank: the broadcast callback makes them rank 0's.
    model = _model(seed=hvd.rank())
    if groups.get("groups") == "first two":
        groups["groups"] = [model.trainable_variables[:2]]
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                                     compression=_compression(hvd), **groups),
                  loss="mse", jit_compile=False)
    per_rank = GLOBAL_BATCH // hvd.size()
    model.fit(x[rows], y[rows], batch_size=per_rank, epochs=1, shuffle=False, verbose=0,
              validation_data=(x[:6], y[:6]),
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                         hvd.callbacks.MetricAverageCallback()])
    return _weights(model)


def fit_in_user_groups(hvd, shard):
    """Horovod's groups=: the first two variables in one bucket, the rest in another."""
    return fit_with_callbacks_and_validation(hvd, shard, groups="first two")


def custom_tape_loop(hvd, shard, **groups):
    import keras
    import tensorflow as tf
    import cgx.tensorflow as hvd_tf  # horovod.tensorflow's tape
    x, y = _global_data(STEPS)
    model = _model()
    opt = keras.optimizers.Adam(0.01)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        tape = hvd_tf.DistributedGradientTape(tape, compression=_compression(hvd), **groups)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    for step in range(STEPS):
        rows = shard(torch.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)).numpy()
        train_step(x[rows], y[rows])
    return _weights(model)


def tape_loop_in_num_groups(hvd, shard):
    """Horovod's num_groups=: the tape's gradients in two buckets inside tf.function."""
    return custom_tape_loop(hvd, shard, num_groups=2)


def _two_wide(seed=0):
    """10 -> 64 -> 64 (tanh): with 6 rows per rank on 2 ranks, a 64 x 64 kernel's factors
    are smaller than its gradient. Returns the input, the two layers and the output."""
    import keras
    keras.utils.set_random_seed(seed)
    inp = keras.Input((10,))
    first = keras.layers.Dense(64, activation="tanh")
    mid = keras.layers.Dense(64, activation="tanh")
    return inp, first, mid, mid(first(inp))


def _fit_with_factors(hvd, shard, model):
    import keras
    x, y = _global_data(STEPS)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                     compression=hvd.Compression.exact,
                                                     sufficient_factors=model),
                  loss="mse", jit_compile=False)
    model.fit(x[_my_rows(shard, STEPS)], y[_my_rows(shard, STEPS)],
              batch_size=GLOBAL_BATCH // hvd.size(), epochs=1, shuffle=False, verbose=0)
    return _weights(model)


def factors_with_a_tied_head(hvd, shard):
    """Sufficient factors; a head holding the 64 x 64 layer uses its kernel, transposed."""
    import keras
    import tensorflow as tf

    class TiedHead(keras.layers.Layer):
        def __init__(self, dense):
            super().__init__()
            self.dense = dense

        def call(self, h):
            return tf.matmul(h, self.dense.kernel, transpose_b=True)

    inp, _, mid, h = _two_wide()
    model = keras.Model(inp, keras.layers.Dense(3)(TiedHead(mid)(h)))
    return _fit_with_factors(hvd, shard, model)


def factors_with_a_borrowed_kernel(hvd, shard):
    """Sufficient factors; a Lambda multiplies by the 64 x 64 kernel again (a closure)."""
    import keras
    import tensorflow as tf
    inp, _, mid, h = _two_wide()
    again = keras.layers.Lambda(lambda t: tf.matmul(t, mid.kernel))(h)
    return _fit_with_factors(hvd, shard, keras.Model(inp, keras.layers.Dense(3)(again)))


def factors_with_an_extra_loss_term(hvd, shard):
    """Sufficient factors; a custom step's loss has a term of both kernels on its rows."""
    import keras
    import tensorflow as tf
    x, y = _global_data(STEPS)
    inp, first, mid, h = _two_wide()
    model = keras.Model(inp, keras.layers.Dense(3)(h))
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                   compression=hvd.Compression.exact, sufficient_factors=model)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            extra = tf.matmul(tf.tanh(tf.matmul(xb, first.kernel)), mid.kernel)
            loss = tf.reduce_mean(tf.square(model(xb) - yb)) + \
                0.01 * tf.reduce_mean(tf.square(extra))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    for step in range(STEPS):
        rows = shard(torch.arange(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)).numpy()
        train_step(x[rows], y[rows])
    return _weights(model)


PATTERNS = {f.__name__: f for f in (fit_with_callbacks_and_validation, fit_in_user_groups,
                                    custom_tape_loop, tape_loop_in_num_groups,
                                    factors_with_a_tied_head, factors_with_a_borrowed_kernel,
                                    factors_with_an_extra_loss_term)}
AUTO_PATTERNS = ("fit_with_callbacks_and_validation", "custom_tape_loop")
