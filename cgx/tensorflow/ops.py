"""Horovod-compatible collectives on TensorFlow tensors (``horovod.tensorflow.mpi_ops``).

Each call hands its tensors to the torch-level implementation that
``cgx.torch`` uses (through :mod:`cgx.tensorflow._bridge`: DLPack on CPU, no
copy in, one copy for the result), on the shared engine thread of
``cgx.session``, so TF and torch collectives of one process stay in one order.
They work eagerly and in graphs (``tf.function``, ``tf.compat.v1`` sessions: one
asynchronous op each, negotiated by name, see ``graph_ops``; not under XLA), and have
gradients: ``allreduce``'s backward allreduces the gradient the same way, ``allgather``'s
averages it and keeps this rank's rows, ``broadcast``'s averages it onto the root (zeros
elsewhere), ``alltoall``'s sends the gradient back (Horovod's rules).

Differences from Horovod, by design (as in ``cgx.torch``):

* ``allreduce`` is exact unless a ``compression`` is passed (gradient
  compression from the environment applies to ``DistributedGradientTape``
  and the Keras ``DistributedOptimizer``, not to metric averaging).
* ``op=Adasum`` is not supported;
  ``device_dense``/``device_sparse`` are accepted and ignored.
"""

from __future__ import annotations

import tensorflow as tf
import torch

from cgx import runtime
from cgx.compression import Compression, user_compressor
from cgx.tensorflow._bridge import collective
# The torch-level bodies of the collectives, written once in the core for both adapters.
from cgx.ops import (  # noqa: F401 - Horovod's op names, re-exported
    Adasum, Average, Max, Min, Product, Sum, allgather_rows, alltoall_rows, broadcast_tensor,
    broadcast_tensors, group_rank, group_size, op_name, reduce_tensors, resolve_op)
from cgx.process_sets import ProcessSet, global_process_set  # noqa: F401
from cgx.session import reducer_of
from cgx import ops as _ops


def resolve_process_set(process_set):
    """The core's process-set group, with Horovod's TensorFlow error type: a set this rank
    may not use raises ``tf.errors.InvalidArgumentError``."""
    try:
        return _ops.resolve_process_set(process_set)
    except ValueError as e:
        raise tf.errors.InvalidArgumentError(None, None, str(e)) from None


# Autograph would rewrite these Python bodies when they are called inside a
# tf.function; they only branch on Python values, so they run as written.
_no_autograph = tf.autograph.experimental.do_not_convert


def tf_side_compressor(compression):
    """``compression`` when it is a Horovod-style TF compressor, else None.

    cgx compressors (``Compression.*``) work on the torch side of the bridge.
    Any other object with ``compress``/``decompress`` is a user compressor
    written for ``horovod.tensorflow``: it gets TF tensors, as with Horovod,
    and its payload is reduced exactly.
    """
    return user_compressor(compression)


def _float_grads(grads, xs):
    return [g if x.dtype.is_floating or x.dtype.is_complex else None for g, x in zip(grads, xs)]


# -- allreduce --------------------------------------------------------------------

def _allreduce_dense(tensors, op, pre, post, name, compression, group=None, kind="allreduce"):
    """Allreduce a list of dense TF tensors in one fused collective, with a gradient."""
    user = tf_side_compressor(compression)
    if user is not None:
        pairs = [user.compress(t) for t in tensors]
        reduced = _allreduce_dense([p for p, _ in pairs], op, pre, post, name, Compression.exact,
                                   group, kind)
        return [user.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs)]

    def call(key, *ts):
        return reduce_tensors(list(ts), op, pre, post, key, compression, group)

    @tf.custom_gradient
    def forward(*xs):
        ys, key = collective(call, xs, [x.dtype for x in xs], [x.shape for x in xs], kind,
                             name, group)

        def grad(*dys):
            dys = [tf.zeros_like(x) if d is None else d for d, x in zip(dys, xs)]
            return _float_grads(_allreduce_dense(dys, op, pre, post, key + ".grad",
                                                 compression, group, kind), xs)

        return ys, grad

    return list(forward(*[tf.convert_to_tensor(t) for t in tensors]))


def _sub(name, part: str):
    """The name of one part of a collective (None stays None: auto-generated per part)."""
    return None if name is None else f"{name}.{part}"


