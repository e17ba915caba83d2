"""Max-min bucket quantization: the public API every other part of cgx uses.

One call, three implementations of the same wire format (``cgx.quant.wire``):

* CUDA tensors go through the Triton kernels (``cgx.kernels``);
* CPU tensors go through the fused C path (``cgx._cquant``), when it is built;
* otherwise, or when asked, the plain-torch reference (``cgx.kernels.reference``).

``QuantSpec(rotate=True)`` adds the randomized Hadamard rotation of the wire
format (``wire``, "Rotation"): a separate pass of the same backend before
encoding and after decoding, keyed by ``rotation_key`` (``wire.rotation_key``;
encoder and decoder pass the same one).

Example::

    spec = QuantSpec(bits=4, bucket_size=1024, rounding=Rounding.NEAREST)
    payload = quantize(grad.view(-1), spec)
    approx = dequantize(payload, grad.numel(), spec)
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import warnings
from typing import Optional

import torch

from cgx.config import MAX_BITS, MIN_BITS, Rounding, validate_bucket_size
from cgx.errors import ConfigError
from cgx.quant import wire

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Backend(enum.Enum):
    """Which implementation runs (``backend=`` argument)."""

    AUTO = "auto"  # triton on CUDA, C on CPU (reference if C is not built)
    TORCH = "torch"  # plain-torch reference (slow; the spec)
    C = "c"  # fused C path, CPU tensors only
    TRITON = "triton"  # Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How one segment is quantized.

    Attributes:
        bits: bits per value, 1..8 (levels ``2**bits``).
        bucket_size: values sharing one (unit, min) pair; multiple of 8.
        rounding: ``Rounding.NEAREST`` (error <= unit/2) or ``Rounding.STOCHASTIC``
            (unbiased, error < unit).
        rotate: rotate the values (randomized Hadamard, ``wire``) before encoding and
            back after decoding: outliers spread over their bucket, so low bit widths
            lose less; the sizes are unchanged. Bounds hold for the rotated values.
    """

    bits: int = 4
    bucket_size: int = 1024
    rounding: Rounding = Rounding.STOCHASTIC
    rotate: bool = False

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) \
                or not MIN_BITS <= self.bits <= MAX_BITS:
            raise ConfigError(f"QuantSpec.bits={self.bits!r} is not supported; expected an int in "
                              f"[{MIN_BITS}, {MAX_BITS}]")
        validate_bucket_size(self.bucket_size, "QuantSpec.bucket_size")
        if not isinstance(self.rounding, Rounding):
            raise ConfigError(f"QuantSpec.rounding must be a cgx.Rounding, got {self.rounding!r}")
        if not isinstance(self.rotate, bool):
            raise ConfigError(f"QuantSpec.rotate must be True or False, got {self.rotate!r}")

    @property
    def stochastic(self) -> bool:
        return self.rounding is Rounding.STOCHASTIC

    def nbytes(self, numel: int) -> int:
        """Bytes of a segment of ``numel`` values."""
        return wire.packed_nbytes(numel, self.bits, self.bucket_size)

    def ratio(self, numel: int, dtype_bytes: int = 4) -> float:
        """Compression ratio against ``dtype_bytes`` per value."""
        return numel * dtype_bytes / max(1, self.nbytes(numel))


def packed_nbytes(numel: int, spec: QuantSpec) -> int:
    return spec.nbytes(numel)


def _check_input(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{what} has dtype {x.dtype}; cgx quantizes float32, float16 or "
                        "bfloat16 tensors (cast others first)")
    if not x.is_contiguous():
        raise ValueError(f"{what} must be contiguous; call .contiguous() first")


def _check_payload(payload: torch.Tensor, numel: int, spec: QuantSpec) -> None:
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8:
        raise TypeError("payload must be a uint8 torch.Tensor produced by cgx quantize(), got "
                        f"{getattr(payload, 'dtype', type(payload).__name__)}")
    need = spec.nbytes(numel)
    if payload.numel() < need:
        raise ValueError(f"payload has {payload.numel()} bytes but {numel} values at "
                         f"{spec.bits} bits, bucket {spec.bucket_size} need {need}: "
                         "sender and receiver disagree on the layout")


