"""Compressed allreduce algorithms, written once over the Transport interface.

All three reduce a list of flat float tensors in place (the fused
*segments*, see ``layout.py``) and leave bit-identical values on every rank:
whatever a rank keeps of its own reduction is the decoded form of the bytes
it sent, because the final quantization writes its decoded values back
(``quantize(..., write_back=True)``).

SRA (scatter-reduce-allgather), per block::

    rank r quantizes chunk c for every peer c != r      (quantization 1)
    alltoall                                            every rank gets its chunk from all
    rank r adds the decoded peer chunks to its own chunk, scales
    rank r requantizes its chunk (write back)           (quantization 2)
    allgather                                           every rank decodes every chunk

RING: like SRA, but the reduce-scatter walks the ring in ``W - 1`` hops and
requantizes the running partial sum at each hop (``W - 1`` quantizations
before the final one); suits engines without a fast all-to-all.

ALLGATHER: every rank quantizes its whole buffer once, all-gathers, and sums
the ``W`` decoded buffers in rank order; one quantization, ``W`` times the
decoding work; good for 2-4 ranks and tiny buffers.

Error bound (nearest rounding, unit u of a bucket): SRA adds at most
``(W - 1) * u1 / 2`` in the scatter (each peer's contribution) and ``u2 / 2``
in the gather, where ``u1`` is the unit of the peer's bucket and ``u2`` of the
reduced bucket; stochastic rounding doubles these bounds but is unbiased.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional, Sequence

import torch

from cgx.comm.base import Transport
from cgx.quant import wire
from cgx.quant.codec import dequantize, quantize
from cgx.collectives import offload
from cgx.collectives.layout import Block, Piece, FusionLayout
from cgx.collectives.pipeline import BlockProgram, PhaseTimer
from cgx.config import ReductionType


@dataclasses.dataclass
class ReduceContext:
    """Everything a block program needs; one per fused allreduce call.

    Attributes:
        tensors: flat, contiguous float views of the fused tensors (reduced in place).
        transport: the group to reduce over.
        scale: factor applied to the reduced sum (1/W for average, times postscale).
        seed, step, buffer_id: stochastic-rounding key parts (same on every rank).
        timer: where phase times are summed.
        backend: quantization backend (see ``cgx.quant.codec.Backend``).
        residuals: optional error-feedback memory, one float32 tensor per entry of
            ``tensors`` (same numel), always in input units (this rank's values as
            given): for the chunks it quantizes for peers, what that quantization
            dropped; for the chunk it owns, what the final requantization dropped,
            divided by ``scale``. Both are added back (times ``scale`` for the owned
            chunk) before the next quantization, so the dropped parts telescope
            instead of accumulating; and because no value is in output units, a
            residual stays valid when the chunk boundaries move (another set of
            tensors fused, another world size) or is added to the next gradient
            when its tensor travels exact.
        placements: optional ``offload.Placement`` per entry of ``tensors``: with
            ``CPU_OFFLOAD``, a CUDA tensor's pieces are (de)quantized by the C path on
            pinned host copies (``cgx.collectives.offload``), with the same bytes and
            values; None, ``GPU`` or a CPU tensor: the codec as usual.
    """

    tensors: Sequence[torch.Tensor]
    transport: Transport
    scale: float = 1.0
    seed: int = 0
    step: int = 0
    buffer_id: int = 0
    timer: PhaseTimer = dataclasses.field(default_factory=PhaseTimer)
    backend: str = "auto"
    threads: int = 1  # CPU threads per (de)compression call (CGX_CPU_THREADS)
    residuals: Optional[Sequence[torch.Tensor]] = None
    placements: Optional[Sequence[offload.Placement]] = None

    def key(self, stage: int) -> int:
        return wire.noise_key(self.seed, self.step, self.buffer_id, stage)

    @property
    def rotation_key(self) -> int:
        """Key of rotated specs: the same for every rank and stage, so decoded sums commute."""
        return wire.rotation_key(self.seed, self.step, self.buffer_id)

    # -- piece-level helpers ---------------------------------------------------

    def values(self, p: Piece) -> torch.Tensor:
        return self.tensors[p.segment][p.offset: p.offset + p.numel]

    def _codec(self, p: Piece):
        """The (quantize, dequantize) pair for piece ``p``'s tensor."""
        if self.placements is not None and \
                self.placements[p.segment] is offload.Placement.CPU_OFFLOAD:
            return offload.quantize, offload.dequantize
        return quantize, dequantize

    def compress(self, pieces: Sequence[Piece], buf: torch.Tensor, base: int, stage: int,
                 write_back: bool = False, unit: float = 1.0) -> None:
        """Quantize ``pieces`` into ``buf``; ``write_back`` leaves their decoded values behind.

        With residuals, the values are first corrected by the residual and always
        written back (callers only quantize values they overwrite later anyway),
        and the residual becomes what this quantization dropped. ``unit``: the
        values are ``unit`` times input units (the owner's scaled sum); the
        residual stays in input units (one more pass over the piece).
        """
        key = self.key(stage)
        for p in pieces:
            x = self.values(p)
            out = buf[base + p.byte_offset: base + p.byte_offset + p.nbytes]
            encode = self._codec(p)[0]
            held = self.residuals[p.segment] if self.residuals is not None else None
            if held is None:
                encode(x, p.spec, out=out, key=key, index_offset=p.index,
                       write_back=write_back, backend=self.backend, threads=self.threads,
                       rotation_key=self.rotation_key)
                continue
            e = held[p.offset: p.offset + p.numel]
            if unit == 1.0:
                e.add_(x)  # e = v = x + old residual (3 extra passes: only with error feedback)
                x.copy_(e)
            else:
                x.add_(e, alpha=unit)
                e.copy_(x)
            encode(x, p.spec, out=out, key=key, index_offset=p.index, write_back=True,
                   backend=self.backend, threads=self.threads, rotation_key=self.rotation_key)
            e.sub_(x)  # e = v - decoded(v)
            if unit != 1.0:
                e.div_(unit)

    def decode(self, pieces: Sequence[Piece], buf: torch.Tensor, base: int,
               accumulate: bool) -> None:
        for p in pieces:
            decode = self._codec(p)[1]
            decode(buf[base + p.byte_offset: base + p.byte_offset + p.nbytes], p.numel, p.spec,
                   out=self.values(p), accumulate=accumulate, backend=self.backend,
                   threads=self.threads, rotation_key=self.rotation_key)

    def scale_meta(self, pieces: Sequence[Piece], buf: torch.Tensor, base: int) -> None:
        """Multiply every bucket's (unit, min) in ``buf`` by ``scale``.

        Max-min quantization is affine: a bucket of ``y`` quantized as
        (unit, min, codes) becomes a quantization of ``scale * y`` with
        (scale * unit, scale * min, the same codes). Scaling the few metadata
        floats before decoding replaces a full pass over the values (used by
        ALLGATHER, which decodes every rank's buffer anyway).
        """
        if self.scale == 1.0:
            return
        for p in pieces:
            nb = wire.num_buckets(p.numel, p.spec.bucket_size)
            start = base + p.byte_offset
            buf[start: start + 8 * nb].view(torch.float32).mul_(self.scale)

    def rescale(self, pieces: Sequence[Piece]) -> None:
        if self.scale != 1.0:
            for p in pieces:
                self.values(p).mul_(self.scale)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.transport.device)


