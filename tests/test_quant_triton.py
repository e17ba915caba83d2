"""Triton kernels (kernels/quantize.py, kernels/dequantize.py) against the torch reference.

On a machine without CUDA they run under TRITON_INTERPRET=1 (set by
conftest.py), which costs ~ms per program: inputs stay small and each test
covers several cases per launch. Tests marked ``gpu`` need a CUDA device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cgx.quant import wire
from cgx.kernels import dequantize as tdq
from cgx.kernels import quantize as tq
from cgx.kernels import reference

from quant_cases import ALL_BITS, DTYPES, assert_same_payload, assert_same_values, randn, \
    special_inputs

# numpy warns about NaN arithmetic inside the interpreter (non-finite buckets)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture(scope="module")
def device():
    if HAS_CUDA:
        return torch.device("cuda")
    if tq.is_interpreted(tq._quantize_kernel):
        return torch.device("cpu")
    pytest.skip("no CUDA device and TRITON_INTERPRET is off: nothing can run the kernels")


def _check_all_ops(x, bits, bucket, stochastic, device, key=0, index_offset=0):
    """quantize, write_back, dequantize and accumulate of Triton == the reference (on CPU)."""
    n = x.numel()
    expect = reference.quantize(x.clone(), bits, bucket, stochastic, key, index_offset)
    got = tq.quantize(x.to(device), bits, bucket, stochastic, key, index_offset)
    assert_same_payload(got.cpu(), expect, n, bucket)

    y_ref, y_t = x.clone(), x.to(device)
    reference.quantize(y_ref, bits, bucket, stochastic, key, index_offset, write_back=True)
    tq.quantize(y_t, bits, bucket, stochastic, key, index_offset, write_back=True)
    assert_same_values(y_t.cpu(), y_ref)

    acc = randn(n, seed=n + bits, dtype=x.dtype)
    acc_ref = reference.dequantize(expect, n, bits, bucket, out=acc.clone(), accumulate=True)
    acc_t = tdq.dequantize(expect.to(device), n, bits, bucket, out=acc.to(device),
                           accumulate=True)
    assert_same_values(acc_t.cpu(), acc_ref)
    out_ref = reference.dequantize(expect, n, bits, bucket, dtype=x.dtype)
    assert_same_values(tdq.dequantize(expect.to(device), n, bits, bucket, dtype=x.dtype).cpu(),
                       out_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_bit_exact_against_reference(device, dtype, bits, stochastic):
    # 1000 values, bucket 64: 15 full buckets and a partial one ending mid-group
    x = randn(1000, seed=bits, dtype=dtype, scale=3.0)
    _check_all_ops(x, bits, 64, stochastic, device, key=0xFEED + bits, index_offset=2**32 - 300)


@pytest.mark.parametrize("n,bucket", [(1, 8), (7, 8), (9, 8), (1023, 1024), (1025, 1024),
                                      (4099, 1000), (513, 24)])
def test_irregular_shapes(device, n, bucket):
    x = randn(n, seed=n, scale=0.1)
    for stochastic in (False, True):
        _check_all_ops(x, 3, bucket, stochastic, device, key=2**31 + 5)


def test_special_inputs(device):
    # all cases in one segment of 64-value buckets (every case starts on a bucket boundary)
    cases = special_inputs(64)
    parts = [torch.nn.functional.pad(x, (0, -x.numel() % 64)) for x in cases.values()]
    x = torch.cat(parts)
    for bits in (1, 8):
        _check_all_ops(x, bits, 64, bits == 1, device, key=11)
    _check_all_ops(x.to(torch.bfloat16), 4, 64, True, device, key=12)


def test_chunked_buckets(device, monkeypatch):
    # buckets wider than MAX_BLOCK are walked in chunks (two loops); 200 = 3 * 64 + 8
    monkeypatch.setattr(tq, "MAX_BLOCK", 64)
    x = randn(200 * 3 + 13, seed=4)
    x[450] = float("nan")  # the nan sits in a later chunk of bucket 2
    for stochastic in (False, True):
        _check_all_ops(x, 5, 200, stochastic, device, key=3)
    _check_all_ops(x.to(torch.float16), 2, 200, True, device, key=4)


def test_many_programs(device, monkeypatch):
    # several programs, the last one partly empty
    monkeypatch.setattr(tq, "INTERPRETER_TILE", 256)
    monkeypatch.setattr(tq, "TILE", 256)
    x = randn(64 * 9 + 3, seed=5)
    _check_all_ops(x, 4, 64, True, device, key=6)


def test_out_slice_at_odd_offset_and_guard_bytes(device):
    n, bits, bucket = 1001, 5, 64
    x = randn(n, seed=6)
    need = wire.packed_nbytes(n, bits, bucket)
    buf = torch.full((need + 11,), 0xA5, dtype=torch.uint8, device=device)
    seg = tq.quantize(x.to(device), bits, bucket, True, key=2, out=buf[3:])
    assert seg.data_ptr() == buf.data_ptr() + 3 and seg.numel() == need
    buf = buf.cpu()
    assert bool((buf[:3] == 0xA5).all()) and bool((buf[3 + need:] == 0xA5).all())
    assert torch.equal(seg.cpu(), reference.quantize(x, bits, bucket, True, key=2))
    # reading a segment that starts at an odd byte offset
    dec = tdq.dequantize(seg, n, bits, bucket)
    assert torch.equal(dec.cpu(), reference.dequantize(seg.cpu(), n, bits, bucket))


def test_padding_is_zeroed_in_a_dirty_out(device):
    n, bits = 9, 3  # 8 * 2 meta + 3 * 2 codes = 22 bytes, padded to 24
    out = torch.full((24,), 0xFF, dtype=torch.uint8, device=device)
    seg = tq.quantize(randn(n, seed=7).to(device), bits, 8, False, out=out)
    assert seg.cpu()[22:].tolist() == [0, 0]
    assert torch.equal(seg.cpu(), reference.quantize(randn(n, seed=7), bits, 8, False))


def test_empty_tensors(device):
    assert tq.quantize(torch.empty(0, device=device), 4, 64, True).numel() == 0
    out = tdq.dequantize(torch.empty(0, dtype=torch.uint8, device=device), 0, 4, 64,
                         dtype=torch.float16)
    assert out.numel() == 0 and out.dtype == torch.float16


# ---------------------------------------------------------------- validation


def test_quantize_validation(device):
    x = torch.zeros(64, device=device)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        tq.quantize([0.0], 4, 64, False)
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        tq.quantize(torch.zeros(64, dtype=torch.int32, device=device), 4, 64, False)
    with pytest.raises(ValueError, match="x must be contiguous"):
        tq.quantize(torch.zeros(8, 8, device=device).t(), 4, 64, False)
    with pytest.raises(ValueError, match="bits=9 is not supported"):
        tq.quantize(x, 9, 64, False)
    with pytest.raises(ValueError, match="bits=True is not supported"):
        tq.quantize(x, True, 64, False)
    with pytest.raises(ValueError, match="bucket_size=20 is not supported"):
        tq.quantize(x, 4, 20, False)
    with pytest.raises(ValueError, match="bucket_size=33554432 is not supported"):
        tq.quantize(x, 4, 1 << 25, False)
    with pytest.raises(ValueError, match="x is on meta; cgx's Triton kernels run on CUDA"):
        tq.quantize(torch.zeros(64, device="meta"), 4, 64, False)
    with pytest.raises(TypeError, match="out must be a uint8"):
        tq.quantize(x, 4, 64, False, out=torch.zeros(64, device=device))
    with pytest.raises(ValueError, match="out has 39 bytes but the segment needs 40"):
        tq.quantize(x, 4, 64, False, out=torch.zeros(39, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="out must be contiguous"):
        tq.quantize(x, 4, 64, False, out=torch.zeros(80, dtype=torch.uint8, device=device)[::2])
    with pytest.raises(ValueError, match="out is on meta but x on"):
        tq.quantize(x, 4, 64, False, out=torch.zeros(40, dtype=torch.uint8, device="meta"))


def test_dequantize_validation(device):
    payload = torch.zeros(40, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match="numel=-3 must be an int >= 0"):
        tdq.dequantize(payload, -3, 4, 64)
    with pytest.raises(ValueError, match="bits=0 is not supported"):
        tdq.dequantize(payload, 64, 0, 64)
    with pytest.raises(TypeError, match="payload must be a uint8"):
        tdq.dequantize(payload.float(), 64, 4, 64)
    with pytest.raises(ValueError, match="payload has 40 bytes but the segment needs 56"):
        tdq.dequantize(payload, 65, 4, 64)
    with pytest.raises(ValueError, match="payload is on meta"):
        tdq.dequantize(torch.zeros(40, dtype=torch.uint8, device="meta"), 64, 4, 64)
    with pytest.raises(ValueError, match="accumulate=True needs an `out`"):
        tdq.dequantize(payload, 64, 4, 64, accumulate=True)
    with pytest.raises(TypeError, match="out has dtype torch.float64"):
        tdq.dequantize(payload, 64, 4, 64, out=torch.zeros(64, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="out has 63 values, expected numel=64"):
        tdq.dequantize(payload, 64, 4, 64, out=torch.zeros(63, device=device))
    with pytest.raises(ValueError, match="out is on meta but payload on"):
        tdq.dequantize(payload, 64, 4, 64, out=torch.zeros(64, device="meta"))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(tq, "is_interpreted", lambda kernel: False)
    with pytest.raises(ValueError, match="x is on cpu; cgx's Triton kernels run on CUDA tensors"):
        tq.quantize(torch.zeros(64), 4, 64, False)


# ---------------------------------------------------------------- CUDA code generation

# Compiles both kernels for sm_90 (PTX and cubin, with the ptxas bundled in the triton
# wheel; no GPU needed) with the argument specialization a real launch applies, and
# checks the bit-exactness guarantees in the generated code. Runs in a subprocess
# because this process decorated the kernels for the interpreter.
_COMPILE_FOR_CUDA = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type
    from cgx.kernels import dequantize as tdq, quantize as tq

    def ptx(kernel, args, **consts):
        sig, cx = {}, {}
        for p in kernel.params:
            if p.name in consts:
                sig[p.name], cx[p.name] = "constexpr", consts[p.name]
            elif isinstance(args[p.name], str):  # a pointer type
                sig[p.name] = args[p.name]
            else:  # what a launch does with an int: 1 becomes a constant unless excluded
                sig[p.name] = mangle_type(args[p.name], not p.do_not_specialize)
                if sig[p.name] == "constexpr":
                    cx[p.name] = args[p.name]
        src = ASTSource(kernel, sig, cx)
        opts = dict(num_warps=4, enable_fp_fusion=False)  # as the launchers pass it
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

    ones = dict(n=1, num_buckets=1, key=1, index_offset=1, raw_nbytes=1, padded_nbytes=1)
    for x_ptr, bf16, bucket, block in (("*fp32", False, 1024, 1024), ("*i16", True, 200, 64)):
        code = ptx(tq._quantize_kernel, dict(ones, x_ptr=x_ptr, payload_ptr="*u8"), BITS=3,
                   BUCKET=bucket, BLOCK=block, ROWS=2, BITS_P2=4, STOCHASTIC=True,
                   WRITE_BACK=True, BF16=bf16)
        assert "fma." not in code, "an FMA would round differently from the reference"
        assert "div.rn.f32" in code and "div.rn.f64" in code, "1/unit must be IEEE division"
        assert "div.full" not in code and "div.approx" not in code
    for out_ptr, bf16 in (("*fp32", False), ("*i16", True)):
        code = ptx(tdq._dequantize_kernel, dict(n=1, num_buckets=1, payload_ptr="*u8",
                                                  out_ptr=out_ptr), BITS=5, BUCKET=64,
                   BLOCK=64, ROWS=4, BITS_P2=8, ACCUMULATE=True, BF16=bf16)
        assert "fma." not in code
    from cgx.kernels import rotate as trot
    for block, rows in ((1024, 4), (1, 1)):  # the Hadamard rotation, a full tile and a tail
        code = ptx(trot._rotate_kernel, dict(v_ptr="*fp32", start=1, num_blocks=1, key=1),
                   BLOCK=block, LOG=block.bit_length() - 1, ROWS=rows, INVERSE=True)
        assert "fma." not in code
    print("compiled")
''')


def test_kernels_compile_for_cuda():
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_CUDA], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# ---------------------------------------------------------------- CUDA only


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_large_bit_exact(dtype):
    n = (1 << 21) + 12345
    x = randn(n, seed=8, dtype=dtype)
    x[777] = float("inf")
    for bits in (1, 2, 4, 8):
        for stochastic in (False, True):
            _check_all_ops(x, bits, 1024, stochastic, torch.device("cuda"), key=bits,
                           index_offset=2**32 - n // 2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_rotated_bit_exact(dtype):
    from cgx.config import Rounding
    from cgx.quant.codec import QuantSpec, dequantize, quantize
    n = (1 << 20) + 4099  # a tail of power-of-two blocks
    x = randn(n, seed=10, dtype=dtype)
    for bits, bucket, rounding in ((2, 1024, Rounding.STOCHASTIC), (4, 8192, Rounding.NEAREST)):
        spec = QuantSpec(bits, bucket, rounding, rotate=True)
        kw = dict(key=bits, index_offset=7, rotation_key=2**31 + bits)
        expect = quantize(x.clone(), spec, backend="torch", **kw)
        assert_same_payload(quantize(x.cuda(), spec, **kw).cpu(), expect, n, bucket)
        y_ref, y = x.clone(), x.cuda()
        quantize(y_ref, spec, backend="torch", write_back=True, **kw)
        quantize(y, spec, write_back=True, **kw)
        assert_same_values(y.cpu(), y_ref)
        acc = randn(n, seed=11, dtype=dtype)
        acc_ref = dequantize(expect, n, spec, out=acc.clone(), accumulate=True,
                             backend="torch", rotation_key=kw["rotation_key"])
        acc_t = dequantize(expect.cuda(), n, spec, out=acc.cuda(), accumulate=True,
                           rotation_key=kw["rotation_key"])
        assert_same_values(acc_t.cpu(), acc_ref)


@pytest.mark.gpu
@gpu
def test_gpu_wide_buckets_and_c_path_agree():
    from cgx.quant import cpu
    n = (1 << 20) + 3
    x = randn(n, seed=9)
    for bucket in (8, 1000, 8192, 1 << 16):  # one program per few buckets .. chunked buckets
        got = tq.quantize(x.cuda(), 3, bucket, True, key=5).cpu()
        assert_same_payload(got, reference.quantize(x, 3, bucket, True, key=5), n, bucket)
        if cpu.available():
            assert_same_payload(got, cpu.quantize(x, 3, bucket, True, key=5), n, bucket)