_warned_reference_fallback = False


def _warn_reference_fallback(reason: Optional[str]) -> None:
    """Say once per process that CPU quantization runs on the slow reference."""
    global _warned_reference_fallback
    if _warned_reference_fallback:
        return
    _warned_reference_fallback = True
    warnings.warn(f"cgx: the fast C quantization path is not available ({reason}); CPU tensors "
                  "are quantized by the plain-torch reference, which is many times slower. "
                  "Build it with `make ext` (needs a C compiler).", RuntimeWarning, stacklevel=4)


def _resolve(backend, device: torch.device) -> Backend:
    backend = Backend(backend) if not isinstance(backend, Backend) else backend
    if backend is Backend.AUTO:
        if device.type == "cuda":
            return Backend.TRITON
        from cgx.quant import cpu
        if cpu.available():
            return Backend.C
        _warn_reference_fallback(cpu.unavailable_reason())
        return Backend.TORCH
    if backend is Backend.C and device.type != "cpu":
        raise ValueError(f"backend 'c' runs on CPU tensors; this tensor is on {device}")
    return backend


def quantize(x: torch.Tensor, spec: QuantSpec, *, out: Optional[torch.Tensor] = None,
             key: int = 0, index_offset: int = 0, write_back: bool = False,
             backend: Backend | str = Backend.AUTO, threads: int = 1,
             rotation_key: int = 0) -> torch.Tensor:
    """Quantize the values of ``x`` into a wire-format segment.

    Args:
        x: contiguous float32/float16/bfloat16 tensor (treated as 1-D).
        spec: bits, bucket size, rounding, rotation.
        out: optional uint8 destination of at least ``spec.nbytes(x.numel())`` bytes
            (a slice of a fusion buffer, say); allocated when None.
        key: stochastic-rounding key (``wire.noise_key``); ignored for nearest.
        index_offset: counter of the first value (position inside the fused buffer).
        write_back: also overwrite ``x`` with the decoded values (fused requantize).
        backend: see :class:`Backend`.
        threads: CPU threads of the C path (split at bucket boundaries; ``CGX_CPU_THREADS``).
        rotation_key: with ``spec.rotate``, the rotation's key (``wire.rotation_key``);
            whoever decodes passes the same.

    Returns:
        The uint8 segment (``out`` or a new tensor), exactly ``spec.nbytes(n)`` bytes.
    """
    _check_input(x, "x")
    n = x.numel()
    nbytes = spec.nbytes(n)
    if out is not None:
        _check_payload(out, n, spec)
        out = out[:nbytes]
    impl = _resolve(backend, x.device)
    if not spec.rotate or n == 0:
        return _encode(x, spec, out, key, index_offset, write_back, impl, threads)
    v = _scratch(n, x.device)
    v.copy_(x.reshape(-1))
    _rotate(v, spec, rotation_key, False, impl, threads)
    out = _encode(v, spec, out, key, index_offset, write_back, impl, threads)
    if write_back:
        _rotate(v, spec, rotation_key, True, impl, threads)
        x.view(-1).copy_(v)
    return out


def _encode(x, spec, out, key, index_offset, write_back, impl, threads) -> torch.Tensor:
    """The backend's quantize, without rotation."""
    if impl is Backend.C:
        from cgx.quant import cpu
        return cpu.quantize(x, spec.bits, spec.bucket_size, spec.stochastic, key, index_offset,
                            write_back, out, threads=threads)
    if impl is Backend.TRITON:
        from cgx.kernels import quantize as tq
        return tq.quantize(x, spec.bits, spec.bucket_size, spec.stochastic, key, index_offset,
                           write_back, out)
    from cgx.kernels import reference
    res = reference.quantize(x, spec.bits, spec.bucket_size, spec.stochastic, key, index_offset,
                             write_back)
    if out is None:
        return res
    out.copy_(res)
    return out


