"""Fused C CPU path of quantization (``cgx._cquant``), loaded with ctypes.

The extension is a plain C file (``cgx/csrc/quant.c``) built by ``setup.py``;
its functions are reached through ctypes, which releases the GIL during each
call. That is what makes ``threads > 1`` useful: a segment is cut at bucket
boundaries (buckets start on byte boundaries of the payload, so the pieces
write disjoint bytes) and the pieces run concurrently on a small thread pool.

Both functions follow ``cgx.quant.wire`` bit for bit (tested against
``cgx.kernels.reference``). ``cgx.quant.codec`` is the public API;
call this module directly only to pick the number of threads.

Example::

    from cgx.quant import cpu
    if cpu.available():
        payload = cpu.quantize(x, bits=4, bucket_size=1024, stochastic=False, threads=2)
        y = cpu.dequantize(payload, x.numel(), 4, 1024, out=torch.empty_like(x))
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import importlib.util
import os
import threading
from typing import Optional

import torch

from cgx.quant import wire
from cgx.errors import CGXError

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Below this many values per piece a thread hand-off (~20-50 us) costs more
# than it saves, so small segments run on the calling thread only.
MIN_VALUES_PER_THREAD = 1 << 16
MAX_THREADS = 256

_lib: Optional[ctypes.CDLL] = None
_load_error: Optional[str] = None
_loaded = False
_load_lock = threading.Lock()

_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_size = 0
_pool_lock = threading.Lock()


def load_library() -> Optional[ctypes.CDLL]:
    """The C extension's library (loaded once), or None when it is not built."""
    global _lib, _load_error, _loaded
    if _loaded:
        return _lib
    with _load_lock:
        if _loaded:
            return _lib
        try:
            spec = importlib.util.find_spec("cgx._cquant")
            if spec is None or not spec.origin:
                raise OSError("cgx._cquant is not built (run `make ext` or "
                              "`python scripts/build_ext.py` with a C compiler installed)")
            lib = ctypes.CDLL(spec.origin)
            i64, u32, c_int, ptr = ctypes.c_int64, ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p
            lib.cgx_quantize.argtypes = [ptr, c_int, i64, c_int, i64, c_int, u32, u32, c_int,
                                         ptr, i64, i64]
            lib.cgx_quantize.restype = c_int
            lib.cgx_dequantize.argtypes = [ptr, i64, c_int, i64, ptr, c_int, c_int, i64, i64]
            lib.cgx_dequantize.restype = c_int
            lib.cgx_rotate.argtypes = [ptr, i64, i64, u32, c_int, i64, i64]
            lib.cgx_rotate.restype = c_int
            lib.cgx_simd_path.argtypes = []
            lib.cgx_simd_path.restype = ctypes.c_char_p
            lib.cgx_set_simd_path.argtypes = [c_int]
            lib.cgx_set_simd_path.restype = c_int
            _lib = lib
        except (OSError, AttributeError) as exc:  # missing file, bad ELF, missing symbol
            _load_error = str(exc)
        _loaded = True
    return _lib


def available() -> bool:
    """True when the C extension is built and loadable."""
    return load_library() is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    load_library()
    return _load_error


def simd_path() -> str:
    """Instruction set the C kernels dispatched to on this CPU ("avx2" or "generic")."""
    return _require().cgx_simd_path().decode()


def _set_simd_path(name: str) -> None:
    """Force the "avx2" or the "generic" kernels (tests and benchmarks only: not thread-safe).

    Raises:
        ValueError: unknown name, or "avx2" on a CPU without AVX2/F16C.
    """
    if name not in ("avx2", "generic"):
        raise ValueError(f"unknown SIMD path {name!r}; expected 'avx2' or 'generic'")
    if _require().cgx_set_simd_path(int(name == "avx2")) != 0:
        raise ValueError(f"this CPU cannot run the {name!r} kernels")


def _require() -> ctypes.CDLL:
    lib = load_library()
    if lib is None:
        raise CGXError(f"cgx's C quantization path is not available: {_load_error}")
    return lib


def _reset_pool_after_fork() -> None:
    # A forked child inherits the executor object but none of its threads;
    # submitting to it would wait forever, so start from scratch.
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_pool_after_fork)


def _get_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cgx-quant")
            _pool_size = workers
        return _pool


def _check_threads(threads: int) -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads={threads!r} is not valid; expected an int in [1, {MAX_THREADS}] "
                         "(Config.cpu_threads / CGX_CPU_THREADS)")
    return threads


def _check_layout(bits: int, bucket_size: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r} is not supported; expected an int in [1, 8]")
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) \
            or bucket_size < 8 or bucket_size % 8:
        raise ValueError(f"bucket_size={bucket_size!r} is not supported; expected a positive "
                         "multiple of 8 (each bucket's codes fill whole bytes)")


def _check_values(t: torch.Tensor, what: str) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    code = _DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(f"{what} has dtype {t.dtype}; the C path handles float32, float16 and "
                        "bfloat16")
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}; the C path runs on CPU tensors")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous; call .contiguous() first")
    return code


def _check_payload(p: torch.Tensor, need: int, what: str) -> None:
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8:
        raise TypeError(f"{what} must be a uint8 torch.Tensor, got "
                        f"{getattr(p, 'dtype', type(p).__name__)}")
    if p.device.type != "cpu":
        raise ValueError(f"{what} is on {p.device}; the C path runs on CPU tensors")
    if not p.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if p.numel() < need:
        raise ValueError(f"{what} has {p.numel()} bytes but the segment needs {need}")


