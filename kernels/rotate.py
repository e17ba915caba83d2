"""Triton kernel: the randomized Hadamard rotation of ``cgx.quant.wire`` ("Rotation").

A separate pass before quantization (forward) and after decoding (inverse), in
place on float32 values, so the quantize/dequantize kernels stay as they are.
One program owns ``ROWS`` whole Hadamard blocks (a ``[ROWS, BLOCK]`` tile);
each butterfly stage ``h`` views the tile as ``[.., 2, h]`` pairs, so the
stages run in the order of the reference (h = 1, 2, .., BLOCK/2) with plain
float32 adds: bit-exact with ``cgx.kernels.reference.rotate`` and the C path.
The tail of a segment (``n % R`` values) is cut into power-of-two blocks,
one launch each (at most ``log2 R`` small launches).

Runs on CUDA tensors; on CPU only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch

from cgx.quant import wire
from cgx.errors import MissingDependencyError
from cgx.kernels import quantize as _q

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("triton", "triton", "cgx's Triton quantization kernels") from exc


@triton.jit
def _flip_signs(v, pos, key):
    """v * s_pos: the sign bit flipped where bit (pos & 31) of hash32(key, pos >> 5) is set."""
    h = (pos >> 5).to(tl.uint32) * 0x9E3779B1 + key.to(tl.uint32)
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    bit = (h >> (pos & 31).to(tl.uint32)) & 1
    return (v.to(tl.uint32, bitcast=True) ^ (bit << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _butterflies(v, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOG: tl.constexpr):
    """Unnormalized Walsh-Hadamard transform of each row, stages h = 1, 2, .., BLOCK/2."""
    for s in tl.static_range(LOG):  # stage h = 2**s: [M, 2, h] pairs, M = ROWS * BLOCK / 2h
        pairs = tl.permute(tl.reshape(v, (ROWS * BLOCK // (2 << s), 2, 1 << s)), (0, 2, 1))
        a, b = tl.split(pairs)  # [M, h] each
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (ROWS, BLOCK))
    return v


@triton.jit(do_not_specialize=["start", "num_blocks", "key"])
def _rotate_kernel(
    v_ptr,  # *fp32: the segment's values, rotated in place
    start,  # first value of the first block of this launch
    num_blocks,  # blocks of BLOCK values in this launch
    key,  # rotation key (uint32 value)
    BLOCK: tl.constexpr,  # Hadamard block, a power of two
    LOG: tl.constexpr,  # log2(BLOCK)
    ROWS: tl.constexpr,  # blocks per program (power of two)
    INVERSE: tl.constexpr,  # undo a rotation
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    pos = start.to(tl.int64) + rows.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_blocks)[:, None]
    v = tl.load(v_ptr + pos, mask=mask, other=0.0)
    if INVERSE:
        v = _butterflies(v, ROWS, BLOCK, LOG) * (1.0 / BLOCK)
        v = _flip_signs(v, pos, key)
    else:
        v = _butterflies(_flip_signs(v, pos, key), ROWS, BLOCK, LOG)
    tl.store(v_ptr + pos, v, mask=mask)


# Values per program on a GPU, and per warp: on an H200, 1024-value tiles on one warp
# ran at ~1.9 TB/s (4096 on 8 warps: ~1.3); the interpreter wants few, large programs.
GPU_TILE = 1024
VALUES_PER_WARP = 1024


def _launch(v: torch.Tensor, start: int, num_blocks: int, block: int, key: int,
            inverse: bool) -> None:
    tile = _q.INTERPRETER_TILE if _q.is_interpreted(_rotate_kernel) else GPU_TILE
    rows = min(max(1, tile // block), triton.next_power_of_2(num_blocks))
    _rotate_kernel[(triton.cdiv(num_blocks, rows),)](
        v, start, num_blocks, key, BLOCK=block, LOG=block.bit_length() - 1, ROWS=rows,
        INVERSE=bool(inverse), num_warps=min(8, max(1, block * rows // VALUES_PER_WARP)),
        enable_fp_fusion=False)


def rotate(v: torch.Tensor, bucket_size: int, key: int, inverse: bool = False) -> torch.Tensor:
    """Rotate the float32 values ``v`` in place (see ``cgx.kernels.reference.rotate``).

    Args:
        v: contiguous float32 CUDA tensor (rotated values when ``inverse``).
        bucket_size: the segment's bucket size (fixes the Hadamard blocks).
        key: ``wire.rotation_key(...)`` (taken mod 2**32).
        inverse: undo a rotation.

    Returns:
        ``v``.
    """
    _q.check_values(v, "v")
    if v.dtype != torch.float32:
        raise TypeError(f"v has dtype {v.dtype}; the rotation runs on float32 values")
    _q.check_layout(1, bucket_size)
    _q.check_device(v, "v", _rotate_kernel)
    n, key32 = v.numel(), int(key) & wire.MASK32
    block = wire.rotation_block(bucket_size)
    if n >= block:
        _launch(v, 0, n // block, block, key32, inverse)
    for start, m in wire.rotation_tail(n, bucket_size):
        _launch(v, start, 1, m, key32, inverse)
    return v
