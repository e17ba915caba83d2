"""Wire format v1, the torch reference (the executable spec) and the public quantization API.

The C path and the Triton kernels are checked bit for bit against the
reference in test_quant_cpu.py / test_quant_triton.py, so the properties
proven here (error bounds, unbiasedness, edge cases) hold for them too.
"""

from __future__ import annotations

import struct
import warnings

import pytest
import torch

from cgx.quant import codec as quantization
from cgx.quant import cpu, wire
from cgx.quant.codec import QuantSpec, dequantize, quantize
from cgx.config import Rounding
from cgx.errors import ConfigError
from cgx.kernels import reference

from quant_cases import ALL_BITS, DTYPES, SIZES_64, randn, special_inputs


def _meta(payload: torch.Tensor, numel: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    nb = wire.num_buckets(numel, bucket)
    m = payload[: 8 * nb].clone().view(torch.float32).view(nb, 2)
    return m[:, 0], m[:, 1]  # unit, lo


def _per_value(t: torch.Tensor, numel: int, bucket: int) -> torch.Tensor:
    return t.repeat_interleave(bucket)[:numel]


# ---------------------------------------------------------------- wire.py


@pytest.mark.parametrize("numel,bits,bucket,expected", [
    (0, 4, 1024, 0),
    (1, 1, 8, 16),  # 8 meta + 1 code byte = 9, padded to 16
    (8, 8, 8, 16),  # 8 meta + 8 code bytes
    (1024, 4, 1024, 520),  # 8 meta + 512 code bytes
    (1025, 4, 1024, 536),  # 16 meta + 4 * 129 code bytes = 532, padded to 536
    (1000, 3, 64, 504),  # 16 * 8 meta + 3 * 125 code bytes = 503, padded to 504
])
def test_packed_nbytes_formula(numel, bits, bucket, expected):
    assert wire.packed_nbytes(numel, bits, bucket) == expected
    assert QuantSpec(bits, bucket).nbytes(numel) == expected


def test_packed_nbytes_rejects_negative():
    with pytest.raises(ValueError, match="numel must be >= 0"):
        wire.packed_nbytes(-1, 4, 1024)


def test_header_round_trip():
    head = wire.pack_header(12345, 3, 512, 1)
    assert len(head) == wire.HEADER_BYTES == 16
    assert wire.unpack_header(head + b"payload") == (12345, 3, 512, 1)


def test_header_errors():
    head = wire.pack_header(7, 4, 1024, 0)
    with pytest.raises(ValueError, match="header has 16 bytes, got 15"):
        wire.unpack_header(head[:15])
    with pytest.raises(ValueError, match="not a cgx quantized payload"):
        wire.unpack_header(b"XXXX" + head[4:])
    with pytest.raises(ValueError, match="wire version 9"):
        wire.unpack_header(head[:4] + bytes([9]) + head[5:])
    with pytest.raises(ValueError, match="numel < 2\\*\\*31"):
        wire.pack_header(1 << 31, 4, 1024, 0)


def test_hash_and_noise_match_the_scalar_definition():
    idx = [0, 1, 2, 12345, 2**31, 2**32 - 1]
    for key in (0, 7, 0xDEADBEEF):
        vec = reference.hash32(key, torch.tensor(idx, dtype=torch.int64))
        assert vec.tolist() == [wire.hash32(key, i) for i in idx]
    r = reference.noise(0xDEADBEEF, 2**32 - 3, 40)  # the counter wraps mod 2**32
    assert r.tolist() == [wire.noise(0xDEADBEEF, 2**32 - 3, p) for p in range(40)]
    assert bool(((r >= 0) & (r < 1)).all())
    # One hash per two values 8 apart: its low half for the first, its high half after.
    h = wire.hash32(5, wire.noise_counter(100, 17))
    assert wire.noise_counter(100, 17) == wire.noise_counter(100, 25) == 100 + 8 + 1
    assert wire.noise(5, 100, 17) == (h & 0xFFFF) / 65536
    assert wire.noise(5, 100, 25) == (h >> 16) / 65536


def test_noise_counters_are_distinct_and_disjoint_across_segments():
    # Within a tensor no two positions share (counter, half); a tensor of n values uses
    # counters [off, off + n/2), so buffer offsets keep segments apart.
    n = 1000
    seen = {(wire.noise_counter(0, p), (p >> 3) & 1) for p in range(n)}
    assert len(seen) == n
    assert max(c for c, _ in seen) < n // 2 + 8
    assert not {c for c, _ in seen} & {wire.noise_counter(n, p) for p in range(64)}


def test_noise_is_uniform_and_independent_of_the_neighbour():
    r = reference.noise(0x1234, 0, 1 << 16).double()
    assert abs(r.mean().item() - 0.5) < 0.005
    assert abs(r.var().item() - 1 / 12) < 0.002
    a, b = r[:-8].view(-1), r[8:].view(-1)  # values sharing a hash
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02


def test_noise_key_separates_its_parts():
    keys = {wire.noise_key(s, st, t, g) for s in (0, 1) for st in (0, 5) for t in (0, 3)
            for g in (0, 1)}
    assert len(keys) == 16
    assert wire.noise_key(1, 2, 3, 4) == wire.noise_key(1, 2, 3, 4)
    assert 0 <= wire.noise_key(2**40, 2**35) <= wire.MASK32


# ---------------------------------------------------------------- bit packing


@pytest.mark.parametrize("bits", ALL_BITS)
def test_pack_unpack_identity(bits):
    gen = torch.Generator().manual_seed(bits)
    for n in (1, 7, 8, 9, 1000):
        q = torch.randint(0, 1 << bits, (n,), generator=gen, dtype=torch.int64)
        packed = reference._pack(q, bits)
        assert packed.numel() == wire.codes_nbytes(n, bits)
        assert torch.equal(reference._unpack(packed, n, bits), q)


def test_pack_layout_worked_example():
    # docs/wire-format.md: codes 1..8 at 3 bits -> one 24-bit little-endian word
    q = torch.arange(1, 9, dtype=torch.int64) % 8
    word = sum(int(c) << (3 * j) for j, c in enumerate(q))
    assert reference._pack(q, 3).tolist() == list(word.to_bytes(3, "little"))
    assert reference._pack(q, 3).tolist() == [0xD1, 0x58, 0x1F]


def test_segment_worked_example():
    # docs/wire-format.md: 10 values, 2 bits, bucket 8, nearest
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 0.4, 0.6, 2.5, 3.0, -1.0, 1.0])
    payload = reference.quantize(x, 2, 8, stochastic=False)
    assert payload.numel() == wire.packed_nbytes(10, 2, 8) == 24
    unit, lo = _meta(payload, 10, 8)
    assert unit.tolist() == [1.0, struct.unpack("<f", struct.pack("<f", 2 / 3))[0]]
    assert lo.tolist() == [0.0, -1.0]
    # codes 0,1,2,3,0,1,3,3 | 0,3 (+ six zero padding codes), 2 bits each, little-endian
    assert payload[16:].tolist() == [0xE4, 0xF4, 0x0C, 0x00, 0, 0, 0, 0]
    decoded = reference.dequantize(payload, 10, 2, 8)
    assert decoded.tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 3.0, 3.0, -1.0, 1.0]


