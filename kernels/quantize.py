"""Triton kernel: max-min bucket quantization and bit packing (wire format v1).

One program owns ``ROWS`` whole buckets (a ``[ROWS, BLOCK]`` tile, the bucket
padded to a power of two and masked), so min/max are plain row reductions and
every bucket's codes start on a byte boundary (``bucket_size % 8 == 0``).
Buckets wider than ``MAX_BLOCK`` are walked in chunks: one loop for min/max,
a second one (reading the bucket again, from L2) to quantize.

Bit-exact with ``cgx.kernels.reference`` (the executable spec): float64 for the
unit, IEEE ``1 / unit`` (``div_rn``), no FMA contraction (the launch passes
``enable_fp_fusion=False``), clamp then truncate, and the counter-based hash
of ``cgx.quant.wire`` for stochastic rounding. bfloat16 is converted by
hand (round to nearest even, NaN -> 0x7FC0, like torch) because Triton's
interpreter truncates in ``.to(tl.bfloat16)``.

Runs on CUDA tensors; on CPU only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

from typing import Optional

import torch

from cgx.quant import wire
from cgx.errors import MissingDependencyError

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError("triton", "triton", "cgx's Triton quantization kernels") from exc

# Tile sizes, in values. Module attributes (read at each launch, never at
# import) so tests can shrink MAX_BLOCK to exercise the chunked path.
MAX_BLOCK = 4096  # widest bucket chunk held in one tile on a GPU
TILE = 4096  # values per program on a GPU (ROWS = TILE // BLOCK buckets)
INTERPRETER_TILE = 1 << 16  # the interpreter pays ~ms per program: fewer, larger ones
# wire-format constants, as compile-time globals of the kernels
_FLT_MIN = tl.constexpr(wire.FLT_MIN)  # units below it are flushed to 0
_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # |x| <= it: finite
_NAN_BITS = tl.constexpr(0x7FC00000)  # the NaN the reference writes in meta


@triton.jit
def _load_f32(ptr, offs, mask, BF16: tl.constexpr):
    """Load values as float32 (exact widening); bfloat16 arrives as int16 bits."""
    if BF16:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True)
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_f32(ptr, offs, v, mask, BF16: tl.constexpr):
    """Store float32 values in the pointer's dtype, rounding to nearest even."""
    if BF16:
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)  # NaN -> 0x7FC0, as torch writes it
        tl.store(ptr + offs, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
    else:
        tl.store(ptr + offs, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _noise(key, index_offset, pos):
    """wire.noise(key, index_offset, pos) in [0, 1), uint32 arithmetic (wrapping): one
    hash per two positions 8 apart (what the CPU path shares; a GPU lane computes its own)."""
    c = index_offset.to(tl.uint32) + ((pos >> 4) * 8 + (pos & 7)).to(tl.uint32)
    h = c * 0x9E3779B1 + key.to(tl.uint32)
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    h = (h >> (((pos >> 3) & 1) * 16).to(tl.uint32)) & 0xFFFF
    return h.to(tl.float32) * (1.0 / 65536.0)


@triton.jit
def _encode_chunk(x, pos, valid, x_ptr, payload_ptr, rows, row_ok, c, lo, inv, unit, bad,
                  n, codes_start, key, index_offset,
                  BITS: tl.constexpr, BUCKET: tl.constexpr, BLOCK: tl.constexpr,
                  ROWS: tl.constexpr, BITS_P2: tl.constexpr, STOCHASTIC: tl.constexpr,
                  WRITE_BACK: tl.constexpr, BF16: tl.constexpr):
    """Quantize columns c .. c+BLOCK of ROWS buckets and store their codes (and write-back)."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    if STOCHASTIC:
        r = _noise(key, index_offset, pos)
    else:
        r = 0.5
    y = (x - lo[:, None]) * inv[:, None] + r  # two roundings: fp fusion is off
    # clamp; "y > 0" is false for NaN (only when BITS == 1 and the range overflows
    # float32; such a bucket decodes to NaN anyway), which then encodes 0
    y = tl.where(y > 0.0, y, 0.0)
    y = tl.where(y < LEVELS, y, LEVELS * 1.0)
    q = y.to(tl.int32)  # truncation
    q = tl.where(valid & (bad[:, None] == 0), q, 0)  # padding / non-finite buckets: code 0

    # pack: 8 codes -> one word of BITS bytes, code j at bits [j*BITS, (j+1)*BITS)
    G: tl.constexpr = BLOCK // 8
    q3 = tl.reshape(q.to(tl.uint64), (ROWS, G, 8))
    shifts = (tl.arange(0, 8) * BITS).to(tl.uint64)
    word = tl.sum(q3 << shifts[None, None, :], axis=2)  # disjoint bit fields: sum == or
    kb = tl.arange(0, BITS_P2)
    byte = ((word[:, :, None] >> (kb * 8).to(tl.uint64)[None, None, :]) & 0xFF).to(tl.uint8)
    g = c // 8 + tl.arange(0, G)  # group index inside the bucket
    first = rows.to(tl.int64)[:, None] * BUCKET + g[None, :].to(tl.int64) * 8
    gmask = row_ok[:, None] & (g[None, :] < BUCKET // 8) & (first < n)
    addr = codes_start + first // 8 * BITS
    tl.store(payload_ptr + addr[:, :, None] + kb[None, None, :], byte,
             mask=gmask[:, :, None] & (kb < BITS)[None, None, :])

    if WRITE_BACK:
        d = lo[:, None] + unit[:, None] * q.to(tl.float32)
        _store_f32(x_ptr, pos, d, valid, BF16)


# Triton turns an int argument equal to 1 into a compile-time constant, which has no
# .to(); scalars are left unspecialized (also avoids a recompile for n == 1).
@triton.jit(do_not_specialize=["n", "num_buckets", "key", "index_offset", "raw_nbytes",
                               "padded_nbytes"])
def _quantize_kernel(
    x_ptr,  # *fp32 / *fp16 / *int16 (bfloat16 bits): n input values, decoded values if WRITE_BACK
    payload_ptr,  # *uint8: the segment, wire.packed_nbytes(n, BITS, BUCKET) bytes
    n,  # number of values
    num_buckets,  # ceil(n / BUCKET)
    key,  # stochastic-rounding key (uint32 value)
    index_offset,  # noise counter of x[0] (uint32 value)
    raw_nbytes,  # meta + codes bytes; [raw_nbytes, raw_nbytes + 8) & < padded is zero padding
    padded_nbytes,  # wire.packed_nbytes: end of the segment
    BITS: tl.constexpr,  # bits per code, 1..8
    BUCKET: tl.constexpr,  # values per bucket, multiple of 8
    BLOCK: tl.constexpr,  # tile width: power of two >= 8, covers BUCKET or a chunk of it
    ROWS: tl.constexpr,  # buckets per program (power of two)
    BITS_P2: tl.constexpr,  # next power of two >= BITS (byte lanes of a packed word)
    STOCHASTIC: tl.constexpr,  # stochastic rounding, else nearest
    WRITE_BACK: tl.constexpr,  # overwrite x with the decoded values
    BF16: tl.constexpr,  # x holds bfloat16 bits (as int16)
):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)  # bucket ids of this program
    row_ok = rows < num_buckets
    cols = tl.arange(0, BLOCK)
    base = rows.to(tl.int64) * BUCKET
    codes_start = num_buckets.to(tl.int64) * 8
    LEVELS: tl.constexpr = (1 << BITS) - 1

    # pass 1: min, max and the number of non-finite values of each bucket
    lo = tl.full((ROWS,), float("inf"), tl.float32)
    hi = tl.full((ROWS,), float("-inf"), tl.float32)
    bad = tl.zeros((ROWS,), tl.int32)
    if BUCKET <= BLOCK:  # one chunk: keep it in registers for pass 2
        pos = base[:, None] + cols[None, :]
        valid = row_ok[:, None] & (cols < BUCKET)[None, :] & (pos < n)
        x = _load_f32(x_ptr, pos, valid, BF16)
        lo = tl.min(tl.where(valid, x, float("inf")), axis=1)
        hi = tl.max(tl.where(valid, x, float("-inf")), axis=1)
        # |x| <= FLT_MAX is false for inf and NaN (an ordered comparison)
        bad = tl.sum((valid & ~(tl.abs(x) <= _FLT_MAX)).to(tl.int32), axis=1)
    else:
        for c in range(0, BUCKET, BLOCK):
            pos = base[:, None] + (c + cols)[None, :]
            valid = row_ok[:, None] & (c + cols < BUCKET)[None, :] & (pos < n)
            xc = _load_f32(x_ptr, pos, valid, BF16)
            lo = tl.minimum(lo, tl.min(tl.where(valid, xc, float("inf")), axis=1))
            hi = tl.maximum(hi, tl.max(tl.where(valid, xc, float("-inf")), axis=1))
            bad += tl.sum((valid & ~(tl.abs(xc) <= _FLT_MAX)).to(tl.int32), axis=1)

    # bucket parameters, exactly as wire.py: float64 unit, IEEE reciprocal
    unit = ((hi.to(tl.float64) - lo.to(tl.float64)) / LEVELS).to(tl.float32)
    unit = tl.where(unit < _FLT_MIN, 0.0, unit)
    pos_unit = unit > 0.0
    inv = tl.where(pos_unit, tl.math.div_rn(tl.full((ROWS,), 1.0, tl.float32),
                                            tl.where(pos_unit, unit, 1.0)), 0.0)
    nan = tl.full((ROWS,), _NAN_BITS, tl.uint32).to(tl.float32, bitcast=True)
    is_bad = bad != 0
    unit = tl.where(is_bad, nan, unit)
    lo = tl.where(is_bad, nan, lo)
    inv = tl.where(is_bad, 0.0, inv)

    # meta: 8 bytes per bucket, float32 unit then float32 min, little-endian
    kk = tl.arange(0, 8)
    word = tl.where(kk[None, :] < 4, unit.to(tl.uint32, bitcast=True)[:, None],
                    lo.to(tl.uint32, bitcast=True)[:, None])
    meta = ((word >> ((kk % 4) * 8).to(tl.uint32)[None, :]) & 0xFF).to(tl.uint8)
    tl.store(payload_ptr + rows.to(tl.int64)[:, None] * 8 + kk[None, :], meta,
             mask=row_ok[:, None])

    # pass 2: codes (and decoded values)
    if BUCKET <= BLOCK:
        _encode_chunk(x, pos, valid, x_ptr, payload_ptr, rows, row_ok, 0, lo, inv, unit, bad,
                      n, codes_start, key, index_offset, BITS, BUCKET, BLOCK, ROWS, BITS_P2,
                      STOCHASTIC, WRITE_BACK, BF16)
    else:
        for c in range(0, BUCKET, BLOCK):
            pos = base[:, None] + (c + cols)[None, :]
            valid = row_ok[:, None] & (c + cols < BUCKET)[None, :] & (pos < n)
            xc = _load_f32(x_ptr, pos, valid, BF16)
            _encode_chunk(xc, pos, valid, x_ptr, payload_ptr, rows, row_ok, c, lo, inv, unit,
                          bad, n, codes_start, key, index_offset, BITS, BUCKET, BLOCK, ROWS,
                          BITS_P2, STOCHASTIC, WRITE_BACK, BF16)

    # zero padding up to the 8-byte alignment of the segment (program 0 only)
    if pid == 0:
        tail = raw_nbytes + kk.to(tl.int64)
        tl.store(payload_ptr + tail, tl.zeros((8,), tl.uint8), mask=tail < padded_nbytes)


# ---------------------------------------------------------------- launcher helpers
# (shared with dequantize.py)

def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kernel, InterpretedFunction)


def check_layout(bits: int, bucket_size: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} is not supported; expected an int in [1, 8]")
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) \
            or not 8 <= bucket_size <= (1 << 24) or bucket_size % 8:
        raise ValueError(f"bucket_size={bucket_size!r} is not supported; expected a multiple of "
                         "8 in [8, 2**24] (each bucket's codes fill whole bytes)")


def check_device(t: torch.Tensor, what: str, kernel) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and is_interpreted(kernel):
        return
    raise ValueError(f"{what} is on {t.device}; cgx's Triton kernels run on CUDA tensors "
                     "(or on CPU under TRITON_INTERPRET=1, for tests)")


def check_values(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{what} has dtype {t.dtype}; expected float32, float16 or bfloat16")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous; call .contiguous() first")


def check_payload(p: torch.Tensor, need: int, what: str) -> None:
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8:
        raise TypeError(f"{what} must be a uint8 torch.Tensor, got "
                        f"{getattr(p, 'dtype', type(p).__name__)}")
    if not p.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if p.numel() < need:
        raise ValueError(f"{what} has {p.numel()} bytes but the segment needs {need}")


def tile_shape(bucket_size: int, num_buckets: int, interpreted: bool) -> tuple[int, int]:
    """(BLOCK, ROWS): the tile covers a whole bucket when it fits in MAX_BLOCK."""
    block = min(triton.next_power_of_2(bucket_size), MAX_BLOCK)
    tile = INTERPRETER_TILE if interpreted else TILE
    rows = max(1, tile // block)
    rows = min(rows, triton.next_power_of_2(num_buckets))  # no programs full of empty rows
    return block, rows


def value_view(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 travels as its int16 bits (converted by hand in the kernels)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def quantize(x: torch.Tensor, bits: int, bucket_size: int, stochastic: bool, key: int = 0,
             index_offset: int = 0, write_back: bool = False,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize ``x`` into a wire-format v1 segment (see ``cgx.kernels.reference.quantize``).

    Args:
        x: contiguous float32/float16/bfloat16 CUDA tensor (treated as 1-D).
        bits: 1..8 bits per code.
        bucket_size: values per bucket, a multiple of 8.
        stochastic: stochastic rounding with ``wire.noise(key, index_offset, i)``; else nearest.
        key, index_offset: the noise counter (taken mod 2**32).
        write_back: also overwrite ``x`` with the decoded values (fused requantize).
        out: uint8 destination with at least ``wire.packed_nbytes`` bytes; allocated when None.

    Returns:
        The segment, ``wire.packed_nbytes(x.numel(), bits, bucket_size)`` bytes.

    Example::

        payload = quantize(grad.view(-1), 4, 1024, stochastic=True, key=wire.noise_key(0, step))
    """
    check_values(x, "x")
    check_layout(bits, bucket_size)
    check_device(x, "x", _quantize_kernel)
    n = x.numel()
    nbytes = wire.packed_nbytes(n, bits, bucket_size)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)  # the kernel writes all
    else:
        check_payload(out, nbytes, "out")
        if out.device != x.device:
            raise ValueError(f"out is on {out.device} but x on {x.device}")
        out = out[:nbytes]
    if n == 0:
        return out
    nb = wire.num_buckets(n, bucket_size)
    block, rows = tile_shape(bucket_size, nb, is_interpreted(_quantize_kernel))
    raw = wire.META_BYTES_PER_BUCKET * nb + wire.codes_nbytes(n, bits)
    grid = (triton.cdiv(nb, rows),)
    _quantize_kernel[grid](
        value_view(x), out, n, nb, int(key) & wire.MASK32, int(index_offset) & wire.MASK32,
        raw, nbytes,
        BITS=bits, BUCKET=bucket_size, BLOCK=block, ROWS=rows,
        BITS_P2=triton.next_power_of_2(bits), STOCHASTIC=bool(stochastic),
        WRITE_BACK=bool(write_back), BF16=x.dtype == torch.bfloat16,
        num_warps=8 if block * rows >= 4096 else 4,
        enable_fp_fusion=False,  # (x - lo) * inv + r must round twice, like the reference
    )
    return out
