"""The rest of ``horovod.tensorflow``'s public names: small ops, aliases and clear refusals.

See ``cgx.torch.compat``; ``tests/test_horovod_api.py`` checks the list.
"""

from __future__ import annotations


import tensorflow as tf

from cgx import runtime
from cgx import process_sets
from cgx.ops import (Average, Sum, allgather_rows, group_size, op_name, reducescatter_rows,
                     resolve_op)
from cgx.process_sets import global_process_set
from cgx.tensorflow._bridge import collective
from cgx.tensorflow.ops import resolve_process_set
from cgx.torch.compat import HorovodInternalError, check_extension, refuse  # noqa: F401


def size_op(process_set_id=0, name=None):
    """The number of ranks (of a process set), as a TF constant (Horovod's graph op)."""
    size = runtime.size() if process_set_id == 0 else \
        len(process_sets.ranks_of_id(process_set_id))
    return tf.constant(size, dtype=tf.int32, name=name)


def local_size_op(name=None):
    return tf.constant(runtime.local_size(), dtype=tf.int32, name=name)


def rank_op(name=None):
    return tf.constant(runtime.rank(), dtype=tf.int32, name=name)


def local_rank_op(name=None):
    return tf.constant(runtime.local_rank(), dtype=tf.int32, name=name)


def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank is in the process set, else 0, as a TF constant."""
    if process_set_id == 0:
        return tf.constant(1, dtype=tf.int32, name=name)
    ranks = process_sets.ranks_of_id(process_set_id)
    return tf.constant(int(runtime.rank() in ranks), dtype=tf.int32, name=name)


# horovod.tensorflow.util's helpers, which horovod.tensorflow exports with a leading
# underscore and Horovod's own scripts reach for (``if hvd._executing_eagerly(): ...``);
# cgx.tensorflow exports them under those names.

def executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly (False while a ``tf.function`` is being traced)."""
    return tf.executing_eagerly()


def make_subgraph(f):
    """``f`` as a ``tf.function`` (Horovod's helper for groups of eager collectives)."""
    return tf.function(f)


def cache(f):
    """Memoize ``f`` by its arguments and by whether it runs eagerly (Horovod's helper)."""
    cache: dict = {}

    def wrapper(*args):
        key = (args, executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def gpu_available(ext_base_name=None, verbose=False) -> bool:
    """True when TensorFlow sees a GPU."""
    return bool(tf.config.list_physical_devices("GPU"))


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast of ``variables`` from ``root_rank``. Returns, eagerly, the
    variables (assigned); in a graph (``tf.compat.v1`` sessions, ``tf.function``), one
    tensor per variable that reads it after the assignment: running it runs the broadcast
    (Horovod's ``broadcast_``; the op alone would never run in a session)."""
    from cgx.tensorflow.ops import assign_broadcast
    assigns = assign_broadcast(list(variables), root_rank, process_set=process_set)
    return variables if tf.executing_eagerly() else assigns


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=global_process_set):
    """A function that broadcasts a Python object from ``root_rank`` (Horovod's helper)."""
    from cgx.tensorflow.ops import broadcast_object
    resolve_process_set(process_set)
    return lambda obj: broadcast_object(obj, root_rank, name=name, process_set=process_set)


def reducescatter(tensor, device_dense="", compression=None, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks and keep this rank's rows of dim 0 (Horovod's split:
    ``rows // size`` each, the first ``rows % size`` ranks one more). The gradient is
    Horovod's: the output gradient times the number of ranks for Sum (as is for Average),
    allgathered."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, None)
    x = tf.convert_to_tensor(tensor)
    shape = tf.TensorShape(None) if x.shape.rank is None else \
        tf.TensorShape([None]).concatenate(x.shape[1:])

    def call(key, a):
        return [reducescatter_rows(a, op, prescale_factor, postscale_factor, key, compression,
                                   g)]

    def gather(key, d):
        return [allgather_rows(d, key, g)]

    @tf.custom_gradient
    def forward(a):
        (y,), key = collective(call, [a], [a.dtype], [shape], "reducescatter", name, g)

        def grad(dy):
            (full,), _ = collective(gather, [dy], [dy.dtype], [a.shape], "allgather",
                                    key + ".grad", g)
            scale = prescale_factor * postscale_factor * (group_size(g) if op is Sum else 1)
            return full * tf.cast(scale, full.dtype) if scale != 1.0 else full

        return y, grad

    return forward(x)


def _group_name(name, kind: str, process_set):
    """A grouped call's name: eagerly ``<kind>.noname.<n>`` when not given; in a graph each
    part is named from its own op when not given (the same on every rank)."""
    g = resolve_process_set(process_set)
    return op_name(name, kind, g) if tf.executing_eagerly() else name


def _part(name, i: int):
    return None if name is None else f"{name}.{i}"


def grouped_reducescatter(tensors, device_dense="", compression=None, op=Average, name=None,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    name = _group_name(name, "grouped_reducescatter", process_set)
    return [reducescatter(t, compression=compression, op=op, name=_part(name, i),
                          process_set=process_set, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor) for i, t in enumerate(tensors)]


def grouped_allgather(tensors, name=None, ignore_name_scope=False,
                      process_set=global_process_set):
    from cgx.tensorflow.ops import allgather
    name = _group_name(name, "grouped_allgather", process_set)
    return [allgather(t, name=_part(name, i), process_set=process_set)
            for i, t in enumerate(tensors)]


broadcast_global_variables = refuse(
    "broadcast_global_variables()", "it broadcasts TF1 global variables; use "
    "hvd.broadcast_variables(model.variables, root_rank=0) (or the Keras "
    "BroadcastGlobalVariablesCallback)")
join = refuse("hvd.join() for TensorFlow", "join() covers the torch DistributedOptimizer; "
               "give every rank the same number of batches (e.g. repeat() and a fixed "
               "steps_per_epoch)")


class SyncBatchNormalization:
    """Not supported by cgx."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("hvd.SyncBatchNormalization is not supported by cgx; use "
                                  "keras.layers.BatchNormalization (per-rank statistics)")


