"""Plain-torch reference of max-min bucket quantization (wire format v1).

Readable, vectorized, slow: this is the executable spec that the Triton
kernels (``quantize.py``, ``dequantize.py``) and the C CPU path
(``cgx/csrc``) are tested against, bit for bit. See ``cgx.quant.wire``.
"""

from __future__ import annotations

import torch

from cgx.quant import wire

_M32 = wire.MASK32


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for int64 ``a`` in [0, 2**32), without int64 overflow."""
    lo = a * (c & 0xFFFF)
    hi = ((a * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def hash32(key: int, index: torch.Tensor) -> torch.Tensor:
    """Vectorized ``wire.hash32`` over int64 indices (values in [0, 2**32))."""
    h = (_mul32(index & _M32, wire.HASH_MUL_INDEX) + (key & _M32)) & _M32
    h = h ^ (h >> 16)
    h = _mul32(h, wire.HASH_MUL_1)
    h = h ^ (h >> 13)
    h = _mul32(h, wire.HASH_MUL_2)
    return h ^ (h >> 16)


def noise(key: int, index_offset: int, numel: int, device=None) -> torch.Tensor:
    """Stochastic-rounding offsets r in [0, 1) of positions 0 .. numel-1 (float32;
    ``wire.noise``: one hash per two values, 8 positions apart)."""
    pos = torch.arange(numel, dtype=torch.int64, device=device)
    h = hash32(key, index_offset + (pos >> 4) * 8 + (pos & 7))
    return ((h >> (16 * ((pos >> 3) & 1))) & 0xFFFF).to(torch.float32) * (1.0 / (1 << 16))


def rotation_signs(key: int, numel: int, device=None) -> torch.Tensor:
    """float32 signs s_p (+1/-1) of positions 0 .. numel-1 (``wire.rotation_sign``)."""
    pos = torch.arange(numel, dtype=torch.int64, device=device)
    bit = (hash32(key, pos >> 5) >> (pos & 31)) & 1
    return (1 - 2 * bit).to(torch.float32)


def _butterflies(v: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform of each row of ``v`` ([k, m], m a power of
    two): butterflies h = 1, 2, .., m/2, float32 (the order fixes the rounding)."""
    k, m = v.shape
    h = 1
    while h < m:
        pairs = v.reshape(k, m // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        v = torch.stack([a + b, a - b], dim=2).reshape(k, m)
        h *= 2
    return v


def rotate(v: torch.Tensor, bucket_size: int, key: int, inverse: bool = False) -> torch.Tensor:
    """The randomized Hadamard rotation of ``wire`` on a 1-D float32 tensor (a new tensor).

    Args:
        v: values (float32; the rotated values when ``inverse``).
        bucket_size: the segment's bucket size (fixes the blocks, ``wire.rotation_blocks``).
        key: ``wire.rotation_key(...)``, the same for encoder and decoder.
        inverse: undo a rotation (butterflies, then ``* 1/m``, then the signs).
    """
    n = v.numel()
    signs = rotation_signs(key, n, v.device)
    out = v.reshape(-1).to(torch.float32)
    out = out.clone() if inverse else out * signs
    r = wire.rotation_block(bucket_size)
    full = n // r * r
    spans = [(0, full, r)] if full else []
    spans += [(start, start + m, m) for start, m in wire.rotation_tail(n, bucket_size)]
    for lo, hi, m in spans:
        blocks = _butterflies(out[lo:hi].view(-1, m))
        if inverse:
            blocks = blocks * (1.0 / m)
        out[lo:hi] = blocks.reshape(-1)
    return out * signs if inverse else out


def _bucket_stats(xf: torch.Tensor, bits: int, bucket_size: int):
    """Per-bucket (unit, lo, inv, nonfinite) following the wire format."""
    n = xf.numel()
    nb = wire.num_buckets(n, bucket_size)
    pad = nb * bucket_size - n
    grid_lo = torch.nn.functional.pad(xf, (0, pad), value=float("inf")).view(nb, bucket_size)
    grid_hi = torch.nn.functional.pad(xf, (0, pad), value=float("-inf")).view(nb, bucket_size)
    finite = torch.nn.functional.pad(torch.isfinite(xf), (0, pad), value=True).view(nb, bucket_size)
    nonfinite = ~finite.all(dim=1)
    lo = grid_lo.amin(dim=1)
    hi = grid_hi.amax(dim=1)
    levels = (1 << bits) - 1
    unit = ((hi.double() - lo.double()) / levels).float()
    unit = torch.where(unit < wire.FLT_MIN, torch.zeros_like(unit), unit)
    inv = torch.where(unit > 0, 1.0 / torch.where(unit > 0, unit, torch.ones_like(unit)),
                      torch.zeros_like(unit))
    nan = torch.full_like(unit, float("nan"))
    unit = torch.where(nonfinite, nan, unit)
    lo = torch.where(nonfinite, nan, lo)
    inv = torch.where(nonfinite, torch.zeros_like(inv), inv)
    return unit, lo, inv, nonfinite


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int64 codes (< 2**bits) into the little-endian bit stream, 8 codes per ``bits`` bytes."""
    n = q.numel()
    groups = -(-n // 8)
    q = torch.nn.functional.pad(q, (0, groups * 8 - n)).view(groups, 8)
    if bits == 8:  # one code per byte; also keeps the int64 word below from overflowing
        return q.to(torch.uint8).reshape(-1)
    shifts = torch.arange(8, dtype=torch.int64, device=q.device) * bits
    word = (q << shifts).sum(dim=1)  # at most 7 * 8 = 56 bits
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=q.device) * 8
    return ((word.unsqueeze(1) >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)


def _unpack(codes: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    groups = -(-numel // 8)
    if bits == 8:
        return codes[:numel].to(torch.int64)
    b = codes[: groups * bits].to(torch.int64).view(groups, bits)
    byte_shifts = torch.arange(bits, dtype=torch.int64, device=codes.device) * 8
    word = (b << byte_shifts).sum(dim=1)
    shifts = torch.arange(8, dtype=torch.int64, device=codes.device) * bits
    q = (word.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(-1)[:numel]


def quantize(x: torch.Tensor, bits: int, bucket_size: int, stochastic: bool, key: int = 0,
             index_offset: int = 0, write_back: bool = False) -> torch.Tensor:
    """Quantize a 1-D float32/float16/bfloat16 tensor into a wire-format v1 segment.

    Args:
        x: values to quantize (any float dtype; computed in float32).
        bits: 1..8 bits per code.
        bucket_size: values per bucket, a multiple of 8.
        stochastic: stochastic rounding with ``wire.noise(key, index_offset, i)``; else nearest.
        key, index_offset: noise counter (see ``wire.noise_key``).
        write_back: also overwrite ``x`` with its decoded values (requantization
            of a reduced chunk, so the owner holds what every peer will decode).

    Returns:
        uint8 tensor of ``wire.packed_nbytes(n, bits, bucket_size)`` bytes.
    """
    n = x.numel()
    out = torch.zeros(wire.packed_nbytes(n, bits, bucket_size), dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    xf = x.reshape(-1).to(torch.float32)
    unit, lo, inv, nonfinite = _bucket_stats(xf, bits, bucket_size)
    lo_e = lo.repeat_interleave(bucket_size)[:n]
    inv_e = inv.repeat_interleave(bucket_size)[:n]
    t = (xf - lo_e) * inv_e
    r = noise(key, index_offset, n, x.device) if stochastic else 0.5
    levels = (1 << bits) - 1
    v = torch.clamp(t + r, 0.0, float(levels))
    # Non-finite buckets, and a NaN t (a finite range beyond FLT_MAX at 1 bit makes
    # unit = inf, so 0 * inf), encode 0 explicitly: casting NaN to int is platform-defined.
    bad = nonfinite.repeat_interleave(bucket_size)[:n] | torch.isnan(v)
    q = torch.where(bad, torch.zeros_like(v), v).to(torch.int64)  # trunc == floor for v >= 0
    meta = torch.stack([unit, lo], dim=1).reshape(-1).view(torch.uint8)
    out[: meta.numel()] = meta
    codes = _pack(q, bits)
    out[meta.numel(): meta.numel() + codes.numel()] = codes
    if write_back:
        unit_e = unit.repeat_interleave(bucket_size)[:n]
        x.view(-1).copy_(lo_e + unit_e * q.to(torch.float32))
    return out


def dequantize(payload: torch.Tensor, numel: int, bits: int, bucket_size: int,
               out: torch.Tensor | None = None, accumulate: bool = False,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode a wire-format v1 segment: ``lo + unit * q`` per value (float32).

    Args:
        payload: uint8 segment of at least ``wire.packed_nbytes(numel, ...)`` bytes.
        out: destination (1-D, ``numel`` values); allocated with ``dtype`` when None.
        accumulate: ``out = dtype(float32(out) + decoded)`` instead of overwriting.

    Returns:
        ``out``.
    """
    if out is None:
        out = torch.zeros(numel, dtype=dtype, device=payload.device)
    if numel == 0:
        return out
    nb = wire.num_buckets(numel, bucket_size)
    # clone: a segment may start at any byte offset, and view(float32) needs a 4-aligned one
    meta = payload[: nb * 8].clone().view(torch.float32).view(nb, 2)
    unit_e = meta[:, 0].repeat_interleave(bucket_size)[:numel]
    lo_e = meta[:, 1].repeat_interleave(bucket_size)[:numel]
    q = _unpack(payload[nb * 8:], numel, bits)
    val = lo_e + unit_e * q.to(torch.float32)
    flat = out.view(-1)
    if accumulate:
        flat.copy_(flat.to(torch.float32) + val)
    else:
        flat.copy_(val)
    return out