def sra_scatter(ctx: ReduceContext, block: Block) -> BlockProgram:
    """Reduce-scatter half of SRA: afterwards chunk ``rank`` holds the (unscaled) sum."""
    t, r, W, S = ctx.transport, ctx.transport.rank, ctx.transport.size, block.slot_bytes
    if S == 0:
        return
    send, recv = ctx.empty(W * S), ctx.empty(W * S)
    with ctx.timer.time("compress"):
        for c in range(W):
            if c != r:
                ctx.compress(block.chunks[c], send, c * S, stage=1 + r)
    yield t.alltoall(recv, send, async_op=True)
    with ctx.timer.time("reduce"):
        for j in range(W):
            if j != r:
                ctx.decode(block.chunks[r], recv, j * S, accumulate=True)


def sra_gather(ctx: ReduceContext, block: Block, owned: int, owner_of=None) -> BlockProgram:
    """Allgather half: scale and requantize chunk ``owned``, then decode everyone's.

    ``owner_of(j)`` is the chunk rank ``j`` owns (identity for SRA).
    """
    t, r, W, S = ctx.transport, ctx.transport.rank, ctx.transport.size, block.slot_bytes
    if S == 0:
        return
    owner_of = owner_of or (lambda j: j)
    mine = block.chunks[owned]
    gsend, grecv = ctx.empty(S), ctx.empty(W * S)
    with ctx.timer.time("reduce"):
        ctx.rescale(mine)
        ctx.compress(mine, gsend, 0, stage=0, write_back=True, unit=ctx.scale)
    yield t.allgather(grecv, gsend, async_op=True)
    with ctx.timer.time("decompress"):
        for j in range(W):
            if j != r:
                ctx.decode(block.chunks[owner_of(j)], grecv, j * S, accumulate=False)


