"""Every compressor family's allreduce on a real 2-rank Gloo world.

One spawn runs all the cases (starting ranks is the slow part); each test
then checks its case against the exact mean computed here from the same
seeded inputs, within the family's documented error.
"""

from __future__ import annotations

import pytest
import torch

from cgx.comm.base import ReduceOp
from cgx.compression import (BF16Compressor, Compression, ErrorFeedback, FP16Compressor,
                             NoneCompressor, PowerSGDCompressor, QuantizeCompressor,
                             TopKCompressor)

from compression_refs import make_input, powersgd_reference, topk_dense
from spawn import run_gloo

pytestmark = pytest.mark.multiproc

WORLD = 2
STEPS = 3


def _cases():
    """(case name, factory, shape, dtype, op, steps); factories are rebuilt on each rank."""
    return [
        ("none", NoneCompressor, (37, 5), torch.float32, ReduceOp.AVERAGE, 1),
        ("none_sum", NoneCompressor, (37, 5), torch.float32, ReduceOp.SUM, 1),
        ("none_max", NoneCompressor, (11,), torch.float32, ReduceOp.MAX, 1),
        ("fp16", FP16Compressor, (300,), torch.float32, ReduceOp.AVERAGE, 1),
        ("fp16_sum", FP16Compressor, (300,), torch.float32, ReduceOp.SUM, 1),
        ("fp16_native", FP16Compressor, (65, 3), torch.float16, ReduceOp.AVERAGE, 1),
        ("bf16", BF16Compressor, (64, 3), torch.bfloat16, ReduceOp.AVERAGE, 1),
        ("quant4", lambda: QuantizeCompressor(bits=4, bucket_size=64), (1000,), torch.float32,
         ReduceOp.AVERAGE, 1),
        ("quant8_nearest_fp16", lambda: QuantizeCompressor(bits=8, bucket_size=128,
                                                          rounding="nearest"),
         (77, 13), torch.float16, ReduceOp.SUM, 1),
        ("topk", lambda: TopKCompressor(0.05), (50, 7), torch.float32, ReduceOp.AVERAGE, 1),
        ("topk_sum", lambda: TopKCompressor(0.05), (50, 7), torch.float32, ReduceOp.SUM, 1),
        ("topk_ef", lambda: Compression.topk(0.1), (40,), torch.float32, ReduceOp.AVERAGE, STEPS),
        ("quant_ef", lambda: Compression.quantize(bits=2, bucket_size=64, error_feedback=True),
         (300,), torch.float32, ReduceOp.AVERAGE, STEPS),
        ("powersgd", lambda: PowerSGDCompressor(rank=2, seed=3), (40, 30), torch.float32,
         ReduceOp.AVERAGE, STEPS),
        ("powersgd_sum", lambda: PowerSGDCompressor(rank=1), (40, 30), torch.float32,
         ReduceOp.SUM, 1),
        ("powersgd_full", lambda: PowerSGDCompressor(rank=12, min_compression_rate=0,
                                                     error_feedback=False),
         (12, 20), torch.float32, ReduceOp.AVERAGE, 1),
        ("powersgd_vector", PowerSGDCompressor, (25,), torch.float32, ReduceOp.AVERAGE, 1),
    ]


# Non-finite cases: rank 0 puts `bad` at index 0 on the second of three steps.
_NONFINITE = [
    ("nf_fp16", FP16Compressor, float("inf")),
    ("nf_bf16", BF16Compressor, float("nan")),
    ("nf_quant", lambda: QuantizeCompressor(bits=4, bucket_size=64), float("nan")),
    ("nf_topk", lambda: TopKCompressor(0.02), float("nan")),
    ("nf_topk_ef", lambda: ErrorFeedback(TopKCompressor(0.02)), float("-inf")),
    ("nf_quant_ef", lambda: Compression.quantize(bits=2, error_feedback=True), float("nan")),
    ("nf_powersgd", lambda: PowerSGDCompressor(rank=2), float("nan")),
    ("nf_powersgd_inf", lambda: PowerSGDCompressor(rank=1), float("inf")),
]
_NF_SHAPE = (16, 12)


