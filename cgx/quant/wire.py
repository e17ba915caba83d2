"""Wire format of max-min bucket quantization, version 1.

This module is the single source of truth for how a quantized segment is laid
out in memory and on the wire; the torch reference, the C CPU path and the
Triton kernels all follow it bit for bit (see ``docs/wire-format.md``).

A *segment* is one contiguous run of ``n`` values quantized with ``bits`` bits
(1..8) in buckets of ``bucket_size`` values (a multiple of 8)::

    nb    = ceil(n / bucket_size)                    number of buckets
    meta  = nb records of 8 bytes: float32 unit, float32 min (little-endian)
    codes = bits * ceil(n / 8) bytes, starting at byte 8 * nb
    size  = 8 * nb + bits * ceil(n / 8), rounded up to a multiple of 8

Codes form one little-endian bit stream: the code of value ``i`` occupies bits
``[(i % 8) * bits, (i % 8 + 1) * bits)`` of the ``bits``-byte little-endian word
at byte ``8 * nb + (i // 8) * bits``. So 8 codes fill exactly ``bits`` bytes and,
with ``bucket_size % 8 == 0``, every bucket starts on a byte boundary. Padding
codes and padding bytes are zero. ``n == 0`` gives an empty segment.

Encoding one bucket (all arithmetic float32 unless stated, no fused multiply-add)::

    lo, hi = min(x), max(x)
    if any x is inf or NaN:   unit = min = NaN, every code 0   (decodes to NaN)
    unit = float32((float64(hi) - float64(lo)) / L)            L = 2**bits - 1
    if unit < FLT_MIN:        unit = 0                          (constant bucket)
    inv  = 1 / unit if unit > 0 else 0                          (IEEE division)
    q    = trunc(clamp((x - lo) * inv + r, 0, L))
    r    = 0.5 (nearest) or noise(key, index_offset, position) (stochastic)

Decoding: ``x' = lo + unit * q`` (float32), then cast to the output dtype.

Stochastic noise is counter based, so every rank (and every implementation)
can recompute it. One 32-bit hash serves two values, 8 positions apart: in each
block of 16 positions ``p`` (counted from the start of the quantized tensor) the
lanes ``p % 8`` of the block's two halves share a counter, the first half takes
the hash's low 16 bits and the second half its high 16 bits::

    c = index_offset + (p >> 4) * 8 + (p & 7)          (uint32, wrapping)
    noise = ((hash32(key, c) >> (16 * ((p >> 3) & 1))) & 0xFFFF) * 2**-16   in [0, 1)

    h = c * 0x9E3779B1 + key          (mod 2**32)
    h ^= h >> 16; h *= 0x85EBCA6B     (mod 2**32)
    h ^= h >> 13; h *= 0xC2B2AE35     (mod 2**32)
    h ^= h >> 16

A tensor of n values uses the counters ``index_offset .. index_offset + n/2``, so
segments of a fused buffer quantized with their buffer offsets as ``index_offset``
draw from disjoint counters. Half a hash per value halves the cost of stochastic
rounding on CPU; 16 bits of noise bias the rounding probability by less than
2**-16 of a quantization step.

``key`` comes from :func:`noise_key` (seed, step, tensor id, stage).

Rotation (``QuantSpec.rotate``, optional): a randomized Walsh-Hadamard transform
of the values before encoding, inverted after decoding. It spreads a bucket's
outliers over the bucket, so the range max - min (hence the unit) shrinks at
low bit widths. The layout and the arithmetic above are unchanged: the codes
and meta describe the rotated values ``v``; every rank derives the transform
from the spec and a ``rotation_key`` (one for every rank and stage of a
reduction, see :func:`rotation_key`), so it never travels::

    R      = min(bucket_size & -bucket_size, ROTATION_MAX_BLOCK)   power of two
    blocks = [0, R), [R, 2R), ... while whole; the last n % R values are cut
             into power-of-two blocks, largest first (binary digits of n % R)
    s_p    = -1 if bit (p & 31) of hash32(rotation_key, p >> 5) is set, else +1
    encode: v = float32(x) * s, then per block of m values the butterflies
            h = 1, 2, 4, .., m/2: (v[i], v[i+h]) = (v[i] + v[i+h], v[i] - v[i+h])
            for every i with i & h == 0 (block-relative), float32
    decode: w = decoded v, the same butterflies per block, then
            x' = (w * float32(1/m)) * s        (1/m exact: m is a power of two)

R divides the bucket size, so no block straddles two buckets. The transform is
unnormalized (|v| grows by about sqrt(m)): it is linear, and max-min
quantization is affine, so only ``1/m`` on the way back is needed, an exact
power of two. Sums commute with it: decoding W payloads rotated with the same
key and summing them in the rotated domain equals summing the decoded ones
(up to float32 rounding). A non-finite value makes its whole block non-finite,
so its bucket decodes to NaN (as without rotation); finite values above
``FLT_MAX / m`` may overflow to inf there too.

Standalone payloads (files, tests, debugging) may carry a 16-byte header, see
:func:`pack_header`; inside collectives segments are headerless because every
rank derives the same layout from the agreed plan, which records
``WIRE_VERSION``.
"""

