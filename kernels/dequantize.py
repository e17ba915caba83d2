"""Triton kernel: unpack and dequantize a wire-format v1 segment, optionally accumulating.

``out = lo + unit * q`` per value (float32), or with ``ACCUMULATE``
``out = dtype(float32(out) + lo + unit * q)``: the receive side of a compressed
reduction, fused so the decoded chunk never touches memory on its own.

One program owns ``ROWS`` whole buckets (a ``[ROWS, BLOCK]`` tile); buckets
wider than ``quantize.MAX_BLOCK`` are walked in chunks. Meta records and codes
are read byte by byte, so a segment may start at any offset of a buffer.
Bit-exact with ``cgx.kernels.reference.dequantize``: no FMA contraction
(``enable_fp_fusion=False``), round-to-nearest-even stores.

Runs on CUDA tensors; on CPU only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

from typing import Optional

import torch

from cgx.quant import wire
from cgx.errors import MissingDependencyError
from cgx.kernels import quantize as _q
from cgx.kernels.quantize import _load_f32, _store_f32

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("triton", "triton", "cgx's Triton quantization kernels") from exc


@triton.jit
def _decode_chunk(payload_ptr, out_ptr, rows, row_ok, c, lo, unit, n, codes_start,
                  BITS: tl.constexpr, BUCKET: tl.constexpr, BLOCK: tl.constexpr,
                  ROWS: tl.constexpr, BITS_P2: tl.constexpr, ACCUMULATE: tl.constexpr,
                  BF16: tl.constexpr):
    """Decode columns c .. c+BLOCK of ROWS buckets into out."""
    G: tl.constexpr = BLOCK // 8
    g = c // 8 + tl.arange(0, G)  # group index inside the bucket
    first = rows.to(tl.int64)[:, None] * BUCKET + g[None, :].to(tl.int64) * 8
    gmask = row_ok[:, None] & (g[None, :] < BUCKET // 8) & (first < n)
    kb = tl.arange(0, BITS_P2)
    addr = codes_start + first // 8 * BITS
    byte = tl.load(payload_ptr + addr[:, :, None] + kb[None, None, :],
                   mask=gmask[:, :, None] & (kb < BITS)[None, None, :], other=0)
    # the BITS bytes of a group form one little-endian word; code j = bits [j*BITS, (j+1)*BITS)
    word = tl.sum(byte.to(tl.uint64) << (kb * 8).to(tl.uint64)[None, None, :], axis=2)
    shifts = (tl.arange(0, 8) * BITS).to(tl.uint64)
    q3 = (word[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(q3, (ROWS, BLOCK)).to(tl.float32)

    cols = c + tl.arange(0, BLOCK)
    pos = rows.to(tl.int64)[:, None] * BUCKET + cols[None, :]
    valid = row_ok[:, None] & (cols < BUCKET)[None, :] & (pos < n)
    val = lo[:, None] + unit[:, None] * q  # two roundings: fp fusion is off
    if ACCUMULATE:
        val = _load_f32(out_ptr, pos, valid, BF16) + val
    _store_f32(out_ptr, pos, val, valid, BF16)


# scalars unspecialized: an int argument equal to 1 would become a constant without .to()
@triton.jit(do_not_specialize=["n", "num_buckets"])
def _dequantize_kernel(
    payload_ptr,  # *uint8: the segment (at least wire.packed_nbytes(n, BITS, BUCKET) bytes)
    out_ptr,  # *fp32 / *fp16 / *int16 (bfloat16 bits): n values, written (or added to)
    n,  # number of values
    num_buckets,  # ceil(n / BUCKET)
    BITS: tl.constexpr,  # bits per code, 1..8
    BUCKET: tl.constexpr,  # values per bucket, multiple of 8
    BLOCK: tl.constexpr,  # tile width: power of two >= 8, covers BUCKET or a chunk of it
    ROWS: tl.constexpr,  # buckets per program (power of two)
    BITS_P2: tl.constexpr,  # next power of two >= BITS
    ACCUMULATE: tl.constexpr,  # out = float32(out) + decoded, else out = decoded
    BF16: tl.constexpr,  # out holds bfloat16 bits (as int16)
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)  # bucket ids of this program
    row_ok = rows < num_buckets
    codes_start = num_buckets.to(tl.int64) * 8

    # meta: float32 unit then float32 min per bucket, little-endian, read as bytes
    kk = tl.arange(0, 8)
    mb = tl.load(payload_ptr + rows.to(tl.int64)[:, None] * 8 + kk[None, :],
                 mask=row_ok[:, None], other=0).to(tl.uint32)
    sh = ((kk % 4) * 8).to(tl.uint32)[None, :]
    unit_bits = tl.sum(tl.where(kk[None, :] < 4, mb << sh, 0), axis=1)
    lo_bits = tl.sum(tl.where(kk[None, :] >= 4, mb << sh, 0), axis=1)
    unit = unit_bits.to(tl.uint32).to(tl.float32, bitcast=True)
    lo = lo_bits.to(tl.uint32).to(tl.float32, bitcast=True)

    for c in range(0, BUCKET, BLOCK):
        _decode_chunk(payload_ptr, out_ptr, rows, row_ok, c, lo, unit, n, codes_start,
                      BITS, BUCKET, BLOCK, ROWS, BITS_P2, ACCUMULATE, BF16)


def dequantize(payload: torch.Tensor, numel: int, bits: int, bucket_size: int,
               out: Optional[torch.Tensor] = None, accumulate: bool = False,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``numel`` values of a segment (see ``cgx.kernels.reference.dequantize``).

    Args:
        payload: contiguous uint8 CUDA segment of at least ``wire.packed_nbytes`` bytes.
        numel, bits, bucket_size: the layout it was made with.
        out: contiguous float32/float16/bfloat16 tensor of ``numel`` values, same device.
        accumulate: ``out = dtype(float32(out) + decoded)`` instead of overwriting.
        dtype: dtype of a newly allocated ``out``.

    Returns:
        ``out``.

    Example::

        dequantize(chunk_payload, chunk.numel(), 4, 1024, out=chunk, accumulate=True)
    """
    _q.check_layout(bits, bucket_size)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r} must be an int >= 0")
    _q.check_payload(payload, wire.packed_nbytes(numel, bits, bucket_size), "payload")
    _q.check_device(payload, "payload", _dequantize_kernel)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an `out` tensor to add into")
        out = torch.empty(numel, dtype=dtype, device=payload.device)
    _q.check_values(out, "out")
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} values, expected numel={numel}")
    if out.device != payload.device:
        raise ValueError(f"out is on {out.device} but payload on {payload.device}")
    if numel == 0:
        return out
    nb = wire.num_buckets(numel, bucket_size)
    block, rows = _q.tile_shape(bucket_size, nb, _q.is_interpreted(_dequantize_kernel))
    grid = (triton.cdiv(nb, rows),)
    _dequantize_kernel[grid](
        payload, _q.value_view(out), numel, nb,
        BITS=bits, BUCKET=bucket_size, BLOCK=block, ROWS=rows,
        BITS_P2=triton.next_power_of_2(bits), ACCUMULATE=bool(accumulate),
        BF16=out.dtype == torch.bfloat16,
        num_warps=8 if block * rows >= 4096 else 4,
        enable_fp_fusion=False,  # lo + unit * q (+ out) must round like the reference
    )
    return out
