"""The fused C CPU path (cgx._cquant via cgx.quant.cpu) against the torch reference.

Bit-exact for nearest and stochastic rounding, every dtype and bit width,
irregular sizes, both instruction-set builds (AVX2 and generic), any number of
threads; plus every validation branch of cpu.py.
"""

from __future__ import annotations

import ctypes
import multiprocessing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cgx.quant import cpu, wire
from cgx.errors import CGXError
from cgx.kernels import reference

from quant_cases import ALL_BITS, DTYPES, SIZES_64, assert_same_payload, assert_same_values, \
    randn, special_inputs


def test_extension_is_built():
    # `make test` builds it; a missing build must fail here, not skip the file
    assert cpu.available(), cpu.unavailable_reason()
    assert cpu.unavailable_reason() is None
    assert cpu.simd_path() in ("avx2", "generic")


def _paths():
    paths = ["generic"]
    if cpu.available():
        with_avx2 = cpu.simd_path() == "avx2"
        paths.insert(0, "avx2" if with_avx2 else pytest.param(
            "avx2", marks=pytest.mark.skip(reason="this CPU has no AVX2/F16C")))
    return paths


@pytest.fixture(params=_paths())
def simd(request):
    """Run a test on each instruction-set build of the C kernels, then restore the default."""
    default = cpu.simd_path()
    cpu._set_simd_path(request.param)
    yield request.param
    cpu._set_simd_path(default)


def _check_all_ops(x, bits, bucket, stochastic, key=0, index_offset=0, threads=1):
    """quantize, write_back, dequantize and accumulate of the C path == the reference."""
    n = x.numel()
    expect = reference.quantize(x.clone(), bits, bucket, stochastic, key, index_offset)
    got = cpu.quantize(x, bits, bucket, stochastic, key, index_offset, threads=threads)
    assert_same_payload(got, expect, n, bucket)

    y_ref, y_c = x.clone(), x.clone()
    reference.quantize(y_ref, bits, bucket, stochastic, key, index_offset, write_back=True)
    cpu.quantize(y_c, bits, bucket, stochastic, key, index_offset, write_back=True,
                 threads=threads)
    assert_same_values(y_c, y_ref)

    out_ref = reference.dequantize(expect, n, bits, bucket, dtype=x.dtype)
    assert_same_values(cpu.dequantize(expect, n, bits, bucket, dtype=x.dtype, threads=threads),
                       out_ref)
    acc = randn(n, seed=n + bits, dtype=x.dtype)
    acc_ref = reference.dequantize(expect, n, bits, bucket, out=acc.clone(), accumulate=True)
    acc_c = cpu.dequantize(expect, n, bits, bucket, out=acc.clone(), accumulate=True,
                           threads=threads)
    assert_same_values(acc_c, acc_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_bit_exact_against_reference(simd, dtype, bits, stochastic):
    for i, n in enumerate(SIZES_64):
        x = randn(n, seed=100 * bits + i, dtype=dtype, scale=3.0)
        _check_all_ops(x, bits, 64, stochastic, key=0xC0FFEE + i, index_offset=17 * i)


@pytest.mark.parametrize("bucket", [8, 24, 1000, 4096])
def test_bit_exact_other_bucket_sizes(simd, bucket):
    for n in (1, bucket - 1, bucket + 1, 3 * bucket + 5):
        for bits in (2, 5):
            _check_all_ops(randn(n, seed=n, dtype=torch.float32), bits, bucket, True, key=3)


@pytest.mark.parametrize("name", list(special_inputs()))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bit_exact_on_special_inputs(simd, name, dtype):
    x = special_inputs()[name].to(dtype)
    for bits in (1, 4, 8):
        for stochastic in (False, True):
            _check_all_ops(x, bits, 64, stochastic, key=77)


def test_counter_wraps_at_2_to_the_32():
    x = randn(1000, seed=1)
    _check_all_ops(x, 4, 64, True, key=2**32 - 1, index_offset=2**32 - 500)
    # offsets are taken mod 2**32, as in the reference
    assert torch.equal(cpu.quantize(x, 4, 64, True, key=5, index_offset=2**32 + 3),
                       cpu.quantize(x, 4, 64, True, key=5, index_offset=3))


_floats = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=150, deadline=None)
@given(values=st.lists(_floats, min_size=0, max_size=200),
       bits=st.integers(1, 8), bucket=st.sampled_from([8, 16, 24, 64]),
       stochastic=st.booleans(), key=st.integers(0, 2**32 - 1),
       index_offset=st.integers(0, 2**33), dtype=st.sampled_from(DTYPES))
