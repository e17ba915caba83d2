"""Horovod-compatible collectives on torch tensors (``horovod.torch.mpi_ops``).

Same names, signatures and defaults as Horovod 0.28.1. Differences, by design:

* Handles are :class:`cgx.collectives.Handle` objects (Horovod returns ints);
  use them the same way, with ``poll()`` and ``synchronize()``.
* The functional ``allreduce`` is exact unless a ``compression`` is passed
  (gradient compression from the environment applies to
  ``DistributedOptimizer`` and the DDP hook, not to metric averaging).
* ``op=Adasum`` is not supported.
* Process sets: see :mod:`cgx.process_sets` (no ``HOROVOD_DYNAMIC_PROCESS_SETS`` needed).
"""

from __future__ import annotations

from typing import Any

import torch

from cgx import runtime, session
from cgx.comm.base import ReduceOp
from cgx.ops import (Average, Sum, allgather_rows, alltoall_rows, broadcast_tensor, check_root,
                     group_rank, group_size, op_name, reduce_tensors, reducescatter_rows,
                     resolve_op, resolve_process_set, sparse_reduce)
from cgx.process_sets import global_process_set
from cgx.compression import Compression

# -- allreduce ------------------------------------------------------------------

class _Allreduce(torch.autograd.Function):
    """Allreduce with a gradient: the backward pass allreduces the gradient the same way."""

    @staticmethod
    def forward(ctx, op, pre, post, name, compression, group, *tensors):
        ctx.args = (op, pre, post, name, compression, group)
        return tuple(session.run(reduce_tensors, list(tensors), op, pre, post, name, compression,
                                 group, label=name))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, name, compression, group = ctx.args
        out = session.run(reduce_tensors, [g.contiguous() for g in grads], op, pre, post,
                          name + ".grad", compression, group, label=name)
        return (None, None, None, None, None, None, *out)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Start an exact allreduce of a copy of ``tensor``; ``synchronize(handle)`` returns it."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, average)
    name = op_name(name, "allreduce", g)
    return session.submit(lambda: reduce_tensors([tensor], op, prescale_factor, postscale_factor,
                                               name, None, g)[0], label=name)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Average (or sum, min, max, product) ``tensor`` over all ranks; returns a new tensor.

    Args:
        tensor: same shape and dtype on every rank.
        compression: ``Compression.none`` (exact), ``fp16``/``bf16``, or a cgx
            compressor such as ``Compression.quantize(bits=4)``.
        op: Average (default), Sum, Min, Max, Product.

    Example::

        avg_loss = hvd.allreduce(loss.detach(), name="loss")
    """
    g = resolve_process_set(process_set)
    op = resolve_op(op, average)
    return _Allreduce.apply(op, prescale_factor, postscale_factor, op_name(name, "allreduce", g),
                            compression, g, tensor)[0]


def _reduce_in_place(tensors, op, pre, post, name, group=None):
    """Engine thread: reduce ``tensors`` and write the results back into them."""
    for t, o in zip(tensors, reduce_tensors(tensors, op, pre, post, name, None, group)):
        t.copy_(o)
    return tensors


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """In-place form of :func:`allreduce_async`: ``synchronize`` writes into ``tensor``."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, average)
    name = op_name(name, "allreduce", g)

    return session.submit(lambda: _reduce_in_place([tensor], op, prescale_factor,
                                                   postscale_factor, name, g)[0], label=name)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Start one fused allreduce of several tensors; the handle yields a list."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, average)
    name = op_name(name, "grouped_allreduce", g)
    tensors = list(tensors)
    return session.submit(reduce_tensors, tensors, op, prescale_factor, postscale_factor, name,
                          None, g, label=name)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Fused allreduce of a list of tensors (one collective for all); returns a list."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, average)
    return list(_Allreduce.apply(op, prescale_factor, postscale_factor,
                                 op_name(name, "grouped_allreduce", g), compression, g, *tensors))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    """In-place form of :func:`grouped_allreduce_async`: results land in ``tensors``."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, average)
    name = op_name(name, "grouped_allreduce", g)
    tensors = list(tensors)
    return session.submit(_reduce_in_place, tensors, op, prescale_factor, postscale_factor, name,
                          g, label=name)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather, broadcast, alltoall, reducescatter --------------------------------

class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, group):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.name, ctx.group = name, group
        return session.run(allgather_rows, tensor, name, group, label=name)

    @staticmethod
    def backward(ctx, grad):
        # Horovod's rule: the gradient is averaged over ranks, then each rank keeps its rows.
        g = ctx.group
        averaged = session.run(reduce_tensors, [grad.contiguous()], ReduceOp.AVERAGE, 1.0, 1.0,
                               ctx.name + ".grad", None, g)[0]
        rows = session.run(allgather_rows, torch.tensor([ctx.rows]), ctx.name + ".grad.rows", g)
        me = group_rank(g)
        start = int(rows[:me].sum().item())
        return averaged[start: start + ctx.rows].view_as(grad[: ctx.rows]) if grad.dim() else \
            averaged[me], None, None


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start gathering every rank's ``tensor`` along dim 0 (first dims may differ)."""
    g = resolve_process_set(process_set)
    name = op_name(name, "allgather", g)
    return session.submit(allgather_rows, tensor, name, g, label=name)


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0 (first dims may differ); returns it."""
    g = resolve_process_set(process_set)
    return _Allgather.apply(tensor, op_name(name, "allgather", g), g)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, group):
        ctx.root_rank, ctx.group = root_rank, group
        check_root(root_rank, runtime.size(), group)
        return session.run(broadcast_tensor, tensor, root_rank, torch.empty_like(tensor), name,
                           group, label=name)

    @staticmethod
    def backward(ctx, grad):
        summed = session.run(reduce_tensors, [grad.contiguous()], ReduceOp.AVERAGE, 1.0, 1.0,
                             "broadcast.grad", None, ctx.group)[0]
        return (summed if runtime.rank() == ctx.root_rank else summed * 0), None, None, None


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    g = resolve_process_set(process_set)
    check_root(root_rank, runtime.size(), g)
    name = op_name(name, "broadcast", g)
    return session.submit(broadcast_tensor, tensor, root_rank, torch.empty_like(tensor), name,
                          g, label=name)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s value of ``tensor`` on every rank (a new tensor)."""
    g = resolve_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, op_name(name, "broadcast", g), g)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    g = resolve_process_set(process_set)
    check_root(root_rank, runtime.size(), g)
    name = op_name(name, "broadcast", g)
    return session.submit(broadcast_tensor, tensor, root_rank, tensor, name, g, label=name)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast from ``root_rank``; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    g = resolve_process_set(process_set)
    name = op_name(name, "alltoall", g)
    return session.submit(lambda: alltoall_rows(tensor, splits, name, g)
                          if splits is not None else alltoall_rows(tensor, None, name, g)[0],
                          label=name)


