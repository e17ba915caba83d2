"""Quantizing CUDA tensors on the host (cgx.collectives.offload) and its place in the reducer.

On CPU: the offload functions and ``Reducer.allreduce(placements=...)`` leave CPU tensors
exactly as the codec would (the placement applies to CUDA tensors only), and bad
placements fail with a clear message.

Marked ``gpu`` (skipped without a CUDA device): the offloaded quantization writes the
bytes and the decoded values of the Triton kernels, bit for bit, for every bit width,
rounding, dtype and rotation; the offloaded decode matches theirs, accumulating or not;
a 2-rank reduction of CUDA tensors (Gloo carrying the bytes) gives the same result with
every tensor offloaded as on the GPU, error feedback included; the calibration measures
a usable profile.
"""

from __future__ import annotations

import pytest
import torch

from cgx.collectives import offload
from cgx.collectives.offload import Placement
from cgx.config import Config, Rounding, ReductionType
from cgx.quant.codec import QuantSpec, dequantize, quantize
from spawn import run_gloo

SPECS = [QuantSpec(bits, 512, rounding, rotate) for bits in (2, 4, 8)
         for rounding in (Rounding.NEAREST, Rounding.STOCHASTIC) for rotate in (False, True)]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
N = 100_003  # not a multiple of the bucket


def _values(device, dtype, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 3 + 1).to(dtype).to(device)


def _both_quantize(x, spec, write_back):
    """(payload, values after) of the codec and of the offload path, from the same x."""
    kw = dict(key=12345, index_offset=4096, write_back=write_back, rotation_key=77)
    a, b = x.clone(), x.clone()
    return (quantize(a, spec, **kw), a), (offload.quantize(b, spec, **kw), b)


def test_cpu_tensors_go_to_the_codec_unchanged():
    spec = QuantSpec(4, 512, Rounding.STOCHASTIC)
    (p0, v0), (p1, v1) = _both_quantize(_values("cpu", torch.float32), spec, True)
    assert torch.equal(p0, p1) and torch.equal(v0, v1)
    acc = _values("cpu", torch.float32, seed=1)
    want = dequantize(p0, N, spec, out=acc.clone(), accumulate=True)
    got = offload.dequantize(p0, N, spec, out=acc.clone(), accumulate=True)
    assert torch.equal(want, got)


def _reduce(rank, world, placed, algorithm, feedback):
    from cgx.collectives import Reducer
    from cgx.comm.torch_dist import TorchTransport
    device = torch.device("cuda", 0) if placed.startswith("cuda") else torch.device("cpu")
    red = Reducer(TorchTransport(device=device), Config(seed=5))
    spec = QuantSpec(4, 512, Rounding.STOCHASTIC)
    xs = [_values(device, torch.float32, n, seed=10 * rank + i)
          for i, n in enumerate((N, 4096, 70_001))]
    res = [torch.zeros_like(x) for x in xs] if feedback else None
    where = Placement.GPU if placed == "cuda-gpu" else Placement.CPU_OFFLOAD
    placements = None if placed == "none" else [where, None, where]
    for step in range(2):
        red.allreduce(xs, [spec, None, spec], algorithm=algorithm, name="g", residuals=res,
                      placements=placements, step=step)
    return [x.cpu() for x in xs] + ([e.cpu() for e in res] if feedback else [])


def test_placements_leave_cpu_reduction_unchanged():
    plain = run_gloo(_reduce, 2, "none", ReductionType.SRA, True)
    placed = run_gloo(_reduce, 2, "cpu-offload", ReductionType.SRA, True)
    for a, b in zip(plain, placed):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_bad_placements_say_what_to_pass():
    with pytest.raises(ValueError, match="got 1 placements for 2 tensors"):
        offload.placements_of([Placement.GPU], 2, [0])
    with pytest.raises(TypeError, match=r"placements\[1\] must be a Placement or None"):
        offload.placements_of([None, "cpu"], 2, [0, 1])
    assert offload.placements_of([None, Placement.CPU_OFFLOAD], 2, [0, 1]) == [
        Placement.GPU, Placement.CPU_OFFLOAD]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("write_back", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_quantize_writes_the_kernels_bytes(spec, dtype, write_back):
    x = _values("cuda", dtype)
    (p0, v0), (p1, v1) = _both_quantize(x, spec, write_back)
    assert p1.is_cuda and torch.equal(p0, p1)
    assert torch.equal(v0, v1)


@pytest.mark.parametrize("spec", SPECS[::2], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_dequantize_decodes_as_the_kernels(spec, dtype, accumulate):
    payload = quantize(_values("cuda", torch.float32), spec, key=3, rotation_key=9)
    acc = _values("cuda", dtype, seed=1)
    want = dequantize(payload, N, spec, out=acc.clone(), accumulate=accumulate, rotation_key=9)
    got = offload.dequantize(payload, N, spec, out=acc.clone(), accumulate=accumulate,
                             rotation_key=9)
    assert got.is_cuda and torch.equal(want, got)
    fresh = offload.dequantize(payload, N, spec, dtype=dtype, rotation_key=9)
    assert torch.equal(fresh, dequantize(payload, N, spec, dtype=dtype, rotation_key=9))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_waits_for_the_kernels_that_made_its_input():
    spec = QuantSpec(4, 1024, Rounding.NEAREST)
    a = torch.randn(4096, 4096, device="cuda")
    x = (a @ a).view(-1)  # still running when the offload starts its copy
    got = offload.quantize(x, spec)
    assert torch.equal(got, quantize(x, spec))
    # and the kernels queued after it see the values it writes back
    x.add_(1.0)
    decoded = x.clone()
    quantize(decoded, spec, write_back=True)  # the kernels' decoded values
    offload.quantize(x, spec, write_back=True)
    y = x * 2  # queued right behind the write-back's copy
    assert torch.equal(y, decoded * 2)


@pytest.mark.parametrize("algorithm", [ReductionType.SRA, ReductionType.ALLGATHER])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_reduction_equals_the_gpu_one(algorithm):
    on_gpu = run_gloo(_reduce, 2, "cuda-gpu", algorithm, algorithm is ReductionType.SRA)
    off = run_gloo(_reduce, 2, "cuda-offload", algorithm, algorithm is ReductionType.SRA)
    for a, b in zip(on_gpu, off):
        for x, y in zip(a, b):
            assert torch.equal(x, y), (x - y).abs().max()
    for x, y in zip(off[0][:3], off[1][:3]):
        assert torch.equal(x, y), "ranks differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrate_device_measures_a_usable_profile():
    from cgx.policy.planner.placement import DeviceProfile, calibrate_device
    p = calibrate_device(numel=1 << 22, threads=(1, 2), gpu_busy=0.8, reps=3)
    assert p.gpu_quantize_gbps > p.host_gbps(p.host_quantize_gbps)
    assert [t for t, _ in p.host_quantize_gbps] == [1, 2] and p.threads == 2
    assert "measured on" in p.source and p.gpu_busy == 0.8
    assert 0 < p.copy_s < 0.1  # an offloaded call's fixed cost, measured (not the default)
    assert p.copy_s != DeviceProfile.__dataclass_fields__["copy_s"].default
    assert DeviceProfile.from_dict(p.to_dict()) == p