def test_random_inputs_bit_exact(values, bits, bucket, stochastic, key, index_offset, dtype):
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    if bits == 1:
        # one bit over a range wider than FLT_MAX: the unit overflows to inf and the
        # reference truncates NaN codes (platform-defined); see docs/wire-format.md
        finite = x[torch.isfinite(x)].float()
        if finite.numel() and float(finite.max().double() - finite.min().double()) > 3.4e38:
            x = x / 4
    _check_all_ops(x, bits, bucket, stochastic, key, index_offset)


# bits 6: the kernel stores 8-byte words for 5..7 bits, which reach into the next
# group's bytes; threads quantize neighbouring buckets at the same time
@pytest.mark.parametrize("bits", [3, 6])
@pytest.mark.parametrize("threads", [2, 3, 7])
def test_threads_give_identical_results(monkeypatch, threads, bits):
    monkeypatch.setattr(cpu, "MIN_VALUES_PER_THREAD", 64)  # split small inputs into many pieces
    x = randn(64 * 13 + 5, seed=threads)
    _check_all_ops(x, bits, 64, True, key=9, index_offset=4, threads=threads)
    assert torch.equal(cpu.quantize(x, bits, 64, True, 9, 4, threads=threads),
                       cpu.quantize(x, bits, 64, True, 9, 4, threads=1))


def test_threads_below_the_split_size_stay_on_the_caller(monkeypatch):
    monkeypatch.setattr(cpu, "_get_pool", lambda workers: pytest.fail("pool used"))
    x = randn(1000, seed=2)  # < MIN_VALUES_PER_THREAD
    assert torch.equal(cpu.quantize(x, 4, 64, False, threads=4),
                       reference.quantize(x, 4, 64, False))


def _quantize_in_child(queue):
    x = randn(4096, seed=3)
    queue.put(cpu.quantize(x, 4, 64, True, key=1, threads=2).tolist())


def test_thread_pool_survives_fork(monkeypatch):
    monkeypatch.setattr(cpu, "MIN_VALUES_PER_THREAD", 64)
    x = randn(4096, seed=3)
    expect = cpu.quantize(x, 4, 64, True, key=1, threads=2)  # the parent's pool now exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_quantize_in_child, args=(queue,))
    child.start()
    got = queue.get(timeout=60)  # a child stuck on the parent's dead pool would time out
    child.join(timeout=60)
    assert child.exitcode == 0 and got == expect.tolist()


def test_out_slice_at_odd_offset_and_guard_bytes():
    n, bits, bucket = 1001, 5, 64
    x = randn(n, seed=4)
    need = wire.packed_nbytes(n, bits, bucket)
    buf = torch.full((need + 11,), 0xA5, dtype=torch.uint8)
    seg = cpu.quantize(x, bits, bucket, True, key=2, out=buf[3:])
    assert seg.data_ptr() == buf.data_ptr() + 3 and seg.numel() == need
    assert bool((buf[:3] == 0xA5).all()) and bool((buf[3 + need:] == 0xA5).all())
    assert torch.equal(seg, reference.quantize(x, bits, bucket, True, key=2))
    out = torch.zeros(n + 1)[1:]  # values at an offset of 4 bytes
    assert torch.equal(cpu.dequantize(seg, n, bits, bucket, out=out),
                       reference.dequantize(seg, n, bits, bucket))