from __future__ import annotations

import struct

WIRE_VERSION = 1
META_BYTES_PER_BUCKET = 8
SEGMENT_ALIGN = 8
FLT_MIN = 1.1754943508222875e-38  # smallest normal float32

HASH_MUL_INDEX = 0x9E3779B1
HASH_MUL_1 = 0x85EBCA6B
HASH_MUL_2 = 0xC2B2AE35
MASK32 = 0xFFFFFFFF

ROTATION_MAX_BLOCK = 4096  # widest Hadamard block (one GPU tile)
ROTATION_STAGE = MASK32  # the noise_key stage of rotation keys (no quantization stage uses it)
FLAG_ROTATED = 1  # header flags: the values were rotated before encoding

_HEADER = struct.Struct("<4sBBBBIi")  # magic, version, bits, rounding, flags, bucket, numel
HEADER_BYTES = _HEADER.size
_MAGIC = b"CGXQ"


def num_buckets(numel: int, bucket_size: int) -> int:
    return -(-numel // bucket_size)


def codes_nbytes(numel: int, bits: int) -> int:
    return bits * (-(-numel // 8))


def packed_nbytes(numel: int, bits: int, bucket_size: int) -> int:
    """Bytes of a quantized segment of ``numel`` values (see module docstring)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    raw = META_BYTES_PER_BUCKET * num_buckets(numel, bucket_size) + codes_nbytes(numel, bits)
    return -(-raw // SEGMENT_ALIGN) * SEGMENT_ALIGN


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finalizer (a bijection on uint32)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * HASH_MUL_1) & MASK32
    h ^= h >> 13
    h = (h * HASH_MUL_2) & MASK32
    h ^= h >> 16
    return h


def hash32(key: int, index: int) -> int:
    """Scalar version of the per-element hash (for documentation and tests)."""
    return fmix32((index * HASH_MUL_INDEX + key) & MASK32)


def noise_counter(index_offset: int, position: int) -> int:
    """The hash counter of the value at ``position`` (see the module docstring)."""
    return (index_offset + (position >> 4) * 8 + (position & 7)) & MASK32


def noise(key: int, index_offset: int, position: int) -> float:
    """Scalar stochastic-rounding offset in [0, 1) of the value at ``position``."""
    h = hash32(key, noise_counter(index_offset, position))
    return ((h >> (16 * ((position >> 3) & 1))) & 0xFFFF) * (1.0 / (1 << 16))


def noise_key(seed: int, step: int = 0, tensor_id: int = 0, stage: int = 0) -> int:
    """Fold (seed, step, tensor id, stage) into one uint32 key.

    ``stage`` separates the quantizations of one reduction (e.g. 0 for the
    scatter, 1 for the requantization of the reduced chunk), so their noise is
    independent. Every rank computes the same key from the same arguments.
    """
    h = fmix32(seed & MASK32) ^ (seed >> 32 & MASK32)
    for part in (step, tensor_id, stage):
        h = fmix32((h * HASH_MUL_INDEX + (part & MASK32)) & MASK32) ^ ((part >> 32) & MASK32)
    return h


def rotation_key(seed: int, step: int = 0, tensor_id: int = 0) -> int:
    """The rotation key of (seed, step, tensor id): one for every rank and every stage, so
    the payloads of all ranks are rotated alike (their decoded sums commute with it)."""
    return noise_key(seed, step, tensor_id, ROTATION_STAGE)


def rotation_block(bucket_size: int) -> int:
    """R: the largest power of two dividing ``bucket_size``, at most ROTATION_MAX_BLOCK."""
    return min(bucket_size & -bucket_size, ROTATION_MAX_BLOCK)


def rotation_blocks(numel: int, bucket_size: int) -> list[tuple[int, int]]:
    """(start, size) of every Hadamard block of a segment, in order (module docstring)."""
    r = rotation_block(bucket_size)
    return [(start, r) for start in range(0, numel // r * r, r)] + \
        rotation_tail(numel, bucket_size)


def rotation_tail(numel: int, bucket_size: int) -> list[tuple[int, int]]:
    """(start, size) of the blocks after the last whole one: powers of two, largest first."""
    r = rotation_block(bucket_size)
    start = numel // r * r
    blocks = []
    for k in reversed(range(r.bit_length())):
        if (numel - numel // r * r) >> k & 1:
            blocks.append((start, 1 << k))
            start += 1 << k
    return blocks


def rotation_sign(key: int, position: int) -> int:
    """Scalar sign s_p (+1 or -1) of the value at ``position`` (module docstring)."""
    return -1 if hash32(key, position >> 5) >> (position & 31) & 1 else 1


def pack_header(numel: int, bits: int, bucket_size: int, rounding_code: int,
                flags: int = 0) -> bytes:
    """16-byte header for a standalone payload: b'CGXQ', version, bits, rounding, flags,
    bucket, numel; ``flags``: FLAG_ROTATED when the values were rotated (whoever decodes
    needs the rotation key too)."""
    if numel >= 1 << 31:
        raise ValueError(f"a standalone header holds numel < 2**31, got {numel}")
    if flags & ~FLAG_ROTATED:
        raise ValueError(f"unknown header flags {flags:#x}; known: FLAG_ROTATED")
    return _HEADER.pack(_MAGIC, WIRE_VERSION, bits, rounding_code, flags, bucket_size, numel)


def header_flags(data: bytes) -> int:
    """The flags of a header made by :func:`pack_header` (after :func:`unpack_header`)."""
    flags = _HEADER.unpack(data[:HEADER_BYTES])[4]
    if flags & ~FLAG_ROTATED:
        raise ValueError(f"cgx payload has unknown header flags {flags:#x}: it was written "
                         "by a newer cgx; use the same cgx version on both ends")
    return flags


def unpack_header(data: bytes) -> tuple[int, int, int, int]:
    """Inverse of :func:`pack_header`: (numel, bits, bucket_size, rounding_code)."""
    if len(data) < HEADER_BYTES:
        raise ValueError(f"a cgx payload header has {HEADER_BYTES} bytes, got {len(data)}")
    magic, version, bits, rounding_code, _, bucket, numel = _HEADER.unpack(data[:HEADER_BYTES])
    if magic != _MAGIC:
        raise ValueError(f"not a cgx quantized payload (magic {magic!r}, expected {_MAGIC!r})")
    if version != WIRE_VERSION:
        raise ValueError(f"cgx payload has wire version {version}; this cgx reads version "
                         f"{WIRE_VERSION}: use the same cgx version on both ends")
    return numel, bits, bucket, rounding_code