def _rotate(v: torch.Tensor, spec: QuantSpec, key: int, inverse: bool, impl: Backend,
            threads: int) -> None:
    """The backend's rotation of the float32 values ``v``, in place."""
    if impl is Backend.C:
        from cgx.quant import cpu
        cpu.rotate(v, spec.bucket_size, key, inverse, threads=threads)
    elif impl is Backend.TRITON:
        from cgx.kernels import rotate
        rotate.rotate(v, spec.bucket_size, key, inverse)
    else:
        from cgx.kernels import reference
        v.copy_(reference.rotate(v, spec.bucket_size, key, inverse))


def dequantize(payload: torch.Tensor, numel: int, spec: QuantSpec, *,
               out: Optional[torch.Tensor] = None, accumulate: bool = False,
               dtype: torch.dtype = torch.float32,
               backend: Backend | str = Backend.AUTO, threads: int = 1,
               rotation_key: int = 0) -> torch.Tensor:
    """Decode ``numel`` values from a segment made by :func:`quantize`.

    Args:
        payload: uint8 segment.
        numel: number of values it holds.
        spec: the spec it was made with (bits, bucket size and rotation must match).
        out: optional contiguous float destination of ``numel`` values.
        accumulate: add the decoded values to ``out`` (computed in float32)
            instead of overwriting it; this is the receive side of a reduction.
        dtype: dtype of a newly allocated ``out``.
        rotation_key: with ``spec.rotate``, the key the payload was rotated with.

    Returns:
        ``out`` (or a new tensor of ``dtype``).
    """
    _check_payload(payload, numel, spec)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an `out` tensor to add into")
        out = torch.empty(numel, dtype=dtype, device=payload.device)
    else:
        _check_input(out, "out")
        if out.numel() != numel:
            raise ValueError(f"out has {out.numel()} values, expected numel={numel}")
        if out.device != payload.device:
            raise ValueError(f"out is on {out.device} but payload on {payload.device}")
    impl = _resolve(backend, payload.device)
    if not spec.rotate or numel == 0:
        return _decode(payload, numel, spec, out, accumulate, impl, threads)
    v = _decode(payload, numel, spec, _scratch(numel, payload.device), False, impl, threads)
    _rotate(v, spec, rotation_key, True, impl, threads)
    flat = out.view(-1)
    if not accumulate:
        flat.copy_(v)
    elif flat.dtype == torch.float32:
        flat.add_(v)
    else:
        flat.copy_(flat.to(torch.float32) + v)
    return out


# The rotated paths' float32 working copy. On CPU, one buffer per thread is kept between
# calls (up to SCRATCH_MAX values): a fresh one costs a page fault every 4 KiB, about half
# of a rotated quantize's time at 64 MiB. CUDA tensors use the caching allocator.
SCRATCH_MAX = 1 << 24
_local = threading.local()


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """A float32 working tensor of ``numel`` values, free until the caller returns."""
    if device.type != "cpu" or numel > SCRATCH_MAX:
        return torch.empty(numel, dtype=torch.float32, device=device)
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < numel:
        _local.buf = buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


def _decode(payload, numel, spec, out, accumulate, impl, threads) -> torch.Tensor:
    """The backend's dequantize, without rotation."""
    if impl is Backend.C:
        from cgx.quant import cpu
        return cpu.dequantize(payload, numel, spec.bits, spec.bucket_size, out, accumulate,
                              threads=threads)
    if impl is Backend.TRITON:
        from cgx.kernels import dequantize as tdq
        return tdq.dequantize(payload, numel, spec.bits, spec.bucket_size, out, accumulate)
    from cgx.kernels import reference
    return reference.dequantize(payload, numel, spec.bits, spec.bucket_size, out, accumulate)
