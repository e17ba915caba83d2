"""Horovod-compatible collectives on torch tensors (``horovod.torch.mpi_ops``).

Same names, signatures and defaults as Horovod 0.28.1. Differences, by design:

* Handles are :class:`cgx.collectives.Handle` objects (Horovod returns ints);
  use them the same way, with ``poll()`` and ``synchronize()``.
* The functional ``allreduce`` is exact unless a ``compression`` is passed
  (gradient compression from the environment applies to
  ``DistributedOptimizer`` and the DDP hook, not to metric averaging).
* ``process_set`` accepts only the global set; ``op=Adasum`` is not supported.
* ``reducescatter`` reduces the whole tensor and keeps this rank's rows.
"""

from __future__ import annotations

import itertools
from typing import Any, List, Optional

import torch

from cgx import runtime
from cgx.comm.base import ReduceOp
from cgx.compression import Compression, CompressorKind, as_compressor
from cgx.compression.quantization import QuantSpec
from cgx import session

Average, Sum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX,
                                   ReduceOp.PRODUCT)


class Adasum:
    """Placeholder so that ``op=hvd.Adasum`` fails with a clear message."""


class ProcessSet:
    """The global process set (the only one cgx supports)."""

    def size(self) -> int:
        return runtime.size()

    def rank(self) -> int:
        return runtime.rank()

    def included(self) -> bool:
        return True


global_process_set = ProcessSet()
_names = itertools.count()


def _check_process_set(process_set) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise ValueError("cgx supports only the global process set; drop the process_set "
                         "argument (or pass cgx.torch.global_process_set)")


def handle_average_backwards_compatibility(op, average) -> ReduceOp:
    """Horovod's rule: ``average`` (deprecated) and ``op`` are exclusive; default Average."""
    if op is not None and average is not None:
        raise ValueError("op and average cannot both be given; use op= (average is deprecated)")
    if op is Adasum or op is not None and getattr(op, "__name__", "") == "Adasum":
        raise ValueError("op=Adasum is not supported by cgx; use Average or Sum")
    if op is None:
        return ReduceOp.AVERAGE if average is None or average else ReduceOp.SUM
    if not isinstance(op, ReduceOp):
        raise ValueError(f"op must be one of Average, Sum, Min, Max, Product; got {op!r}")
    return op


def _name(name: Optional[str], kind: str) -> str:
    return name if name is not None else f"{kind}.noname.{next(_names)}"


def _on_transport(t: torch.Tensor) -> torch.Tensor:
    dev = session.reducer().transport.device
    return t if t.device == dev else t.to(dev)


# -- allreduce ------------------------------------------------------------------

def _reduce_list(tensors: List[torch.Tensor], op: ReduceOp, pre: float, post: float,
                 name: str, compression) -> List[torch.Tensor]:
    """Runs on the engine thread: reduce copies of ``tensors`` and return them."""
    red = session.reducer()
    outs = [_on_transport(t.detach()).clone().contiguous() for t in tensors]
    comp = None if compression is None else as_compressor(compression)
    if comp is None or comp.kind is CompressorKind.NONE:
        red.allreduce(outs, None, op=op, prescale_factor=pre, postscale_factor=post, name=name)
    elif comp.kind is CompressorKind.QUANTIZE and op in (ReduceOp.SUM, ReduceOp.AVERAGE) \
            and hasattr(comp, "bits"):
        spec = QuantSpec(comp.bits, comp.bucket_size, comp.rounding)
        specs = [spec if t.is_floating_point() and t.numel() > 0 else None for t in outs]
        red.allreduce(outs, specs, op=op, prescale_factor=pre, postscale_factor=post, name=name)
    elif comp.summable:
        payloads, ctxs = zip(*(comp.compress_for_reduction(t.mul_(pre) if pre != 1 else t,
                                                           red.transport, name) for t in outs))
        engine_op = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        red.allreduce(list(payloads), None, op=engine_op, name=name)
        outs = [comp.decompress(p, c) for p, c in zip(payloads, ctxs)]
        scale = post / red.transport.size if op is ReduceOp.AVERAGE else post
        outs = [o.mul_(scale) if scale != 1.0 else o for o in outs]
    else:
        outs = [comp.allreduce(t.mul_(pre) if pre != 1 else t, red.transport, f"{name}.{i}", op)
                for i, t in enumerate(outs)]
        outs = [o.mul_(post) if post != 1.0 else o for o in outs]
    return [o.to(t.device) if o.device != t.device else o for o, t in zip(outs, tensors)]