def sra_block(ctx: ReduceContext, block: Block) -> BlockProgram:
    yield from sra_scatter(ctx, block)
    yield from sra_gather(ctx, block, ctx.transport.rank)


def ring_block(ctx: ReduceContext, block: Block) -> BlockProgram:
    t, r, W, S = ctx.transport, ctx.transport.rank, ctx.transport.size, block.slot_bytes
    if S == 0:
        return
    nxt, prv = (r + 1) % W, (r - 1) % W
    send, recv = ctx.empty(S), ctx.empty(S)
    for hop in range(W - 1):
        c_send, c_recv = (r - hop) % W, (r - hop - 1) % W
        with ctx.timer.time("compress"):
            # From the second hop on, chunk c_send holds a partial sum: requantized here.
            ctx.compress(block.chunks[c_send], send, 0, stage=1 + hop * W + r)
        yield t.sendrecv(send, nxt, recv, prv, async_op=True)
        with ctx.timer.time("reduce"):
            ctx.decode(block.chunks[c_recv], recv, 0, accumulate=True)
    yield from sra_gather(ctx, block, (r + 1) % W, owner_of=lambda j: (j + 1) % W)


def allgather_block(ctx: ReduceContext, block: Block) -> BlockProgram:
    """Needs a plan made with ``world_size=1`` (one chunk per block)."""
    t, r, W, S = ctx.transport, ctx.transport.rank, ctx.transport.size, block.slot_bytes
    if S == 0:
        return
    pieces = block.chunks[0]
    send, recv = ctx.empty(S), ctx.empty(W * S)
    with ctx.timer.time("compress"):
        ctx.compress(pieces, send, 0, stage=1 + r)
    yield t.allgather(recv, send, async_op=True)
    with ctx.timer.time("decompress"):
        for j in range(W):  # rank order: the same float sum on every rank
            ctx.scale_meta(pieces, recv, j * S)
            ctx.decode(pieces, recv, j * S, accumulate=j > 0)


_PROGRAMS = {
    ReductionType.SRA: sra_block,
    ReductionType.RING: ring_block,
    ReductionType.ALLGATHER: allgather_block,
}


def chunks_per_block(algorithm: ReductionType, world_size: int) -> int:
    """World size the plan must be cut for (allgather keeps blocks whole)."""
    return 1 if algorithm is ReductionType.ALLGATHER else world_size


def programs(algorithm: ReductionType, ctx: ReduceContext, plan: FusionLayout) -> Iterator[BlockProgram]:
    if plan.world_size != chunks_per_block(algorithm, ctx.transport.size):
        raise ValueError(f"plan cut for {plan.world_size} chunks cannot run {algorithm.value} "
                         f"over {ctx.transport.size} ranks")
    make = _PROGRAMS[algorithm]
    return (make(ctx, b) for b in plan.blocks)