def _allreduce_sparse(slices: tf.IndexedSlices, op, pre, post, name, process_set=None):
    """Horovod's IndexedSlices reduction: gather values and indices (no densifying)."""
    if op not in (Average, Sum):
        raise ValueError(f"allreduce of tf.IndexedSlices supports op Average or Sum, got {op!r}; "
                         "pass tf.convert_to_tensor(slices) to reduce it densely")
    values = allgather(slices.values, name=_sub(name, "values"), process_set=process_set)
    indices = allgather(slices.indices, name=_sub(name, "indices"), process_set=process_set)
    if op is Average:  # as Horovod: divided by the number of ranks
        values = values / tf.cast(group_size(resolve_process_set(process_set)), values.dtype)
    if pre * post != 1.0:
        values = values * tf.cast(pre * post, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


@_no_autograph
def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """Average (or sum, min, max, product) ``tensor`` over all ranks; returns a new tensor.

    Args:
        tensor: a ``tf.Tensor`` (same shape and dtype on every rank), a
            variable, or ``tf.IndexedSlices`` (gathered, as Horovod does).
        compression: ``Compression.none`` (exact), ``fp16``/``bf16``, a cgx
            compressor such as ``Compression.quantize(bits=4)``, or a
            Horovod-style TF compressor.
        op: Average (default), Sum, Min, Max, Product.
        prescale_factor, postscale_factor: multiply before / after the reduction.

    Example::

        avg_loss = hvd.allreduce(loss, name="loss")
    """
    g = resolve_process_set(process_set)
    op = resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        if tf.executing_eagerly():  # one number for the pair, as before
            name = op_name(name, "allreduce", g)
        return _allreduce_sparse(tensor, op, prescale_factor, postscale_factor, name,
                                 process_set)
    return _allreduce_dense([tensor], op, prescale_factor, postscale_factor, name,
                            compression, g)[0]


@_no_autograph
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Fused allreduce of a list of tensors (one collective for all); returns a list."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, average)
    tensors = list(tensors)
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        raise ValueError("grouped_allreduce takes dense tensors; reduce tf.IndexedSlices with "
                         "allreduce(), or convert them with tf.convert_to_tensor()")
    if not tensors:
        return []
    return _allreduce_dense(tensors, op, prescale_factor, postscale_factor, name,
                            compression, g, "grouped_allreduce")


# -- allgather, broadcast, alltoall ---------------------------------------------------

@_no_autograph
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0 (first dims may differ); returns it.

    A scalar gathers into a vector of ``size()`` values.
    """
    g = resolve_process_set(process_set)
    x = tf.convert_to_tensor(tensor)
    if x.shape.rank is None:
        shape = tf.TensorShape(None)
    elif x.shape.rank == 0:
        shape = tf.TensorShape([group_size(g)])
    else:
        shape = tf.TensorShape([None]).concatenate(x.shape[1:])

    def call(key, a):
        return [allgather_rows(a, key, g)]

    @tf.custom_gradient
    def forward(a):
        (y,), key = collective(call, [a], [a.dtype], [shape], "allgather", name, g)

        def grad(dy):
            # Horovod's rule: averaged over ranks, then this rank's rows.
            averaged = allreduce(dy, op=Average, name=key + ".grad", process_set=process_set)
            me = group_rank(g)
            if a.shape.rank == 0:
                return averaged[me]
            rows = tf.shape(a, out_type=tf.int64)[:1]
            counts = allgather(rows, name=key + ".rows", process_set=process_set)
            start = tf.reduce_sum(counts[:me])
            return averaged[start:start + rows[0]]

        return y, grad

    return forward(x)


@_no_autograph
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """``root_rank``'s value of ``tensor`` on every rank (a new tensor).

    The gradient is the average of every rank's gradient on the root, zeros elsewhere
    (Horovod's rule).
    """
    g = resolve_process_set(process_set)
    _check_root(root_rank, g)
    x = tf.convert_to_tensor(tensor)

    def call(key, t):
        return [broadcast_tensor(t, root_rank, torch.empty_like(t), key, g)]

    @tf.custom_gradient
    def forward(a):
        (y,), key = collective(call, [a], [a.dtype], [a.shape], "broadcast", name, g)

        def grad(dy):
            averaged = allreduce(dy, op=Average, name=key + ".grad",  # as Horovod
                                 process_set=process_set)
            if runtime.rank() == root_rank:
                return averaged
            with tf.control_dependencies([averaged]):  # a graph runs the allreduce here too
                return tf.zeros_like(averaged)

        return y, grad

    return forward(x)


@_no_autograph
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Send slices of ``tensor`` (dim 0, by ``splits`` or equally) to every rank.

    Returns:
        The received rows; with ``splits``, also the int32 counts received per rank.
    """
    g = resolve_process_set(process_set)
    x = tf.convert_to_tensor(tensor)
    s = None if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int64)
    shape = tf.TensorShape(None) if x.shape.rank is None else \
        tf.TensorShape([None]).concatenate(x.shape[1:])

    def call(key, a, *rest):
        out, received = alltoall_rows(a, rest[0].tolist() if rest else None, key, g)
        return [out, received]

    @tf.custom_gradient
    def forward(a, *rest):
        (y, received), key = collective(call, [a, *rest], [a.dtype, tf.int32],
                                        [shape, tf.TensorShape([group_size(g)])], "alltoall",
                                        name, g)

        def grad(dy, _unused=None):
            back = alltoall(dy, splits=received, name=key + ".grad",
                            process_set=process_set)[0]
            return [back] + [None] * len(rest)

        return (y, received), grad

    y, received = forward(x, *([] if s is None else [s]))
    return y if splits is None else (y, received)


@_no_autograph
def barrier(process_set=global_process_set) -> None:
    """Block until every rank (of ``process_set``) arrives."""
    g = resolve_process_set(process_set)

    def call(key):
        reducer_of(g).transport.barrier()
        return []

    collective(call, [], [], [], "barrier", "barrier" if tf.executing_eagerly() else None, g)


def _check_root(root_rank, group=None) -> None:
    _ops.check_root(root_rank, runtime.size(), group)


# -- variables ----------------------------------------------------------------------

@_no_autograph
def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign ``root_rank``'s values to ``variables`` on every rank (one fused broadcast).

    Args:
        variables: tf or Keras variables, the same list in the same order on every rank.
        root_rank: the rank whose values win.

    Returns:
        In a graph, the op that does it; eagerly, None (it is done).

    Example::

        hvd.broadcast_variables(model.variables, root_rank=0)
    """
    assigns = assign_broadcast(variables, root_rank, process_set)
    if tf.executing_eagerly():
        return None
    if not assigns:
        return tf.no_op()
    # A resource variable's assign in a tf.compat.v1 graph is an unread variable, whose
    # .op is the assignment (the op that runs the broadcast first).
    return tf.group(*[a if isinstance(a, (tf.Tensor, tf.Operation)) else a.op for a in assigns])


def assign_broadcast(variables, root_rank, process_set=global_process_set) -> list:
    """Assign ``root_rank``'s values to ``variables``; returns each variable's assignment:
    in a graph (``tf.compat.v1`` sessions, ``tf.function``), tensors that read the value
    after it (running one runs the broadcast and the assignment), as Horovod's
    ``broadcast_`` returns; eagerly, the assignments are done."""
    g = resolve_process_set(process_set)
    _check_root(root_rank, g)
    variables = list(variables)
    if not variables or group_size(g) == 1:
        return [tf.identity(v) for v in variables] if not tf.executing_eagerly() else \
            list(variables)
    values = [tf.convert_to_tensor(v) for v in variables]

    def call(key, *xs):
        ts = [x.clone() for x in xs]  # broadcast in place: into copies, never TF memory
        broadcast_tensors(ts, root_rank, key, g)
        return ts

    name = "broadcast_variables" if tf.executing_eagerly() else None
    new, _ = collective(call, values, [v.dtype for v in values], [v.shape for v in values],
                        "broadcast_variables", name, g)
    return [v.assign(n) for v, n in zip(variables, new)]


def broadcast_object(obj=None, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """``root_rank``'s ``obj`` (pickled) on every rank (eager only)."""
    g = resolve_process_set(process_set)
    return _ops.broadcast_object(obj, root_rank, name, g)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (pickled), as a list in rank order (eager only)."""
    g = resolve_process_set(process_set)
    return _ops.allgather_object(obj, name, g)