def _run(fn, nb: int, numel: int, bucket_size: int, threads: int) -> None:
    """Call ``fn(b0, b1)`` over bucket ranges covering [0, nb), on up to ``threads`` threads."""
    pieces = min(threads, nb, max(1, numel // MIN_VALUES_PER_THREAD))
    if pieces <= 1:
        rc = fn(0, nb)
        if rc != 0:
            raise CGXError(f"cgx C kernel rejected its arguments (rc={rc}); this is a bug in cgx")
        return
    bounds = [nb * k // pieces for k in range(pieces + 1)]
    pool = _get_pool(pieces - 1)
    futures = [pool.submit(fn, bounds[k], bounds[k + 1]) for k in range(1, pieces)]
    rcs = [fn(bounds[0], bounds[1])]  # the calling thread takes the first piece
    rcs += [f.result() for f in futures]
    if any(rcs):
        raise CGXError(f"cgx C kernel rejected its arguments (rc={rcs}); this is a bug in cgx")


def quantize(x: torch.Tensor, bits: int, bucket_size: int, stochastic: bool, key: int = 0,
             index_offset: int = 0, write_back: bool = False,
             out: Optional[torch.Tensor] = None, *, threads: int = 1) -> torch.Tensor:
    """Quantize ``x`` (float32/float16/bfloat16, contiguous CPU) into a wire-format segment.

    Args:
        x: values (treated as 1-D); overwritten with the decoded values when ``write_back``.
        bits, bucket_size, stochastic: the layout and rounding (see ``wire``).
        key, index_offset: stochastic-rounding counter (taken mod 2**32).
        write_back: fused requantize: ``x`` receives exactly what a receiver decodes.
        out: uint8 destination of at least ``wire.packed_nbytes`` bytes (its first
            ``packed_nbytes`` bytes are written, padding included); allocated when None.
        threads: bucket ranges processed concurrently (1 = the calling thread only).

    Returns:
        The segment: ``out[:packed_nbytes]`` or a new uint8 tensor.
    """
    lib = _require()
    dt = _check_values(x, "x")
    _check_layout(bits, bucket_size)
    _check_threads(threads)
    n = x.numel()
    nbytes = wire.packed_nbytes(n, bits, bucket_size)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)  # every byte is written below
    else:
        _check_payload(out, nbytes, "out")
        out = out[:nbytes]
    if n == 0:
        return out
    nb = wire.num_buckets(n, bucket_size)
    xp, op = x.data_ptr(), out.data_ptr()
    key32, off32 = int(key) & wire.MASK32, int(index_offset) & wire.MASK32

    def piece(b0: int, b1: int) -> int:
        return lib.cgx_quantize(xp, dt, n, bits, bucket_size, int(bool(stochastic)), key32, off32,
                                int(bool(write_back)), op, b0, b1)

    _run(piece, nb, n, bucket_size, threads)
    return out


def dequantize(payload: torch.Tensor, numel: int, bits: int, bucket_size: int,
               out: Optional[torch.Tensor] = None, accumulate: bool = False, *,
               dtype: torch.dtype = torch.float32, threads: int = 1) -> torch.Tensor:
    """Decode ``numel`` values of a segment into ``out`` (or a new ``dtype`` tensor).

    Args:
        payload: contiguous uint8 CPU segment of at least ``wire.packed_nbytes`` bytes.
        numel, bits, bucket_size: the layout it was made with.
        out: contiguous float32/float16/bfloat16 CPU tensor of ``numel`` values.
        accumulate: ``out = dtype(float32(out) + decoded)`` instead of overwriting.
        dtype: dtype of a newly allocated ``out``.
        threads: bucket ranges processed concurrently (1 = the calling thread only).

    Returns:
        ``out``.
    """
    lib = _require()
    _check_layout(bits, bucket_size)
    _check_threads(threads)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r} must be an int >= 0")
    _check_payload(payload, wire.packed_nbytes(numel, bits, bucket_size), "payload")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an `out` tensor to add into")
        out = torch.empty(numel, dtype=dtype)
    dt = _check_values(out, "out")
    if out.numel() != numel:
        raise ValueError(f"out has {out.numel()} values, expected numel={numel}")
    if numel == 0:
        return out
    nb = wire.num_buckets(numel, bucket_size)
    pp, op = payload.data_ptr(), out.data_ptr()

    def piece(b0: int, b1: int) -> int:
        return lib.cgx_dequantize(pp, numel, bits, bucket_size, op, dt, int(bool(accumulate)),
                                  b0, b1)

    _run(piece, nb, numel, bucket_size, threads)
    return out


def rotate(v: torch.Tensor, bucket_size: int, key: int, inverse: bool = False, *,
           threads: int = 1) -> torch.Tensor:
    """The randomized Hadamard rotation of ``wire`` ("Rotation"), in place.

    Args:
        v: contiguous float32 CPU values (rotated values when ``inverse``).
        bucket_size: the segment's bucket size (fixes the Hadamard blocks).
        key: ``wire.rotation_key(...)`` (taken mod 2**32).
        inverse: undo a rotation.
        threads: blocks processed concurrently (1 = the calling thread only).

    Returns:
        ``v``.
    """
    lib = _require()
    if _check_values(v, "v") != _DTYPE_CODES[torch.float32]:
        raise TypeError(f"v has dtype {v.dtype}; the rotation runs on float32 values")
    _check_layout(1, bucket_size)
    _check_threads(threads)
    n = v.numel()
    block = wire.rotation_block(bucket_size)
    units = n // block + (n % block != 0)
    if n == 0:
        return v
    vp, key32 = v.data_ptr(), int(key) & wire.MASK32

    def piece(u0: int, u1: int) -> int:
        return lib.cgx_rotate(vp, n, block, key32, int(bool(inverse)), u0, u1)

    _run(piece, units, n, bucket_size, threads)
    return v
