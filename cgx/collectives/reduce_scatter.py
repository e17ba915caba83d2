"""Reduce-scatter of one tensor along its first dimension (Horovod's ``reducescatter``).

Rank ``c`` receives rows ``[start_c, start_c + rows_c)`` of the reduced tensor, with
Horovod's split: ``rows // W`` rows each, the first ``rows % W`` ranks one more.

Two real reduce-scatters, each moving ``(W - 1) / W`` of the tensor per rank (half of
an allreduce):

* **compressed**: the first half of SRA (``algorithms.sra_scatter``) on a block whose
  chunk ``c`` is rank ``c``'s rows: every rank quantizes the other ranks' rows, one
  all-to-all, and each rank adds the decoded contributions to its own rows (which never
  leave it, so they are not quantized); with a ``residual`` (error feedback), what the
  quantization of the other ranks' rows dropped is kept there and added back next time;
* **exact**: an all-to-all of the row slices (padded to the largest), then the
  reduction of the ``W`` slices in rank order on each rank, any dtype and op.
"""

from __future__ import annotations

import time
import zlib

import torch

from cgx.comm.base import ReduceOp, Transport, count_sent, scale_
from cgx.quant import wire
from cgx.quant.codec import FLOAT_DTYPES, QuantSpec
from cgx.collectives.algorithms import ReduceContext, sra_scatter
from cgx.collectives.layout import Block, Piece


def split_rows(rows: int, world: int) -> list[int]:
    """Rows per rank, Horovod's way: ``rows // world``, the first ``rows % world`` one more."""
    base, extra = divmod(rows, world)
    return [base + (1 if c < extra else 0) for c in range(world)]


def reduce_scatter(tensor: torch.Tensor, transport: Transport, op: ReduceOp, pre: float = 1.0,
                   post: float = 1.0, spec: QuantSpec | None = None, *, name: str = "",
                   seed: int = 0, step: int = 0, threads: int = 1,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """This rank's rows of the reduction of ``tensor`` over ``transport``.

    Args:
        tensor: contiguous, at least 1-D, on ``transport.device``; not modified.
        spec: quantize (float dtypes, op Sum/Average only), or None for exact.
        residual: error feedback for the quantized path: a contiguous float32 tensor
            with ``tensor``'s numel, kept by the caller across calls (in input units, see
            ``algorithms.ReduceContext``; its non-finite entries are zeroed after a call
            with inf/NaN input). Unused when the reduction is exact.

    Returns:
        (rows of the result, bytes this rank handed to the transport for sending).
    """
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    W = transport.size
    counts = split_rows(tensor.shape[0], W)
    starts = [sum(counts[:c]) for c in range(W)]
    scale = post / W if op is ReduceOp.AVERAGE else post
    x = tensor.clone()
    scale_(x, pre)
    if W == 1:
        return scale_(x, scale), 0
    if spec is not None and (op not in (ReduceOp.SUM, ReduceOp.AVERAGE)
                             or x.dtype not in FLOAT_DTYPES):
        spec = None
    if spec is not None:
        return _quantized(x, transport, spec, counts, starts, scale, name=name, seed=seed,
                          step=step, threads=threads, residual=residual)
    return _exact(x, transport, op, counts, starts, scale)


def record(reducer, tensor: torch.Tensor, sent: int, t0: float) -> None:
    """Count one reduce-scatter in ``reducer``'s statistics."""
    from cgx.collectives.reducer import ReduceStats
    reducer.add_stats(ReduceStats(calls=1, numel=tensor.numel(),
                                  input_bytes=tensor.numel() * tensor.element_size(),
                                  wire_bytes=sent,
                                  seconds={"total": time.perf_counter() - t0}))


def _quantized(x, transport, spec, counts, starts, scale, *, name, seed, step, threads,
               residual=None):
    """SRA's first half: each rank's rows quantized to their owner, summed there."""
    W, r = transport.size, transport.rank
    row_len = x[0].numel() if x.shape[0] else 0
    flat = x.view(-1)
    pieces = []
    for c in range(W):
        n = counts[c] * row_len
        pieces.append((Piece(0, starts[c] * row_len, n, starts[c] * row_len, 0,
                             wire.packed_nbytes(n, spec.bits, spec.bucket_size), spec),)
                      if n else ())
    slot = max((p[0].nbytes for p in pieces if p), default=0)
    block = Block(0, flat.numel(), tuple(pieces), slot)
    ctx = ReduceContext([flat], transport, seed=seed, step=step,
                        buffer_id=zlib.crc32(name.encode()) if name else 0,
                        threads=threads,
                        residuals=None if residual is None else [_residual_view(residual, flat)])
    with count_sent() as sent:
        for work in sra_scatter(ctx, block):
            work.wait()
    if residual is not None:
        sanitize_residual(residual)
    mine = x[starts[r]: starts[r] + counts[r]]
    return scale_(mine.clone(), scale), sent.total


def _residual_view(residual: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    if residual.dtype != torch.float32 or residual.numel() != flat.numel() \
            or not residual.is_contiguous() or residual.device != flat.device:
        raise ValueError(f"residual must be a contiguous float32 tensor of {flat.numel()} values "
                         f"on {flat.device} (the input's), got {residual.dtype} "
                         f"{tuple(residual.shape)} on {residual.device}")
    return residual.view(-1)


def sanitize_residual(residual: torch.Tensor) -> None:
    """Zero the non-finite entries of ``residual`` after a call with inf/NaN input (as the
    allreduce's residuals are): the step stays non-finite, later steps start clean.
    Cost: one sum; the cleaning pass only after an overflow."""
    if residual.numel() and not torch.isfinite(residual.sum()):
        torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)


def _exact(x, transport, op, counts, starts, scale):
    """All-to-all of the row slices (as bytes), reduced here in rank order."""
    W, r = transport.size, transport.rank
    send = torch.view_as_real(x) if x.is_complex() else (
        x.to(torch.int32) if x.dtype == torch.bool else x)
    width = max(counts) * send[0].numel() * send.element_size() if send.shape[0] else 0
    out = torch.zeros(W * width, dtype=torch.uint8, device=x.device)
    src = send.reshape(-1).view(torch.uint8) if send.numel() else out[:0]
    per_row = send[0].numel() * send.element_size() if send.shape[0] else 0
    for c in range(W):
        out[c * width: c * width + counts[c] * per_row] = \
            src[starts[c] * per_row: (starts[c] + counts[c]) * per_row]
    recv = torch.empty_like(out)
    with count_sent() as sent:
        if width:
            transport.alltoall(recv, out)
            parts = recv.view(W, width)[:, : counts[r] * per_row].contiguous().view(send.dtype)
            parts = parts.view((W, counts[r]) + tuple(send.shape[1:]))
        else:  # nothing to move: no rows, or rows of no values
            parts = torch.zeros((W, counts[r]) + tuple(send.shape[1:]), dtype=send.dtype,
                                device=x.device)
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        red = parts.sum(0, dtype=send.dtype)
    elif op is ReduceOp.MIN:
        red = parts.amin(0)
    elif op is ReduceOp.MAX:
        red = parts.amax(0)
    else:
        red = parts.prod(0, dtype=send.dtype)
    scale_(red, scale)
    if x.is_complex():
        red = torch.view_as_complex(red.contiguous())
    elif x.dtype == torch.bool:
        red = red != 0
    return red, sent.total
