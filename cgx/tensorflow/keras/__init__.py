"""Keras 3 adapter: a drop-in for ``horovod.tensorflow.keras`` (TensorFlow backend).

Change ``import horovod.tensorflow.keras as hvd`` to ``import cgx.tensorflow.keras as hvd``::

    import cgx.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback()])

Horovod's own Keras optimizer fails on Keras 3 (``'Variable' object has no
attribute 'ref'``); this one is a plain ``keras.optimizers.Optimizer``
subclass, so it compiles, saves, loads and pickles like any Keras optimizer.
"""

from __future__ import annotations

from cgx.errors import MissingDependencyError

import cgx.tensorflow as _tfa  # raises MissingDependencyError without TensorFlow

try:
    import keras as _keras
except ModuleNotFoundError as _exc:
    if _exc.name != "keras":
        raise
    raise MissingDependencyError("keras", "tensorflow",
                                 "cgx.tensorflow.keras (the Keras adapter)") from None

if int(_keras.__version__.split(".")[0]) < 3:
    raise ImportError(f"cgx.tensorflow.keras supports Keras 3; found keras {_keras.__version__}. "
                      "Install keras>=3 (pip install 'cgx[tensorflow]')")
if _keras.backend.backend() != "tensorflow":
    raise ImportError(f"cgx.tensorflow.keras needs Keras' TensorFlow backend, but Keras runs on "
                      f"{_keras.backend.backend()!r}: set KERAS_BACKEND=tensorflow before "
                      "importing keras (with the torch backend, use cgx.torch)")

from cgx.tensorflow import (Average, Compression, Max, Min, Product, Sum, allgather_object,
                            barrier, broadcast_object, broadcast_variables, cross_rank,
                            cross_size, init, is_initialized, local_rank, local_size, rank,
                            shutdown, size, stats, start_timeline, stop_timeline)
from cgx.session import mpi_threads_supported
from cgx.process_sets import ProcessSet, global_process_set
from cgx.session import add_process_set, remove_process_set
from cgx.tensorflow.compat import broadcast_global_variables
from cgx.capabilities import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled,
                              is_homogeneous, mpi_built, mpi_enabled, nccl_built, rocm_built)
from cgx.tensorflow.keras import callbacks, elastic
from cgx.tensorflow.keras.optimizer import DistributedOptimizer
from cgx.tensorflow.keras.diloco import DiLoCo
from cgx.diloco import OuterSGD
from cgx.tensorflow.keras.loss_scale import LossScaleOptimizer, install_global_overflow_check
from cgx.tensorflow.keras.loss_scale import distributed_inside as _distributed_inside

install_global_overflow_check()


def _eval(value):
    return value.numpy() if hasattr(value, "numpy") else value


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """Average (by default) a value (array, number or tensor) over ranks; returns a NumPy array."""
    import tensorflow as tf
    return _eval(_tfa.allreduce(tf.convert_to_tensor(value), average=average, name=name, op=op,
                                prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, compression=compression))


def allgather(value, name=None):
    """Every rank's value concatenated along dim 0; returns a NumPy array."""
    import tensorflow as tf
    return _eval(_tfa.allgather(tf.convert_to_tensor(value), name=name))


def broadcast(value, root_rank, name=None):
    """``root_rank``'s value on every rank; returns a NumPy array."""
    import tensorflow as tf
    return _eval(_tfa.broadcast(tf.convert_to_tensor(value), root_rank, name=name))


def reducescatter(value, name=None, op=Average):
    """Reduce a value over ranks and keep this rank's rows of dim 0; returns a NumPy array."""
    import tensorflow as tf
    from cgx.tensorflow.compat import reducescatter as _reducescatter
    return _eval(_reducescatter(tf.convert_to_tensor(value), name=name, op=op))


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Load a saved Keras model whose optimizer then exchanges gradients through cgx.

    A model saved with a :class:`DistributedOptimizer` comes back with it; a
    model saved with a plain optimizer gets that optimizer (with its state)
    wrapped in one. ``compression`` applies to the wrapped optimizer, and
    replaces a compression that could not be saved (a user compressor).

    Args:
        filepath: a ``.keras`` file.
        custom_optimizers: optimizer classes the file needs (Horovod's argument).
        custom_objects: other custom classes and functions, as for
            ``keras.models.load_model``.
        compression: see :class:`DistributedOptimizer`.
        legacy_opts: Horovod's switch for Keras 2's legacy optimizers; Keras 3 has none.
    """
    if legacy_opts:
        raise ValueError("legacy_opts=True asks for Keras 2's legacy optimizers, which Keras 3 "
                         "does not have; load with legacy_opts=False")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects[cls.__name__] = cls
    model = _keras.models.load_model(filepath, custom_objects=objects)
    opt = getattr(model, "optimizer", None)
    if opt is None:
        return model
    # Saved distributed (mixed precision: a loss-scale optimizer around one): keep it.
    inner = _distributed_inside(opt)
    if isinstance(opt, DiLoCo):  # exchanges on its own: not wrapped again
        return model
    if inner is not None:
        if compression is not Compression.none:
            inner.set_compression(compression)
        return model
    opt = DistributedOptimizer(opt, compression=compression)
    # Training has not run in this process yet, so the train function that
    # would bake the old optimizer in does not exist: pointing the model at the
    # wrapper is enough.
    model.optimizer = opt
    return model


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "stats", "Average", "Sum", "Min", "Max", "Product", "Compression",
    "start_timeline", "stop_timeline", "mpi_threads_supported", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "broadcast_global_variables",
    "elastic", "reducescatter", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
    "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built", "is_homogeneous",
    "allreduce", "allgather", "broadcast", "barrier", "broadcast_variables", "broadcast_object",
    "allgather_object", "DistributedOptimizer", "LossScaleOptimizer", "load_model", "callbacks",
    "DiLoCo", "OuterSGD",
]