def _nonfinite_input(case: str, rank: int, step: int, bad: float) -> torch.Tensor:
    x = make_input(f"{case}/{step}", rank, _NF_SHAPE)
    if rank == 0 and step == 1:
        x.view(-1)[0] = bad
    return x


def _ranks(rank: int, world: int):
    from cgx.comm.torch_dist import TorchTransport

    transport = TorchTransport()
    results = {}
    for case, factory, shape, dtype, op, steps in _cases():
        comp = factory()
        outs = []
        for step in range(steps):
            x = make_input(f"{case}/{step}", rank, shape, dtype)
            outs.append(comp.allreduce(x, transport, name=case, op=op))
        residual = comp.residual(case) if hasattr(comp, "residual") else None
        results[case] = {"outs": outs, "residual": residual}
    for case, factory, bad in _NONFINITE:
        comp = factory()
        outs = [comp.allreduce(_nonfinite_input(case, rank, step, bad), transport, name=case)
                for step in range(3)]
        residual = comp.residual(case) if hasattr(comp, "residual") else None
        results[case] = {"outs": outs, "residual": residual}
    big = torch.full((4,), 40000.0 + 10000.0 * rank)
    results["fp16_big"] = (FP16Compressor().allreduce(big, transport),
                           FP16Compressor(predivide=1).allreduce(big, transport))
    return results


@pytest.fixture(scope="module")
def world():
    return run_gloo(_ranks, WORLD, timeout=240)


def _inputs(case, shape, dtype, step=0):
    return [make_input(f"{case}/{step}", r, shape, dtype) for r in range(WORLD)]


def _exact(case, shape, dtype, op, step=0):
    xs = torch.stack([x.double() for x in _inputs(case, shape, dtype, step)])
    if op is ReduceOp.MAX:
        return xs.amax(0)
    return xs.sum(0) if op is ReduceOp.SUM else xs.mean(0)


def _case(name):
    return next(c for c in _cases() if c[0] == name)


def _same_on_every_rank(world, case):
    for step, out in enumerate(world[0][case]["outs"]):
        for other in world[1:]:
            assert torch.equal(out, other[case]["outs"][step]) or (
                out.isnan().any() and torch.equal(out.isnan(), other[case]["outs"][step].isnan()))


@pytest.mark.parametrize("case", [c[0] for c in _cases()])
def test_identical_on_every_rank_with_right_shape_and_dtype(world, case):
    _, _, shape, dtype, _, steps = _case(case)
    _same_on_every_rank(world, case)
    outs = world[0][case]["outs"]
    assert len(outs) == steps
    assert all(o.shape == shape and o.dtype == dtype for o in outs)


@pytest.mark.parametrize("case", ["none", "none_sum", "none_max"])
def test_none_is_exact(world, case):
    _, _, shape, dtype, op, _ = _case(case)
    out = world[0][case]["outs"][0]
    assert torch.allclose(out.double(), _exact(case, shape, dtype, op), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case, unit", [("fp16", 2**-11), ("fp16_sum", 2**-11),
                                        ("fp16_native", 2**-11), ("bf16", 2**-8)])
def test_casts_within_documented_error(world, case, unit):
    _, _, shape, dtype, op, _ = _case(case)
    xs = _inputs(case, shape, dtype)
    bound = WORLD * unit * torch.stack([x.double().abs() for x in xs]).amax(0)
    if op is ReduceOp.SUM:
        bound = bound * WORLD
    err = (world[0][case]["outs"][0].double() - _exact(case, shape, dtype, op)).abs()
    assert (err <= bound + 2**-24).all()


def test_fp16_predivide_keeps_large_sums_finite(world):
    # 40000 + 50000 overflows an fp16 sum; predivided by the world size it does not.
    predivided, horovod_style = world[0]["fp16_big"]
    assert torch.allclose(predivided, torch.full((4,), 45000.0), rtol=2**-10)  # fp16 spacing 32
    assert torch.isinf(horovod_style).all()