class _Allreduce(torch.autograd.Function):
    """Allreduce with a gradient: the backward pass allreduces the gradient the same way."""

    @staticmethod
    def forward(ctx, op, pre, post, name, compression, *tensors):
        ctx.args = (op, pre, post, name, compression)
        return tuple(session.run(_reduce_list, list(tensors), op, pre, post, name, compression,
                                 label=name))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, name, compression = ctx.args
        out = session.run(_reduce_list, [g.contiguous() for g in grads], op, pre, post,
                          name + ".grad", compression, label=name)
        return (None, None, None, None, None, *out)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set):
    """Start an exact allreduce of a copy of ``tensor``; ``synchronize(handle)`` returns it."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    name = _name(name, "allreduce")
    return session.submit(lambda: _reduce_list([tensor], op, prescale_factor, postscale_factor,
                                               name, None)[0], label=name)


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
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    return _Allreduce.apply(op, prescale_factor, postscale_factor, _name(name, "allreduce"),
                            compression, tensor)[0]


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set):
    """In-place form of :func:`allreduce_async`: ``synchronize`` writes into ``tensor``."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    name = _name(name, "allreduce")

    def work():
        tensor.copy_(_reduce_list([tensor], op, prescale_factor, postscale_factor, name, None)[0])
        return tensor

    return session.submit(work, label=name)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce; returns ``tensor``."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set):
    """Start one fused allreduce of several tensors; the handle yields a list."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    name = _name(name, "grouped_allreduce")
    tensors = list(tensors)
    return session.submit(_reduce_list, tensors, op, prescale_factor, postscale_factor, name,
                          None, label=name)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Fused allreduce of a list of tensors (one collective for all); returns a list."""
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    return list(_Allreduce.apply(op, prescale_factor, postscale_factor,
                                 _name(name, "grouped_allreduce"), compression, *tensors))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set):
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, average)
    name = _name(name, "grouped_allreduce")
    tensors = list(tensors)

    def work():
        for t, o in zip(tensors, _reduce_list(tensors, op, prescale_factor, postscale_factor,
                                              name, None)):
            t.copy_(o)
        return tensors

    return session.submit(work, label=name)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather, broadcast, alltoall, reducescatter --------------------------------

def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else \
        torch.empty(0, dtype=torch.uint8, device=t.device)