# ---------------------------------------------------------------- error bounds


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_error_bound(bits, stochastic):
    bucket, n = 64, 64 * 7 + 13
    x = randn(n, seed=10 + bits) * torch.linspace(0.01, 100.0, n)  # scales vary per bucket
    payload = reference.quantize(x, bits, bucket, stochastic, key=99)
    decoded = reference.dequantize(payload, n, bits, bucket)
    unit, lo = _meta(payload, n, bucket)
    u = _per_value(unit, n, bucket).double()
    err = (decoded.double() - x.double()).abs()
    # float32 arithmetic adds a few ulps of the bucket's magnitude on top of the bound
    lo_v = _per_value(lo, n, bucket).double()
    slack = 4 * torch.finfo(torch.float32).eps * (x.double().abs() + lo_v.abs())
    bound = u if stochastic else u / 2
    if stochastic:
        assert bool((err < bound + slack).all()), float((err - bound).max())
    else:
        assert bool((err <= bound + slack).all()), float((err - bound).max())
    # the minimum of every bucket encodes as code 0 and decodes exactly
    for b, chunk in enumerate(x.split(bucket)):
        assert decoded[b * bucket + int(chunk.argmin())] == chunk.min()


def test_stochastic_is_unbiased():
    bits, bucket, n, trials = 2, 64, 256, 400
    x = randn(n, seed=3)
    total = torch.zeros(n, dtype=torch.float64)
    for t in range(trials):
        total += reference.dequantize(reference.quantize(x, bits, bucket, True, key=t), n, bits,
                                      bucket).double()
    nearest = reference.quantize(x, bits, bucket, False)
    unit, _ = _meta(nearest, n, bucket)
    u = _per_value(unit, n, bucket).double()
    bias = total / trials - x.double()
    # the mean of `trials` rounding errors (each within one unit, variance <= unit^2 / 4)
    # has a standard deviation <= unit / (2 sqrt(trials)); allow 6 of them
    assert bool((bias.abs() <= 6 * u / (2 * trials ** 0.5)).all())
    # nearest rounding, deterministic, keeps its per-value bias (up to unit / 2): the
    # check above would fail for it
    nearest_bias = reference.dequantize(nearest, n, bits, bucket).double() - x.double()
    assert float((nearest_bias.abs() / u).max()) > 0.4
    assert float((bias.abs() / u).max()) < 0.2