def test_stochastic_is_unbiased_on_many_seeds():
    bits, bucket, n, trials = 1, 64, 4096, 1000
    x = randn(n, seed=5)
    total = torch.zeros(n, dtype=torch.float64)
    buf = torch.empty(n)
    for t in range(trials):
        payload = cpu.quantize(x, bits, bucket, True, key=wire.noise_key(7, t))
        total += cpu.dequantize(payload, n, bits, bucket, out=buf).double()
    unit = cpu.quantize(x, bits, bucket, False)[: 8 * (n // bucket)].view(torch.float32)[0::2]
    u = unit.double().repeat_interleave(bucket)
    bias = (total / trials - x.double()) / u
    assert float(bias.abs().max()) < 6 / (2 * trials ** 0.5)  # 6 sigma per value
    assert abs(float(bias.mean())) < 6 / (2 * (trials * n) ** 0.5)


def test_empty_tensors():
    assert cpu.quantize(torch.empty(0), 4, 64, True).numel() == 0
    out = cpu.dequantize(torch.empty(0, dtype=torch.uint8), 0, 4, 64, dtype=torch.bfloat16)
    assert out.numel() == 0 and out.dtype == torch.bfloat16


# ---------------------------------------------------------------- validation


def test_quantize_validation():
    x = torch.zeros(64)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        cpu.quantize([0.0] * 8, 4, 64, False)
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        cpu.quantize(x.double(), 4, 64, False)
    with pytest.raises(ValueError, match="x is on meta; the C path runs on CPU"):
        cpu.quantize(torch.zeros(64, device="meta"), 4, 64, False)
    with pytest.raises(ValueError, match="x must be contiguous"):
        cpu.quantize(torch.zeros(8, 8).t(), 4, 64, False)
    for bits in (0, 9, True, 4.0):
        with pytest.raises(ValueError, match=f"bits={bits!r} is not supported"):
            cpu.quantize(x, bits, 64, False)
    for bucket in (0, 12, -8, True, "64"):
        with pytest.raises(ValueError, match=f"bucket_size={bucket!r} is not supported"):
            cpu.quantize(x, 4, bucket, False)
    for threads in (0, 257, True, 2.0):
        with pytest.raises(ValueError, match=f"threads={threads!r} is not valid"):
            cpu.quantize(x, 4, 64, False, threads=threads)
    with pytest.raises(TypeError, match="out must be a uint8"):
        cpu.quantize(x, 4, 64, False, out=torch.zeros(64))
    with pytest.raises(ValueError, match="out has 39 bytes but the segment needs 40"):
        cpu.quantize(x, 4, 64, False, out=torch.zeros(39, dtype=torch.uint8))
    with pytest.raises(ValueError, match="out must be contiguous"):
        cpu.quantize(x, 4, 64, False, out=torch.zeros(100, dtype=torch.uint8)[::2])
    with pytest.raises(ValueError, match="out is on meta"):
        cpu.quantize(x, 4, 64, False, out=torch.zeros(40, dtype=torch.uint8, device="meta"))


def test_dequantize_validation():
    payload = cpu.quantize(torch.zeros(64), 4, 64, False)
    with pytest.raises(ValueError, match="numel=-1 must be an int >= 0"):
        cpu.dequantize(payload, -1, 4, 64)
    with pytest.raises(ValueError, match="numel=True must be an int >= 0"):
        cpu.dequantize(payload, True, 4, 64)
    with pytest.raises(ValueError, match="bits=0 is not supported"):
        cpu.dequantize(payload, 64, 0, 64)
    with pytest.raises(TypeError, match="payload must be a uint8"):
        cpu.dequantize(payload.float(), 64, 4, 64)
    with pytest.raises(ValueError, match="payload has 39 bytes but the segment needs 40"):
        cpu.dequantize(payload[:39], 64, 4, 64)
    with pytest.raises(ValueError, match="accumulate=True needs an `out`"):
        cpu.dequantize(payload, 64, 4, 64, accumulate=True)
    with pytest.raises(TypeError, match="out has dtype torch.int64"):
        cpu.dequantize(payload, 64, 4, 64, out=torch.zeros(64, dtype=torch.int64))
    with pytest.raises(ValueError, match="out has 65 values, expected numel=64"):
        cpu.dequantize(payload, 64, 4, 64, out=torch.zeros(65))
    with pytest.raises(ValueError, match="threads=0 is not valid"):
        cpu.dequantize(payload, 64, 4, 64, threads=0)


def test_c_entry_points_reject_bad_arguments():
    lib = cpu._require()  # the C guards behind the Python checks: no memory is touched
    x, out = torch.zeros(64), torch.zeros(40, dtype=torch.uint8)
    args = dict(dtype=0, n=64, bits=4, bucket=64, b0=0, b1=1)
    for bad in (dict(bits=9), dict(bits=0), dict(bucket=12), dict(dtype=3), dict(n=-1),
                dict(b1=2), dict(b0=1, b1=0), dict(b0=-1)):
        a = {**args, **bad}
        assert lib.cgx_quantize(x.data_ptr(), a["dtype"], a["n"], a["bits"], a["bucket"], 0, 0,
                                0, 0, out.data_ptr(), a["b0"], a["b1"]) == -1, bad
        assert lib.cgx_dequantize(out.data_ptr(), a["n"], a["bits"], a["bucket"], x.data_ptr(),
                                  a["dtype"], 0, a["b0"], a["b1"]) == -1, bad


def test_kernel_error_code_raises(monkeypatch):
    class FailingLib:
        cgx_quantize = staticmethod(lambda *args: -1)
        cgx_dequantize = staticmethod(lambda *args: -1)
    monkeypatch.setattr(cpu, "_lib", FailingLib())
    with pytest.raises(CGXError, match="rejected its arguments \\(rc=-1\\)"):
        cpu.quantize(torch.zeros(64), 4, 64, False)
    monkeypatch.setattr(cpu, "MIN_VALUES_PER_THREAD", 8)
    with pytest.raises(CGXError, match="rejected its arguments \\(rc=\\[-1, -1\\]\\)"):
        cpu.dequantize(torch.zeros(48, dtype=torch.uint8), 64, 4, 32, threads=2)


def test_unbuilt_extension_is_reported(monkeypatch):
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_load_error", None)
    monkeypatch.setattr(cpu, "_loaded", False)
    monkeypatch.setattr(cpu.importlib.util, "find_spec", lambda name: None)
    assert not cpu.available()
    assert "not built" in cpu.unavailable_reason()
    with pytest.raises(CGXError, match="path is not available: cgx._cquant is not built"):
        cpu.quantize(torch.zeros(8), 4, 8, False)


def test_broken_library_is_reported(monkeypatch, tmp_path):
    bogus = tmp_path / "_cquant.so"
    bogus.write_bytes(b"not an ELF file")

    class Spec:
        origin = str(bogus)
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_load_error", None)
    monkeypatch.setattr(cpu, "_loaded", False)
    monkeypatch.setattr(cpu.importlib.util, "find_spec", lambda name: Spec)
    assert not cpu.available()
    assert "_cquant.so" in cpu.unavailable_reason()


def test_simd_path_selection():
    with pytest.raises(ValueError, match="unknown SIMD path 'sse9'"):
        cpu._set_simd_path("sse9")
    default = cpu.simd_path()
    try:
        cpu._set_simd_path("generic")
        assert cpu.simd_path() == "generic"
    finally:
        cpu._set_simd_path(default)
    assert cpu.simd_path() == default


def test_module_is_a_legal_extension():
    import cgx._cquant as mod  # importable like any extension, the kernels live behind ctypes
    assert "ctypes" in mod.__doc__
    assert isinstance(cpu._require(), ctypes.CDLL)


def test_public_api_passes_threads_to_the_c_path():
    """quantization.quantize/dequantize(threads=2) (CGX_CPU_THREADS) give the same bytes."""
    from cgx.quant.codec import QuantSpec, dequantize, quantize
    from cgx.config import Rounding

    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    spec = QuantSpec(4, 1024, Rounding.STOCHASTIC)
    one = quantize(x, spec, key=9, backend="c", threads=1)
    two = quantize(x, spec, key=9, backend="c", threads=2)
    assert torch.equal(one, two)
    assert torch.equal(dequantize(one, x.numel(), spec, backend="c", threads=2),
                       dequantize(one, x.numel(), spec, backend="c"))
