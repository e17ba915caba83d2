"""Horovod's functional collectives behind both adapters' APIs, on torch tensors.

``cgx.torch`` and ``cgx.tensorflow`` expose Horovod's functions
(``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ...); the work
itself is written once here, on torch tensors, and runs on the shared engine
thread and a process set's reducer (``cgx.session``, a layer below): the adapters
only convert tensors, add autograd, and choose between synchronous and
asynchronous calls.

Also here: Horovod's reduction-op names and argument rules. Every function takes
``group``: None for the world, or a process set resolved by
:func:`cgx.process_sets.resolve` on the caller's thread (``root_rank`` stays a global rank).
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Any

import torch

from cgx import process_sets, runtime, session
from cgx.collectives import joining, reduce_scatter
from cgx.comm.base import ReduceOp
from cgx.comm.consistency import signature, tensor_fields
from cgx.compression import Family, as_compressor
from cgx.quant.codec import FLOAT_DTYPES, QuantSpec
from cgx.errors import CollectiveMismatchError

Average, Sum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX,
                                   ReduceOp.PRODUCT)


class Adasum:
    """Placeholder so that ``op=hvd.Adasum`` fails with a clear message."""


_names: dict = collections.defaultdict(itertools.count)


def resolve_process_set(process_set):
    """The ``group`` argument of this module's functions for Horovod's ``process_set=``
    (caller's thread); ValueError if this rank may not use it."""
    return process_sets.resolve(process_set)


def group_size(group) -> int:
    return runtime.size() if group is None else len(group.ranks)


def group_rank(group) -> int:
    return runtime.rank() if group is None else group.ranks.index(runtime.rank())


def _transport(group):
    return session.reducer_of(group).transport


def resolve_op(op, average) -> ReduceOp:
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


def op_name(name, kind: str, group=None) -> str:
    """``name``, or an auto-generated ``<kind>.noname.<n>``: one sequence per process set, the
    same on each of its ranks (collectives of other sets do not shift it)."""
    if name is not None:
        return name
    n = next(_names[None if group is None else tuple(group.ranks)])
    return f"{kind}.noname.{n}"


def check(kind: str, name: str, group=None, joined_call=None, **fields) -> None:
    """Engine thread: the collective's status exchange (``cgx.collectives.joining``), before it
    runs: every rank agrees on it (CGX_CHECK_CONSISTENCY), and ranks that called ``join()``
    follow. An allreduce passes ``joined_call``, the description a joined rank needs to
    take part with zeros (:func:`answer_joined`); other collectives are refused while a
    rank has joined, as in Horovod.

    Raises:
        CollectiveMismatchError: on every rank, naming the fields that differ; on the ranks
            that have not joined, when a collective without ``joined_call`` meets a joined one.
    """
    tr = _transport(group)
    if tr.size == 1:
        return
    sig = signature(kind, name, **fields) if runtime.config().check_consistency else None
    status = joining.exchange(tr, joining.OTHER if joined_call is None else joining.ALLREDUCE,
                              sig)
    if not status.joined:
        return
    if joined_call is None:
        raise CollectiveMismatchError(
            f"{kind} '{name}' cannot run while a rank has called join(): until every rank "
            "has joined, the others may only allreduce (op Sum or Average, uncompressed or "
            "quantized) and step a DistributedOptimizer, as in Horovod")
    tr.broadcast_object(joined_call if tr.rank == status.root else None, status.root)


def answer_joined(root: int, group=None) -> None:
    """Engine thread, on a rank that called ``join()``, after a status exchange announced a
    functional allreduce: take part in it with zeros of the shapes ``root`` describes."""
    tr = _transport(group)
    shapes, dtypes, op, pre, post, name, compression = tr.broadcast_object(None, root)
    zeros = [torch.zeros(s, dtype=d, device=tr.device) for s, d in zip(shapes, dtypes)]
    _reduce(zeros, op, pre, post, name, compression, group)


def check_root(root_rank, size: int, group=None) -> int:
    """Validate a global ``root_rank``; returns it as a rank of ``group``."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or \
            not 0 <= root_rank < size:
        raise ValueError(f"root_rank must be a rank, an int in [0, {size}), got {root_rank!r}")
    return process_sets.global_rank_to_set_rank(group, root_rank)


def _on_transport(t: torch.Tensor, group=None) -> torch.Tensor:
    dev = _transport(group).device
    return t if t.device == dev else t.to(dev)


# -- reductions -------------------------------------------------------------------

def reduce_tensors(tensors: list[torch.Tensor], op: ReduceOp, pre: float, post: float,
                   name: str, compression, group=None) -> list[torch.Tensor]:
    """Reduce copies of ``tensors`` over the world and return them (engine thread).

    ``compression``: None or ``Compression.none`` (exact), a cast (summable
    payloads, one plain allreduce), quantization (the fused SRA path; float64
    travels exact), or top-k/PowerSGD (their own reduction, per tensor).
    """
    comp = None if compression is None else as_compressor(compression)
    # What a rank that called join() runs to take part: the same reduction of zeros. Only
    # where zeros are neutral and the path keeps no per-rank state: Sum/Average, exact or
    # quantized (a cast or a user's compressor may not even pickle).
    joined_call = ([tuple(t.shape) for t in tensors], [t.dtype for t in tensors], op, pre, post,
                   name, comp) if op in (ReduceOp.SUM, ReduceOp.AVERAGE) and (
        comp is None or comp.family is Family.EXACT or _quantized(comp, op)) else None
    check("allreduce", name, group, joined_call, op=op, prescale_factor=pre,
          postscale_factor=post, compression=comp, **tensor_fields(tensors))
    outs = [_on_transport(t.detach(), group).clone().contiguous() for t in tensors]
    outs = _reduce(outs, op, pre, post, name, comp, group)
    return [o.to(t.device) if o.device != t.device else o for o, t in zip(outs, tensors)]


def _quantized(comp, op) -> bool:
    """Does this compressor take the fused quantized (SRA) path?"""
    return comp.family is Family.QUANTIZE and op in (ReduceOp.SUM, ReduceOp.AVERAGE) \
        and hasattr(comp, "bits")


def _reduce(outs: list, op: ReduceOp, pre: float, post: float, name: str, comp,
            group=None) -> list:
    """Engine thread: the reduction itself, of ``outs`` (contiguous copies on the transport's
    device, reduced in place where the path allows); returns the results."""
    red = session.reducer_of(group)
    if comp is None or comp.family is Family.EXACT:
        red.allreduce(outs, None, op=op, prescale_factor=pre, postscale_factor=post, name=name)
    elif _quantized(comp, op):
        spec = QuantSpec(comp.bits, comp.bucket_size, comp.rounding, getattr(comp, "rotate", False))
        specs = [spec if t.dtype in FLOAT_DTYPES and t.numel() > 0 else None for t in outs]
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
    return outs


# -- allgather, broadcast, alltoall, reducescatter ---------------------------------

def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8) if t.numel() else \
        torch.empty(0, dtype=torch.uint8, device=t.device)


def allgather_rows(tensor: torch.Tensor, name: str = "allgather", group=None) -> torch.Tensor:
    tr = _transport(group)
    check("allgather", name, group, **tensor_fields([tensor], skip_first_dim=True),
          ndim=tensor.dim())
    t = _on_transport(tensor.detach(), group).contiguous()
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


def sparse_reduce(tensor: torch.Tensor, op: ReduceOp, name: str, group=None) -> torch.Tensor:
    """Horovod's sparse allreduce of a COO tensor (engine thread): every rank's indices and
    values all-gathered, the values divided by the number of ranks for Average. The result
    is uncoalesced, as Horovod's."""
    t = tensor.coalesce()
    # Allgather concatenates along dim 0: indices travel transposed (nnz x ndim).
    indices = allgather_rows(t.indices().t().contiguous(), f"{name}.indices", group)
    values = allgather_rows(t.values().contiguous(), f"{name}.values", group)
    if op is ReduceOp.AVERAGE:
        values = values / group_size(group)
    return torch.sparse_coo_tensor(indices.t(), values, t.size())


def broadcast_tensor(tensor: torch.Tensor, root_rank: int, out: torch.Tensor,
                     name: str = "broadcast", group=None) -> torch.Tensor:
    tr = _transport(group)
    root = check_root(root_rank, runtime.size(), group)
    check("broadcast", name, group, root_rank=root_rank, **tensor_fields([tensor]))
    buf = _on_transport(tensor.detach(), group).clone().contiguous()
    tr.broadcast(_bytes(buf), root)  # as bytes: every dtype, bit-exact (Gloo lacks uint16...)
    out.copy_(buf.view_as(out))
    return out


def alltoall_rows(tensor: torch.Tensor, splits, name: str = "alltoall", group=None) -> tuple:
    tr = _transport(group)
    check("alltoall", name, group, **tensor_fields([tensor], skip_first_dim=True),
          ndim=tensor.dim(), splits_given=splits is not None)
    t = _on_transport(tensor.detach(), group).contiguous()
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


def reducescatter_rows(tensor, op, pre, post, name, compression, group=None):
    """This rank's rows of the reduction (Horovod's split of the first dimension).

    Exact and quantized: a real reduce-scatter (``cgx.collectives.reduce_scatter``),
    half an allreduce's traffic. Other compressors (casts, top-k, PowerSGD): their
    allreduce, then this rank's rows.
    """
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    comp = None if compression is None else as_compressor(compression)
    if comp is not None and comp.family is not Family.EXACT and not (
            comp.family is Family.QUANTIZE and hasattr(comp, "bits")):
        full = reduce_tensors([tensor], op, pre, post, name, compression, group)[0]
        counts = reduce_scatter.split_rows(full.shape[0], group_size(group))
        r = group_rank(group)
        return full[sum(counts[:r]): sum(counts[:r + 1])].clone()
    red = session.reducer_of(group)
    check("reducescatter", name, group, op=op, prescale_factor=pre, postscale_factor=post,
          compression=comp, **tensor_fields([tensor]))
    spec = QuantSpec(comp.bits, comp.bucket_size, comp.rounding, getattr(comp, "rotate", False)) \
        if comp is not None and comp.family is Family.QUANTIZE else None
    t0 = time.perf_counter()
    cfg = red.config
    out, sent = reduce_scatter.reduce_scatter(
        _on_transport(tensor.detach(), group).contiguous(), red.transport, op, pre, post, spec,
        name=name, seed=cfg.seed, step=red.calls, threads=cfg.cpu_threads)
    red.calls += 1
    reduce_scatter.record(red, tensor, sent, t0)
    return out.to(tensor.device)


def broadcast_tensors(tensors: list, root_rank: int, name: str = "broadcast",
                      group=None) -> None:
    """In-place broadcast of many tensors, fused into one buffer per dtype and device."""
    tr = _transport(group)
    root = check_root(root_rank, runtime.size(), group)
    check("broadcast", name, group, root_rank=root_rank, **tensor_fields(tensors))
    groups = collections.defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    for (_dtype, device), group in groups.items():
        flat = torch.cat([t.detach().reshape(-1).to(tr.device) for t in group])
        tr.broadcast(_bytes(flat), root)  # as bytes, like broadcast_tensor
        for t, part in zip(group, flat.split([t.numel() for t in group])):
            with torch.no_grad():
                t.copy_(part.view_as(t).to(device))


# -- Python objects ----------------------------------------------------------------

def broadcast_object(obj: Any = None, root_rank: int = 0, name: str = None, group=None) -> Any:
    """``root_rank``'s ``obj`` (pickled) on every rank."""
    root = check_root(root_rank, runtime.size(), group)
    if group_size(group) == 1:
        return obj
    name = name or "broadcast_object"

    def run():
        check("broadcast_object", name, group, root_rank=root_rank)
        return _transport(group).broadcast_object(obj, root)

    return session.run(run, label=name)


def allgather_object(obj: Any, name: str = None, group=None) -> list:
    """Every rank's ``obj`` (pickled), as a list in rank order."""
    if group_size(group) == 1:
        return [obj]
    name = name or "allgather_object"

    def run():
        check("allgather_object", name, group)
        return _transport(group).allgather_object(obj)

    return session.run(run, label=name)