def _allgather_impl(tensor: torch.Tensor) -> torch.Tensor:
    tr = session.reducer().transport
    t = _on_transport(tensor.detach()).contiguous()
    rows = torch.tensor([t.shape[0] if t.dim() else 1], dtype=torch.int64, device=tr.device)
    all_rows = torch.empty(tr.size, dtype=torch.int64, device=tr.device)
    tr.allgather(all_rows.view(torch.uint8), rows.view(torch.uint8))
    all_rows = all_rows.tolist()
    row_bytes = t[0].numel() * t.element_size() if t.dim() and t.shape[0] else \
        (t.numel() * t.element_size() if not t.dim() else 0)
    if t.dim() and t.shape[0] == 0:
        row_bytes = int(torch.tensor(t.shape[1:]).prod().item()) * t.element_size() \
            if t.dim() > 1 else t.element_size()
    width = max(all_rows) * row_bytes
    send = torch.zeros(width, dtype=torch.uint8, device=tr.device)
    send[: t.numel() * t.element_size()] = _bytes(t)
    recv = torch.empty(width * tr.size, dtype=torch.uint8, device=tr.device)
    tr.allgather(recv, send)
    parts = [recv[r * width: r * width + n * row_bytes] for r, n in enumerate(all_rows)]
    flat = torch.cat(parts).view(t.dtype)
    shape = (sum(all_rows),) + tuple(t.shape[1:]) if t.dim() else (tr.size,)
    return flat.view(shape).to(tensor.device)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        return session.run(_allgather_impl, tensor, label=name)

    @staticmethod
    def backward(ctx, grad):
        summed = session.run(_reduce_list, [grad.contiguous()], ReduceOp.SUM, 1.0, 1.0,
                             "allgather.grad", None)[0]
        rows = session.run(_allgather_impl, torch.tensor([ctx.rows]))
        start = int(rows[: runtime.rank()].sum().item())
        return summed[start: start + ctx.rows].view_as(grad[: ctx.rows]) if grad.dim() else \
            summed[runtime.rank()], None


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start gathering every rank's ``tensor`` along dim 0 (first dims may differ)."""
    _check_process_set(process_set)
    return session.submit(_allgather_impl, tensor, label=_name(name, "allgather"))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0 (first dims may differ); returns it."""
    _check_process_set(process_set)
    return _Allgather.apply(tensor, _name(name, "allgather"))


def _broadcast_impl(tensor: torch.Tensor, root_rank: int, out: torch.Tensor) -> torch.Tensor:
    tr = session.reducer().transport
    if not 0 <= root_rank < tr.size:
        raise ValueError(f"root_rank={root_rank} is not a rank (world size {tr.size})")
    buf = _on_transport(tensor.detach()).clone().contiguous()
    tr.broadcast(buf, root_rank)
    out.copy_(buf.view_as(out))
    return out


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return session.run(_broadcast_impl, tensor, root_rank, torch.empty_like(tensor), label=name)

    @staticmethod
    def backward(ctx, grad):
        summed = session.run(_reduce_list, [grad.contiguous()], ReduceOp.AVERAGE, 1.0, 1.0,
                             "broadcast.grad", None)[0]
        return (summed if runtime.rank() == ctx.root_rank else summed * 0), None, None


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    _check_process_set(process_set)
    return session.submit(_broadcast_impl, tensor, root_rank, torch.empty_like(tensor),
                          label=_name(name, "broadcast"))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s value of ``tensor`` on every rank (a new tensor)."""
    _check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank, _name(name, "broadcast"))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    _check_process_set(process_set)
    return session.submit(_broadcast_impl, tensor, root_rank, tensor,
                          label=_name(name, "broadcast"))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place broadcast from ``root_rank``; returns ``tensor``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def _alltoall_impl(tensor: torch.Tensor, splits) -> tuple:
    tr = session.reducer().transport
    t = _on_transport(tensor.detach()).contiguous()
    W = tr.size
    rows = t.shape[0] if t.dim() else 0
    if splits is None:
        if rows % W:
            raise ValueError(f"alltoall without splits needs the first dimension ({rows}) to be "
                             f"divisible by the number of ranks ({W}); pass splits=")
        send_splits = torch.full((W,), rows // W, dtype=torch.int64)
    else:
        send_splits = torch.as_tensor(splits, dtype=torch.int64).cpu().view(-1)
        if send_splits.numel() != W or (send_splits < 0).any() or int(send_splits.sum()) != rows:
            raise ValueError(f"splits must hold {W} non-negative counts summing to the first "
                             f"dimension ({rows}); got {send_splits.tolist()}")
    recv_splits = torch.empty(W, dtype=torch.int64, device=tr.device)
    tr.alltoall(recv_splits.view(torch.uint8), send_splits.to(tr.device).view(torch.uint8))
    row_bytes = (t[0].numel() if rows else int(torch.tensor(t.shape[1:]).prod().item())) \
        * t.element_size()
    most = torch.tensor([int(send_splits.max())], dtype=torch.int64, device=tr.device)
    tr.allreduce(most, ReduceOp.MAX)
    width = int(most.item()) * row_bytes
    send = torch.zeros(W * width, dtype=torch.uint8, device=tr.device)
    src, off = _bytes(t), 0
    for j, n in enumerate(send_splits.tolist()):
        send[j * width: j * width + n * row_bytes] = src[off: off + n * row_bytes]
        off += n * row_bytes
    recv = torch.empty(W * width, dtype=torch.uint8, device=tr.device)
    tr.alltoall(recv, send)
    rs = recv_splits.cpu().tolist()
    out = torch.cat([recv[j * width: j * width + n * row_bytes] for j, n in enumerate(rs)])
    out = out.view(t.dtype).view((sum(rs),) + tuple(t.shape[1:])).to(tensor.device)
    return out, torch.tensor(rs, dtype=torch.int32)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    _check_process_set(process_set)
    return session.submit(lambda: _alltoall_impl(tensor, splits)
                          if splits is not None else _alltoall_impl(tensor, None)[0],
                          label=_name(name, "alltoall"))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send slices of ``tensor`` (dim 0, by ``splits`` or equally) to every rank.

    Returns:
        The received rows; with ``splits``, also the int32 counts received per rank.
    """
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def _reducescatter_impl(tensor, op, pre, post, name, compression):
    full = _reduce_list([tensor], op, pre, post, name, compression)[0]
    W, r = runtime.size(), runtime.rank()
    rows = full.shape[0]
    base, extra = divmod(rows, W)
    start = r * base + min(r, extra)
    return full[start: start + base + (1 if r < extra else 0)].clone()


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0):
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, None)
    name = _name(name, "reducescatter")
    return session.submit(_reducescatter_impl, tensor, op, prescale_factor, postscale_factor,
                          name, None, label=name)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks and keep this rank's rows of dim 0.

    Rows are split like Horovod: ``rows // size`` each, the first ``rows % size``
    ranks one more.
    """
    _check_process_set(process_set)
    op = handle_average_backwards_compatibility(op, None)
    name = _name(name, "reducescatter")
    return session.run(_reducescatter_impl, tensor, op, prescale_factor, postscale_factor, name,
                       compression, label=name)


# -- handles and synchronization ----------------------------------------------------

def poll(handle) -> bool:
    """True when the operation behind ``handle`` has finished (never blocks)."""
    return handle.poll()


def synchronize(handle) -> Any:
    """Wait for ``handle`` and return the operation's result."""
    return handle.wait(runtime.config().timeout_s)


def barrier(process_set=global_process_set) -> None:
    """Block until every rank arrives."""
    _check_process_set(process_set)
    session.run(lambda: session.reducer().transport.barrier(), label="barrier")


def join(device=-1) -> int:
    """Signal that this rank has no more data; returns the rank that joined last.

    A rank that joins early keeps taking part in the other ranks' gradient
    reductions (with zero gradients) until every rank has joined, as with
    Horovod. This covers ``DistributedOptimizer`` steps; other collectives
    issued by the still-running ranks meanwhile are not matched.
    """
    from cgx.torch import optimizer as _opt
    return _opt.join_world()


def is_initialized() -> bool:
    return runtime.is_initialized()