def test_nearest_is_deterministic_and_keyless():
    x = randn(300, seed=4)
    assert torch.equal(reference.quantize(x, 4, 64, False, key=1),
                       reference.quantize(x, 4, 64, False, key=2, index_offset=77))


def test_stochastic_depends_on_key_and_offset():
    x = randn(512, seed=5)
    a = reference.quantize(x, 3, 64, True, key=1)
    assert not torch.equal(a, reference.quantize(x, 3, 64, True, key=2))
    assert not torch.equal(a, reference.quantize(x, 3, 64, True, key=1, index_offset=1))
    assert torch.equal(a, reference.quantize(x, 3, 64, True, key=1))


# ---------------------------------------------------------------- edge cases


@pytest.mark.parametrize("n", SIZES_64)
def test_payload_size_and_padding(n):
    for bits in (1, 3, 8):
        payload = reference.quantize(randn(n, seed=n), bits, 64, False)
        assert payload.numel() == wire.packed_nbytes(n, bits, 64)
        raw = 8 * wire.num_buckets(n, 64) + wire.codes_nbytes(n, bits)
        assert bool((payload[raw:] == 0).all())  # alignment padding is zero
        if n % 8:  # the padding codes of the last group are zero too
            last = reference._unpack(payload[8 * wire.num_buckets(n, 64):], -(-n // 8) * 8, bits)
            assert bool((last[n:] == 0).all())


def test_empty_tensor():
    x = torch.empty(0)
    assert reference.quantize(x, 4, 64, True).numel() == 0
    assert reference.dequantize(torch.empty(0, dtype=torch.uint8), 0, 4, 64).numel() == 0
    assert quantize(x, QuantSpec(4, 64)).numel() == 0
    assert dequantize(torch.empty(0, dtype=torch.uint8), 0, QuantSpec(4, 64)).numel() == 0


def test_constant_buckets_decode_exactly():
    cases = special_inputs()
    for name in ("zeros", "constant", "constant_per_bucket", "one_value"):
        x = cases[name]
        for bits in (1, 4, 8):
            payload = reference.quantize(x, bits, 64, True, key=3)
            unit, _ = _meta(payload, x.numel(), 64)
            assert bool((unit == 0).all()), name
            assert torch.equal(reference.dequantize(payload, x.numel(), bits, 64), x), name


@pytest.mark.parametrize("name", ["huge", "tiny", "subnormal", "mixed_scales", "ties"])
@pytest.mark.parametrize("bits", [1, 4, 8])
def test_extreme_magnitudes_stay_finite_and_bounded(name, bits):
    x = special_inputs()[name]
    n = x.numel()
    payload = reference.quantize(x, bits, 64, False)
    decoded = reference.dequantize(payload, n, bits, 64)
    assert bool(torch.isfinite(decoded).all())
    unit, lo = _meta(payload, n, 64)
    lo_v = _per_value(lo, n, 64).double()
    hi_v = torch.stack([c.max() for c in x.split(64)]).repeat_interleave(64)[:n].double()
    if name == "subnormal" or (name == "tiny" and bits > 1):
        # (hi - lo) / L < FLT_MIN: the unit is flushed to 0, so the bucket decodes to its
        # min (an error of at most its range, itself below FLT_MIN * L)
        assert bool((unit == 0).all())
    flat = _per_value(unit, n, 64) == 0
    err = (decoded.double() - x.double()).abs()
    assert torch.equal(decoded[flat].double(), lo_v[flat])
    assert bool((err[flat] <= (hi_v - lo_v)[flat]).all())
    u = _per_value(unit, n, 64).double()
    slack = 4 * torch.finfo(torch.float32).eps * (x.double().abs() + lo_v.abs())
    assert bool((err[~flat] <= (u / 2 + slack)[~flat]).all())
    if name == "ties" and bits == 4:  # unit 1: k + 0.5 rounds up to k + 1
        assert decoded[2:17].tolist() == [float(k + 1) for k in range(15)]


@pytest.mark.parametrize("name", ["inf", "neg_inf", "nan_last_bucket", "all_nan"])
def test_nonfinite_bucket_decodes_nan_and_spares_the_others(name):
    x = special_inputs()[name]
    n, bucket, bits = x.numel(), 64, 4
    nb = wire.num_buckets(n, bucket)
    bad = torch.tensor([not bool(torch.isfinite(c).all()) for c in x.split(bucket)])
    assert bool(bad.any()) and not bool(bad.all()) or name == "all_nan"
    payload = reference.quantize(x, bits, bucket, True, key=5)
    unit, lo = _meta(payload, n, bucket)
    assert torch.equal(torch.isnan(unit), bad) and torch.equal(torch.isnan(lo), bad)
    codes = reference._unpack(payload[8 * nb:], n, bits)
    in_bad = bad.repeat_interleave(bucket)[:n]
    assert bool((codes[in_bad] == 0).all())
    decoded = reference.dequantize(payload, n, bits, bucket)
    assert torch.equal(torch.isnan(decoded), in_bad)
    # every other bucket is exactly what it would be with the bad values made finite
    clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    clean_payload = reference.quantize(clean, bits, bucket, True, key=5)
    ref = reference.dequantize(clean_payload, n, bits, bucket)
    assert torch.equal(decoded[~in_bad], ref[~in_bad])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_back_holds_the_decoded_values(dtype):
    x = randn(1000, seed=6, dtype=dtype)
    x[100] = float("inf")
    y = x.clone()
    payload = reference.quantize(y, 3, 64, True, key=8, index_offset=5, write_back=True)
    assert torch.equal(payload, reference.quantize(x, 3, 64, True, key=8, index_offset=5))
    decoded = reference.dequantize(payload, 1000, 3, 64, dtype=dtype)
    assert torch.equal(torch.isnan(y), torch.isnan(decoded))
    assert torch.equal(y.nan_to_num(0.5), decoded.nan_to_num(0.5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_accumulate_adds_in_float32(dtype):
    x, acc = randn(777, seed=7), randn(777, seed=8, dtype=dtype)
    payload = reference.quantize(x, 5, 64, False)
    out = reference.dequantize(payload, 777, 5, 64, out=acc.clone(), accumulate=True)
    expect = (acc.float() + reference.dequantize(payload, 777, 5, 64)).to(dtype)
    assert torch.equal(out, expect)


# ---------------------------------------------------------------- public API (quantization.py)


def test_quantspec_validation():
    with pytest.raises(ConfigError, match="bits=9 is not supported"):
        QuantSpec(bits=9)
    with pytest.raises(ConfigError, match="bits=True is not supported"):
        QuantSpec(bits=True)
    with pytest.raises(ConfigError, match="multiple of 8"):
        QuantSpec(bucket_size=12)
    with pytest.raises(ConfigError, match="rounding must be a cgx.Rounding"):
        QuantSpec(rounding="nearest")
    spec = QuantSpec(4, 1024, Rounding.NEAREST)
    assert not spec.stochastic and spec.nbytes(1024) == 520
    assert spec.ratio(1024) == pytest.approx(4096 / 520)
    assert quantization.packed_nbytes(1024, spec) == 520


def test_quantize_validation():
    spec = QuantSpec(4, 64)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        quantize([1.0, 2.0], spec)
    with pytest.raises(TypeError, match="x has dtype torch.int32"):
        quantize(torch.zeros(8, dtype=torch.int32), spec)
    with pytest.raises(ValueError, match="x must be contiguous"):
        quantize(torch.zeros(8, 8).t(), spec)
    with pytest.raises(TypeError, match="payload must be a uint8"):
        quantize(torch.zeros(64), spec, out=torch.zeros(100))
    with pytest.raises(ValueError, match="payload has 8 bytes but 64 values"):
        quantize(torch.zeros(64), spec, out=torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="backend 'c' runs on CPU tensors"):
        quantize(torch.zeros(64, device="meta"), spec, backend="c")
    with pytest.raises(ValueError, match="'gpu' is not a valid Backend"):
        quantize(torch.zeros(64), spec, backend="gpu")


def test_dequantize_validation():
    spec = QuantSpec(4, 64)
    payload = quantize(torch.zeros(64), spec)
    with pytest.raises(TypeError, match="payload must be a uint8"):
        dequantize(payload.float(), 64, spec)
    with pytest.raises(ValueError, match="has 10 bytes but 64 values at 4 bits, bucket 64 need 40"):
        dequantize(payload[:10], 64, spec)
    with pytest.raises(ValueError, match="accumulate=True needs an `out`"):
        dequantize(payload, 64, spec, accumulate=True)
    with pytest.raises(TypeError, match="out has dtype torch.float64"):
        dequantize(payload, 64, spec, out=torch.zeros(64, dtype=torch.float64))
    with pytest.raises(ValueError, match="out has 63 values, expected numel=64"):
        dequantize(payload, 64, spec, out=torch.zeros(63))
    with pytest.raises(ValueError, match="out is on meta but payload on cpu"):
        dequantize(payload, 64, spec, out=torch.zeros(64, device="meta"))


@pytest.mark.parametrize("backend", ["torch", "c", "auto"])
def test_public_api_round_trip_with_out(backend):
    spec = QuantSpec(4, 64, Rounding.STOCHASTIC)
    x = randn(500, seed=9)
    buf = torch.full((spec.nbytes(500) + 5,), 0xAB, dtype=torch.uint8)
    payload = quantize(x, spec, out=buf, key=4, index_offset=11, backend=backend)
    assert payload.data_ptr() == buf.data_ptr() and payload.numel() == spec.nbytes(500)
    assert bool((buf[spec.nbytes(500):] == 0xAB).all())  # nothing written past the segment
    assert torch.equal(payload, reference.quantize(x, 4, 64, True, key=4, index_offset=11))
    out = dequantize(payload, 500, spec, dtype=torch.bfloat16, backend=backend)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, reference.dequantize(payload, 500, 4, 64, dtype=torch.bfloat16))


def test_auto_uses_c_and_warns_once_without_it(monkeypatch):
    calls = []
    real = cpu.quantize
    monkeypatch.setattr(cpu, "quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    spec = QuantSpec(2, 64)
    quantize(torch.ones(64), spec)
    assert calls == [1]  # AUTO on CPU picks the C path when it is built

    monkeypatch.setattr(cpu, "available", lambda: False)
    monkeypatch.setattr(cpu, "unavailable_reason", lambda: "not built (test)")
    monkeypatch.setattr(quantization, "_warned_reference_fallback", False)
    with pytest.warns(RuntimeWarning, match=r"not available \(not built \(test\)\).*make ext"):
        a = quantize(torch.ones(64), spec)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call stays silent
        b = quantize(torch.ones(64), spec)
        dequantize(b, 64, spec)
    assert calls == [1] and torch.equal(a, b)


def test_header_matches_struct_layout():
    head = wire.pack_header(5, 2, 8, 1)
    assert struct.unpack("<4sBBBBIi", head) == (b"CGXQ", wire.WIRE_VERSION, 2, 1, 0, 8, 5)
