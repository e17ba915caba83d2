"""Where every value of a fused, compressed allreduce travels.

A fused allreduce reduces a list of tensors (the *segments*), each with its
own :class:`QuantSpec`. cgx does not copy them into a float fusion buffer:
the segments form one *virtual* buffer of ``N`` values, and compression reads
from (and decompression writes to) the tensors themselves. Only the
compressed bytes are fused into one send buffer per collective.

The virtual buffer is cut into *blocks* (the pipeline unit: while block ``b``
is on the wire, block ``b + 1`` is being compressed), and each block into
``world_size`` *chunks* (chunk ``c`` is reduced by rank ``c`` in SRA). The
part of a segment that falls in one chunk is a *piece*: it is quantized on
its own (its own buckets), and its bytes go to a fixed offset of the chunk's
*slot*. Every rank derives the same plan from the same segments, so the byte
layout never travels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

from cgx.quant.codec import QuantSpec


@dataclasses.dataclass(frozen=True)
class Piece:
    """A run of values of one segment inside one chunk.

    Attributes:
        segment: index of the tensor in the fused list.
        offset: first value inside that tensor.
        numel: number of values.
        index: first value inside the virtual buffer (stochastic-rounding counter).
        byte_offset: where its bytes start inside the chunk's slot.
        nbytes: its quantized size.
    """

    segment: int
    offset: int
    numel: int
    index: int
    byte_offset: int
    nbytes: int
    spec: QuantSpec


@dataclasses.dataclass(frozen=True)
class Block:
    """One pipeline step: ``chunks[c]`` are the pieces owned by rank ``c``."""

    start: int
    stop: int
    chunks: tuple[tuple[Piece, ...], ...]
    slot_bytes: int  # bytes reserved per chunk (the largest chunk; others are padded)

    def chunk_numel(self, c: int) -> int:
        return sum(p.numel for p in self.chunks[c])


@dataclasses.dataclass(frozen=True)
class FusionLayout:
    blocks: tuple[Block, ...]
    numel: int
    world_size: int

    @property
    def wire_bytes(self) -> int:
        """Bytes one rank sends for one chunk slot of every block (per collective phase)."""
        return sum(b.slot_bytes for b in self.blocks)

    def compressed_bytes(self) -> int:
        """Total quantized size of the whole virtual buffer (no padding)."""
        return sum(p.nbytes for b in self.blocks for ch in b.chunks for p in ch)


def _chunk_bounds(start: int, stop: int, parts: int) -> list[int]:
    """Split [start, stop) into ``parts`` near-equal runs on multiples of 8 values.

    Multiples of 8 keep every piece's codes byte-aligned when a segment
    straddles a boundary; the last run takes the remainder.
    """
    length = stop - start
    bounds = [start]
    for c in range(1, parts):
        cut = start + (length * c // parts) // 8 * 8
        bounds.append(max(cut, bounds[-1]))
    bounds.append(stop)
    return bounds


def _pieces(seg_starts: Sequence[int], segments: Sequence[tuple[int, QuantSpec]],
            lo: int, hi: int) -> tuple[Piece, ...]:
    out, byte_offset = [], 0
    for i, ((numel, spec), s0) in enumerate(zip(segments, seg_starts)):
        a, b = max(lo, s0), min(hi, s0 + numel)
        if a >= b:
            continue
        nbytes = spec.nbytes(b - a)
        out.append(Piece(i, a - s0, b - a, a, byte_offset, nbytes, spec))
        byte_offset += nbytes
    return tuple(out)


@functools.lru_cache(maxsize=256)
def make_plan(segments: tuple[tuple[int, QuantSpec], ...], world_size: int,
              block_numel: Optional[int] = None) -> FusionLayout:
    """Cut ``segments`` ((numel, spec) pairs, in order) into blocks and chunks.

    Args:
        segments: the fused tensors' sizes and specs, identical on every rank.
        world_size: number of chunks per block.
        block_numel: values per pipeline block (None or 0: one block).

    Returns:
        The (cached) plan.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    total = sum(n for n, _ in segments)
    starts, acc = [], 0
    for n, _ in segments:
        starts.append(acc)
        acc += n
    if not block_numel or block_numel >= total:
        block_bounds = [0, total]
    else:
        # Blocks are multiples of 8 * world_size values so chunk cuts stay aligned.
        step = max(8 * world_size, block_numel // (8 * world_size) * (8 * world_size))
        block_bounds = list(range(0, total, step)) + [total]
    blocks = []
    for lo, hi in zip(block_bounds[:-1], block_bounds[1:]):
        cb = _chunk_bounds(lo, hi, world_size)
        chunks = tuple(_pieces(starts, segments, cb[c], cb[c + 1]) for c in range(world_size))
        slot = max((sum(p.nbytes for p in ch) for ch in chunks), default=0)
        blocks.append(Block(lo, hi, chunks, slot))
    return FusionLayout(tuple(blocks), total, world_size)