class _Alltoall(torch.autograd.Function):
    """Alltoall with Horovod's gradient: the reverse alltoall, with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, group):
        out, received = session.run(alltoall_rows, tensor, splits, name, group, label=name)
        ctx.received, ctx.name, ctx.group = received, name, group
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _received):
        back, _ = session.run(alltoall_rows, grad.contiguous(), ctx.received, ctx.name + ".grad",
                              ctx.group, label=ctx.name)
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send slices of ``tensor`` (dim 0, by ``splits`` or equally) to every rank.

    Differentiable, as Horovod's: the gradient of the received rows goes back to their
    senders (the reverse alltoall, with the received splits).

    Returns:
        The received rows; with ``splits``, also the int32 counts received per rank.
    """
    g = resolve_process_set(process_set)
    out, received = _Alltoall.apply(tensor, splits, op_name(name, "alltoall", g), g)
    return out if splits is None else (out, received)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    g = resolve_process_set(process_set)
    op = resolve_op(op, None)
    name = op_name(name, "reducescatter", g)
    return session.submit(reducescatter_rows, tensor, op, prescale_factor, postscale_factor,
                          name, None, g, label=name)


class _Reducescatter(torch.autograd.Function):
    """Reduce-scatter with Horovod's gradient: the output gradient, multiplied by the number
    of ranks for Sum (not divided for Average) and scaled like the forward, allgathered."""

    @staticmethod
    def forward(ctx, tensor, op, pre, post, name, compression, group):
        ctx.args = (op, pre, post, name, group)
        return session.run(reducescatter_rows, tensor, op, pre, post, name, compression, group,
                           label=name)

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, name, group = ctx.args
        full = session.run(allgather_rows, grad.contiguous(), name + ".grad", group, label=name)
        scale = pre * post * (group_size(group) if op is Sum else 1)
        return (full * scale if scale != 1.0 else full), None, None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks and keep this rank's rows of dim 0.

    Rows are split like Horovod: ``rows // size`` each, the first ``rows % size``
    ranks one more. The gradient is Horovod's: the output gradient times the
    number of ranks for Sum (as is for Average), allgathered. A real
    reduce-scatter (half an allreduce's traffic); with
    ``compression=Compression.quantize(...)`` the other ranks' rows travel
    quantized (the first half of SRA).
    """
    g = resolve_process_set(process_set)
    op = resolve_op(op, None)
    return _Reducescatter.apply(tensor, op, prescale_factor, postscale_factor,
                                op_name(name, "reducescatter", g), compression, g)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start reduce-scatters of several tensors; the handle yields a list (Horovod's order)."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, None)
    name = op_name(name, "grouped_reducescatter", g)
    tensors = list(tensors)
    return session.submit(lambda: [reducescatter_rows(t, op, prescale_factor, postscale_factor,
                                                      f"{name}.{i}", None, g)
                                   for i, t in enumerate(tensors)], label=name)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    """Reduce-scatter of each tensor of a list (with gradients); returns a list."""
    name = op_name(name, "grouped_reducescatter", resolve_process_set(process_set))
    return [reducescatter(t, f"{name}.{i}", compression, op, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start allgathers of several tensors; the handle yields a list."""
    g = resolve_process_set(process_set)
    name = op_name(name, "grouped_allgather", g)
    tensors = list(tensors)
    return session.submit(lambda: [allgather_rows(t, f"{name}.{i}", g)
                                   for i, t in enumerate(tensors)], label=name)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather of each tensor of a list (with gradients); returns a list."""
    g = resolve_process_set(process_set)
    name = op_name(name, "grouped_allgather", g)
    return [_Allgather.apply(t, f"{name}.{i}", g) for i, t in enumerate(tensors)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Horovod's sparse allreduce: every rank's (indices, values) allgathered, the values
    divided by the number of ranks for Average. The handle yields a sparse COO tensor
    (uncoalesced, as Horovod's)."""
    g = resolve_process_set(process_set)
    op = resolve_op(op, None)
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce supports op Average or Sum, got {op!r}")
    if not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async takes a sparse COO tensor (e.g. the gradient "
                        "of nn.Embedding(sparse=True)); use allreduce_async for dense ones")
    name = op_name(name, "sparse_allreduce", g)
    return session.submit(sparse_reduce, tensor, op, name, g, label=name)


# -- handles and synchronization ----------------------------------------------------

def poll(handle) -> bool:
    """True when the operation behind ``handle`` has finished (never blocks)."""
    return handle.poll()


def synchronize(handle) -> Any:
    """Wait for ``handle`` and return the operation's result."""
    return handle.wait(session.wait_timeout())


def barrier(process_set=global_process_set) -> None:
    """Block until every rank (of ``process_set``) arrives."""
    g = resolve_process_set(process_set)
    session.run(lambda: session.reducer_of(g).transport.barrier(), label="barrier")


def join(device=-1) -> int:
    """Signal that this rank has no more data; returns the rank that joined last.

    A rank that joins early keeps taking part, with zeros, in the other ranks'
    ``DistributedOptimizer`` steps and allreduces (op Sum or Average,
    uncompressed or quantized) until every rank has joined, as with Horovod
    (an average still divides by every rank). Other collectives (allgather,
    broadcast, ...) raise a ``CollectiveMismatchError`` (a ``RuntimeError``)
    on the ranks still running meanwhile, and the job goes on. Covers the
    global process set.
    """
    from cgx.torch.join import join_world
    return join_world()


def is_initialized() -> bool:
    return runtime.is_initialized()