@pytest.mark.parametrize("case", ["quant4", "quant8_nearest_fp16"])
def test_quantize_within_documented_error(world, case):
    _, factory, shape, dtype, op, _ = _case(case)
    spec = factory().spec
    xs = _inputs(case, shape, dtype)
    units = []
    for x in xs:  # per-bucket unit of each rank's tensor, per element
        flat = x.float().reshape(-1)
        pad = -flat.numel() % spec.bucket_size
        lo = torch.nn.functional.pad(flat, (0, pad), value=float("inf")).view(-1, spec.bucket_size)
        hi = torch.nn.functional.pad(flat, (0, pad), value=float("-inf")).view(-1, spec.bucket_size)
        unit = (hi.amax(1) - lo.amin(1)) / (2**spec.bits - 1)
        units.append(unit.repeat_interleave(spec.bucket_size)[:flat.numel()].view(shape).double())
    factor = 1.0 if spec.stochastic else 0.5
    bound = factor * sum(units) * (1 if op is ReduceOp.SUM else 1 / WORLD)
    if dtype == torch.float16:
        bound = bound + 2**-10 * _exact(case, shape, dtype, op).abs() + 1e-3
    err = (world[0][case]["outs"][0].double() - _exact(case, shape, dtype, op)).abs()
    assert (err <= bound * 1.0001 + 1e-6).all()


@pytest.mark.parametrize("case", ["topk", "topk_sum"])
def test_topk_is_the_mean_of_sparsified_tensors(world, case):
    _, factory, shape, dtype, op, _ = _case(case)
    k = factory().num_selected(torch.Size(shape).numel())
    ref = sum(topk_dense(x, k).double() for x in _inputs(case, shape, dtype))
    if op is ReduceOp.AVERAGE:
        ref = ref / WORLD
    assert torch.allclose(world[0][case]["outs"][0].double(), ref, atol=1e-6)


@pytest.mark.parametrize("case", ["topk_ef", "quant_ef"])
def test_error_feedback_conserves_the_sum(world, case):
    # W * sum(outputs) + sum over ranks of residuals == sum over steps and ranks of inputs.
    _, _, shape, dtype, _, steps = _case(case)
    total_in = sum(sum(x.double() for x in _inputs(case, shape, dtype, s)) for s in range(steps))
    total_out = WORLD * sum(o.double() for o in world[0][case]["outs"])
    residuals = sum(w[case]["residual"].double() for w in world)
    assert torch.allclose(total_out + residuals, total_in, atol=1e-4)


def test_powersgd_matches_reference(world):
    _, _, shape, dtype, _, steps = _case("powersgd")
    inputs = [_inputs("powersgd", shape, dtype, s) for s in range(steps)]
    expect, residuals = powersgd_reference(inputs, rank=2, seed=3, name="powersgd")
    for out, ref in zip(world[0]["powersgd"]["outs"], expect):
        assert torch.allclose(out.double(), ref, atol=1e-4), (out.double() - ref).abs().max()
    for r in range(WORLD):
        assert torch.allclose(world[r]["powersgd"]["residual"].double(), residuals[r], atol=1e-4)


def test_powersgd_sum(world):
    _, _, shape, dtype, _, _ = _case("powersgd_sum")
    (ref,), _ = powersgd_reference([_inputs("powersgd_sum", shape, dtype)], rank=1,
                                   name="powersgd_sum")
    assert torch.allclose(world[0]["powersgd_sum"]["outs"][0].double(), ref * WORLD, atol=1e-4)


@pytest.mark.parametrize("case", ["powersgd_full", "powersgd_vector"])
def test_powersgd_exact_cases(world, case):
    _, _, shape, dtype, op, _ = _case(case)
    out = world[0][case]["outs"][0].double()
    assert torch.allclose(out, _exact(case, shape, dtype, op), atol=1e-4)


@pytest.mark.parametrize("case", [c[0] for c in _NONFINITE])
def test_non_finite_step_is_non_finite_everywhere_and_does_not_poison(world, case):
    for w in world:
        before, bad_step, after = w[case]["outs"]
        assert torch.isfinite(before).all()
        assert not torch.isfinite(bad_step).all()
        assert torch.isfinite(after).all()
        if w[case]["residual"] is not None:
            assert torch.isfinite(w[case]["residual"]).all()
