"""Compressor interface, casts (none/fp16/bf16), quantize, and the Compression namespace."""

from __future__ import annotations

import copy
import io
import math
import pickle
import zlib

import pytest
import torch

from cgx.comm.base import ReduceOp, SingleProcessTransport
from cgx.compression import (BF16Compressor, Compression, Compressor, Family,
                             ErrorFeedback, FP16Compressor, HorovodCompressor, NoneCompressor,
                             PowerSGDCompressor, QuantizeCompressor, TopKCompressor,
                             as_compressor, stable_tensor_id)
from cgx.compression.casts import CastContext
from cgx.compression.quantize import QuantizeContext
from cgx.config import Rounding

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1,), (7,), (3, 5), (2, 3, 4, 5), (1000,), (0,), (0, 4)]


def _x(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def _all_compressors():
    return [NoneCompressor(), FP16Compressor(), BF16Compressor(), QuantizeCompressor(bits=3),
            TopKCompressor(0.2), PowerSGDCompressor(rank=1, min_compression_rate=0),
            ErrorFeedback(QuantizeCompressor()), ErrorFeedback(TopKCompressor(0.2))]


# -- round trips ------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("comp", _all_compressors(), ids=repr)
def test_round_trip_keeps_shape_and_dtype(comp, dtype, shape):
    comp = copy.deepcopy(comp)  # parametrized instances are shared between cases
    x = _x(shape, dtype)
    payload, ctx = comp.compress(x, name="t")
    assert isinstance(payload, torch.Tensor)
    y = comp.decompress(payload, ctx)
    assert y.shape == x.shape and y.dtype == x.dtype


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_casts_round_trip_within_rounding(dtype):
    x = _x((257,), dtype)
    for comp, unit in ((FP16Compressor(), 2**-11), (BF16Compressor(), 2**-8)):
        y = comp.decompress(*comp.compress(x))
        assert torch.allclose(y.double(), x.double(), rtol=unit, atol=2**-24)
    assert torch.equal(NoneCompressor().decompress(*NoneCompressor().compress(x)), x)


def test_cast_payload_dtypes_and_sizes():
    x = _x((10, 3))
    assert FP16Compressor().compress(x)[0].dtype == torch.float16
    assert BF16Compressor().compress(x)[0].dtype == torch.bfloat16
    assert FP16Compressor().compress(x)[0].numel() * 2 == x.numel() * 2


# -- Horovod compatibility ----------------------------------------------------------

def test_horovod_static_calls_fp16():
    x = _x((4, 5))
    payload, ctx = Compression.fp16.compress(x)
    assert payload.dtype == torch.float16
    assert torch.equal(payload, x.type(torch.float16))  # what Horovod's fp16 sends
    assert ctx == torch.float32  # Horovod's ctx: the original dtype
    y = Compression.fp16.decompress(payload, ctx)
    assert y.dtype == torch.float32 and torch.equal(y, payload.type(torch.float32))
    assert FP16Compressor.compress(x)[0].dtype == torch.float16  # on the class itself


def test_horovod_static_calls_none_are_identity():
    x = _x((4, 5))
    payload, ctx = Compression.none.compress(x)
    assert payload is x
    assert Compression.none.decompress(payload, ctx) is x
    assert isinstance(Compression.none, type) and issubclass(Compression.fp16, Compressor)


def test_casts_pass_integers_through_like_horovod():
    ints = torch.arange(6)
    for comp in (Compression.fp16, Compression.bf16, Compression.none):
        payload, ctx = comp.compress(ints)
        assert payload is ints and comp.decompress(payload, ctx) is ints


def test_class_level_default_is_shared_and_configurable():
    assert Compression.fp16.compress.__self__ is Compression.fp16.decompress.__self__
    comp = Compression.fp16(predivide=8)
    assert isinstance(comp, FP16Compressor) and comp.predivide == 8.0


def test_fp16_arithmetic_on_cpu():
    # Horovod's fp16 path failed on CPU for some half ops; ours must not.
    a = _x((1000,), torch.float16, 1)
    b = _x((1000,), torch.float16, 2)
    assert torch.isfinite(a + b).all() and torch.isfinite((a + b).sum())
    comp = FP16Compressor(predivide=2)
    pa, ctx = comp.compress(a)
    pb, _ = comp.compress(b)
    out = comp.decompress(pa + pb, ctx)
    assert torch.allclose(out.float(), a.float() + b.float(), atol=4e-3)


def test_predivide_in_plain_compress():
    x = torch.full((4,), 60000.0)
    payload, ctx = FP16Compressor(predivide=4).compress(x)
    assert ctx == CastContext(torch.float32, 4.0)
    assert torch.equal(payload, torch.full((4,), 15000.0, dtype=torch.float16))
    assert torch.isinf((payload.float() * 4 + payload.float() * 4).half()).all()  # sum on the wire
    assert torch.equal(FP16Compressor(predivide=4).decompress(payload, ctx), x)


def test_fp16_predivide_avoids_overflow_in_reduction():
    # Two ranks' worth of 40000 sums to 80000 > 65504; predividing by 2 keeps it finite.
    payload, ctx = FP16Compressor(predivide=2).compress(torch.full((3,), 40000.0))
    reduced = payload + payload  # what a 2-rank SUM of the payload computes
    assert torch.equal(FP16Compressor(predivide=2).decompress(reduced, ctx),
                       torch.full((3,), 80000.0))
    plain, pctx = FP16Compressor(predivide=1).compress(torch.full((3,), 40000.0))
    assert torch.isinf(FP16Compressor().decompress(plain + plain, pctx)).all()


class _TwinTransport(SingleProcessTransport):
    """Two ranks holding the same tensor, simulated in one process."""

    def __init__(self):
        super().__init__()
        self.size = 2

    def allreduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        assert op is ReduceOp.SUM
        tensor.copy_((tensor.double() * 2).to(tensor.dtype))

    def allgather(self, output, input, async_op=False):
        output.copy_(torch.cat([input, input]))


@pytest.mark.parametrize("comp", [FP16Compressor(), BF16Compressor(), NoneCompressor()], ids=repr)
def test_half_precision_average_never_scales_up_to_the_sum(comp):
    # Two ranks of 40000 in float16: the sum 80000 does not fit, the mean does.
    x = torch.full((4,), 40000.0, dtype=torch.float16)
    out = comp.allreduce(x, _TwinTransport())
    expect = x if comp.family is not Family.EXACT else torch.full((4,), float("inf"),
                                                                      dtype=torch.float16)
    # (none sums in float16 on the wire, like Horovod; bf16 rounds 20000 to 19968)
    assert torch.allclose(out.float(), expect.float(), rtol=2**-8)


@pytest.mark.parametrize("comp", _all_compressors(), ids=repr)
def test_two_identical_ranks_average_to_one(comp):
    comp = copy.deepcopy(comp)
    x = _x((20, 12))
    twin = copy.deepcopy(comp)
    out = comp.allreduce(x, _TwinTransport(), name="w", op=ReduceOp.AVERAGE)
    local = twin.decompress(*twin.compress(x, name="w"))  # rank 0's noise, same step
    assert torch.allclose(out, local, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "2", True])
def test_predivide_validation(bad):
    with pytest.raises(ValueError, match="predivide must be a finite number > 0"):
        FP16Compressor(predivide=bad)


# -- quantize ---------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("rounding", list(Rounding))
@pytest.mark.parametrize("numel", [1, 13, 1000, 1031])
def test_quantize_error_bound(bits, rounding, numel):
    comp = QuantizeCompressor(bits=bits, bucket_size=64, rounding=rounding)
    x = _x((numel,))
    payload, ctx = comp.compress(x, name="w")
    assert payload.dtype == torch.uint8 and payload.numel() == comp.payload_nbytes(numel)
    assert isinstance(ctx, QuantizeContext) and ctx.numel == numel
    y = comp.decompress(payload, ctx)
    pad = -numel % 64
    grid = torch.nn.functional.pad(x, (0, pad), value=float("nan")).view(-1, 64)
    unit = (grid.nan_to_num(-1e9).amax(1) - grid.nan_to_num(1e9).amin(1)) / (2**bits - 1)
    unit = unit.repeat_interleave(64)[:numel]
    limit = unit * (1.0 if rounding is Rounding.STOCHASTIC else 0.5) * (1 + 1e-5) + 1e-6
    assert ((y - x).abs() <= limit).all()


def test_quantize_payload_size_formula():
    comp = QuantizeCompressor(bits=4, bucket_size=1024)
    n = 10_000
    raw = 8 * math.ceil(n / 1024) + 4 * math.ceil(n / 8)
    assert comp.payload_nbytes(n) == math.ceil(raw / 8) * 8


def test_quantize_stochastic_noise_follows_step_and_name():
    x = _x((512,))
    a, b = QuantizeCompressor(bits=2, bucket_size=64), QuantizeCompressor(bits=2, bucket_size=64)
    first = a.compress(x, name="w")[0]
    assert torch.equal(first, b.compress(x, name="w")[0])  # reproducible
    assert not torch.equal(first, a.compress(x, name="w")[0])  # next step: new noise
    assert not torch.equal(first, b.compress(x, name="other")[0])  # other tensor id
    assert not torch.equal(first, QuantizeCompressor(bits=2, bucket_size=64, seed=1)
                           .compress(x, name="w")[0])
    nearest = QuantizeCompressor(bits=2, bucket_size=64, rounding="nearest")
    assert torch.equal(nearest.compress(x, name="w")[0], nearest.compress(x, name="w")[0])


def test_quantize_rank_gets_its_own_noise_in_reduction():
    rank1 = SingleProcessTransport()
    rank1.rank = 1
    x = _x((256,))
    a, b = QuantizeCompressor(bits=2, bucket_size=64), QuantizeCompressor(bits=2, bucket_size=64)
    p0 = a.compress_for_reduction(x, SingleProcessTransport(), "w")[0]
    p1 = b.compress_for_reduction(x, rank1, "w")[0]
    assert not torch.equal(p0, p1)


def test_stochastic_quantize_is_unbiased_over_steps():
    x = _x((256,))
    comp = QuantizeCompressor(bits=1, bucket_size=256)
    mean = sum(comp.decompress(*comp.compress(x, "w")) for _ in range(400)) / 400
    unit = (x.max() - x.min()).item()
    assert (mean - x).abs().max() < 0.25 * unit


def test_stable_tensor_id_is_crc32():
    assert stable_tensor_id(None) == 0
    assert stable_tensor_id("fc.weight") == zlib.crc32(b"fc.weight")


def test_quantize_float64_uses_float32_wire():
    x = _x((100,), torch.float64)
    comp = QuantizeCompressor(bits=8, bucket_size=64)
    y = comp.decompress(*comp.compress(x))
    assert y.dtype == torch.float64 and (y - x).abs().max() < 0.05


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(bits=0), ValueError, r"bits=0 is not supported; expected an int in \[1, 8\]"),
    (dict(bits=32), ValueError, "Compression.none or Compression.fp16"),
    (dict(bits=4.0), ValueError, "bits=4.0 is not supported"),
    (dict(bucket_size=100), ValueError, "multiple of 8"),
    (dict(rounding="up"), ValueError, "rounding='up' is not known; expected one of 'nearest'"),
    (dict(rounding=3), ValueError, "rounding=3 is not known"),
    (dict(seed=-1), ValueError, r"seed=-1 must be an int in \[0, 2\*\*64\)"),
])
def test_quantize_validation(kwargs, err, match):
    with pytest.raises(err, match=match):
        QuantizeCompressor(**kwargs)


def test_quantize_accepts_rounding_names():
    assert QuantizeCompressor(rounding="NEAREST").rounding is Rounding.NEAREST
    assert Compression.quantize(rounding=" Stochastic ").rounding is Rounding.STOCHASTIC


@pytest.mark.parametrize("comp", [QuantizeCompressor(), TopKCompressor(),
                                  PowerSGDCompressor(), ErrorFeedback(TopKCompressor())], ids=repr)
def test_non_float_tensors_rejected(comp):
    with pytest.raises(TypeError, match="compresses floating-point tensors.*got torch.int64"):
        comp.compress(torch.arange(10))


@pytest.mark.parametrize("comp", _all_compressors(), ids=repr)
def test_non_tensor_rejected(comp):
    with pytest.raises(TypeError, match="takes a torch.Tensor, got list|compresses"):
        comp.compress([1.0, 2.0])


def test_name_must_be_str():
    with pytest.raises(TypeError, match="name must be a str"):
        QuantizeCompressor().compress(_x((8,)), name=3)


# -- reduction on a 1-rank world, ops, transports -----------------------------------

@pytest.mark.parametrize("comp", _all_compressors(), ids=repr)
def test_single_rank_allreduce_matches_local_round_trip(comp):
    comp = copy.deepcopy(comp)
    x = _x((20, 12))
    twin = pickle.loads(pickle.dumps(comp))
    out = comp.allreduce(x, SingleProcessTransport(), name="w")
    local = twin.decompress(*twin.compress(x, name="w"))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.allclose(out, local, atol=1e-6)
    assert torch.equal(x, _x((20, 12)))  # the input is not modified


def test_sum_and_average_agree_on_one_rank():
    x = _x((64,))
    t = SingleProcessTransport()
    assert torch.equal(NoneCompressor().allreduce(x, t, op=ReduceOp.SUM), x)
    assert torch.equal(NoneCompressor().allreduce(x, t, op="average"), x)
    assert torch.equal(NoneCompressor().allreduce(x, t, op=ReduceOp.MAX), x)


@pytest.mark.parametrize("comp", [FP16Compressor(), QuantizeCompressor(), TopKCompressor(),
                                  PowerSGDCompressor()], ids=repr)
def test_min_max_rejected_for_lossy_compressors(comp):
    with pytest.raises(ValueError, match="reduces with SUM or AVERAGE, got max"):
        comp.allreduce(_x((8,)), SingleProcessTransport(), op=ReduceOp.MAX)


def test_bad_op_and_transport():
    with pytest.raises(TypeError, match="op must be a cgx.comm.base.ReduceOp"):
        NoneCompressor().allreduce(_x((8,)), SingleProcessTransport(), op="mean")
    for comp in (NoneCompressor(), PowerSGDCompressor()):
        with pytest.raises(TypeError, match="transport must be a cgx.comm.base.Transport"):
            comp.allreduce(_x((8,)), object())


def test_integer_average_truncates():
    out = NoneCompressor().allreduce(torch.tensor([7, -7]), SingleProcessTransport())
    assert torch.equal(out, torch.tensor([7, -7]))


def test_families_and_summable():
    assert NoneCompressor.family is Family.EXACT and NoneCompressor.summable
    assert FP16Compressor.family is Family.FP16 and FP16Compressor.family.is_cast
    assert BF16Compressor.family is Family.BF16 and BF16Compressor.summable
    assert not QuantizeCompressor().summable and QuantizeCompressor.family is Family.QUANTIZE
    assert TopKCompressor.family is Family.TOPK and not TopKCompressor.summable
    assert PowerSGDCompressor.family is Family.POWERSGD and not Family.POWERSGD.is_cast
    ef = ErrorFeedback(FP16Compressor())
    assert ef.family is Family.FP16 and ef.summable


def test_a_state_saved_under_the_old_family_names_loads():
    """States written before the families were one enum carry "none"/"lowrank"/"cast"."""
    comp = Compression.powersgd(rank=1)
    state = comp.state_dict()
    comp.load_state_dict({**state, "kind": "lowrank"})
    with pytest.raises(ValueError, match="kind 'topk'"):
        comp.load_state_dict({**state, "kind": "topk"})


# -- Horovod-style foreign compressors ------------------------------------------------

class _HorovodStyle:
    """A user compressor written for Horovod: static methods, bare dtype ctx."""

    @staticmethod
    def compress(tensor):
        return tensor.type(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.type(ctx)


def test_as_compressor():
    comp = QuantizeCompressor()
    assert as_compressor(comp) is comp
    assert as_compressor(Compression.fp16) is Compression.fp16.compress.__self__
    wrapped = as_compressor(_HorovodStyle)
    assert isinstance(wrapped, HorovodCompressor) and wrapped.summable
    x = _x((6,))
    out = wrapped.allreduce(x, SingleProcessTransport())
    assert out.dtype == torch.float32 and torch.allclose(out, x, atol=1e-3)
    with pytest.raises(TypeError, match="compression must be a cgx compressor"):
        as_compressor("fp16")


# -- Compression namespace ------------------------------------------------------------

def test_compression_factories():
    assert isinstance(Compression.quantize(), QuantizeCompressor)
    ef = Compression.quantize(bits=2, bucket_size=512, error_feedback=True)
    assert isinstance(ef, ErrorFeedback) and ef.compressor.bits == 2
    assert isinstance(Compression.topk(), ErrorFeedback)
    assert isinstance(Compression.topk(0.1, error_feedback=False), TopKCompressor)
    ps = Compression.powersgd(rank=4, start_step=10)
    assert isinstance(ps, PowerSGDCompressor) and ps.rank == 4 and ps.start_step == 10
    assert Compression.quantize() is not Compression.quantize()  # fresh state each call


@pytest.mark.parametrize("factory", [Compression.quantize, Compression.topk])
def test_compression_factory_flag_validation(factory):
    with pytest.raises(TypeError, match="error_feedback must be True or False, got 1"):
        factory(error_feedback=1)


def test_no_tensorflow_or_triton_import():
    # Static check (a fresh interpreter costs seconds): no compressor module imports them.
    import ast
    import pathlib
    import cgx.compression as pkg
    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any(n.split(".")[0] in ("tensorflow", "triton", "keras")
                               for n in names), path


# -- state ------------------------------------------------------------------------

def _stateful():
    return [QuantizeCompressor(bits=2, bucket_size=64), Compression.quantize(error_feedback=True),
            Compression.topk(density=0.1), Compression.powersgd(rank=2, min_compression_rate=0),
            Compression.powersgd(rank=1, warm_start=False, min_compression_rate=0)]


@pytest.mark.parametrize("make", range(len(_stateful())))
def test_state_dict_round_trip_continues_identically(make):
    comp = _stateful()[make]
    inputs = [_x((30, 20), seed=s) for s in range(4)]
    for x in inputs[:3]:
        comp.compress(x, name="a")
        comp.compress(x[:5], name="b")
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    fresh = _stateful()[make]
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    expect, _ = comp.compress(inputs[3], name="a")
    got, _ = fresh.compress(inputs[3], name="a")
    assert torch.equal(expect, got)
    assert torch.equal(comp.compress(inputs[3][:5], name="b")[0],
                       fresh.compress(inputs[3][:5], name="b")[0])


@pytest.mark.parametrize("make", range(len(_stateful())))
def test_pickled_compressor_continues_identically(make):
    comp = _stateful()[make]
    comp.compress(_x((30, 20)), name="a")
    twin = pickle.loads(pickle.dumps(comp))
    assert torch.equal(comp.compress(_x((30, 20), seed=1), name="a")[0],
                       twin.compress(_x((30, 20), seed=1), name="a")[0])


def test_state_dict_is_a_snapshot():
    comp = Compression.topk(density=0.1)
    comp.compress(_x((50,)), name="a")
    state = comp.state_dict()
    before = state["residuals"]["a"].clone()
    comp.compress(_x((50,), seed=3), name="a")
    assert torch.equal(state["residuals"]["a"], before)


def test_load_state_dict_validation():
    with pytest.raises(ValueError, match="got a state of kind 'topk', expected 'quantize'"):
        QuantizeCompressor().load_state_dict(TopKCompressor().state_dict())
    with pytest.raises(TypeError, match="takes the dict made by state_dict"):
        QuantizeCompressor().load_state_dict([1])
    state = QuantizeCompressor().state_dict()
    state["format"] = 99
    with pytest.raises(ValueError, match="has format 99"):
        QuantizeCompressor().load_state_dict(state)


def test_casts_state_dict_and_reset_are_trivial():
    comp = FP16Compressor()
    comp.load_state_dict(comp.state_dict())
    comp.reset()
    assert comp.state_dict() == {"format": 1, "kind": "fp16"}
    comp.load_state_dict({"format": 1, "kind": "cast"})  # as saved before 0.2.0


def test_quantize_reset():
    comp = QuantizeCompressor(bits=2, bucket_size=64)
    x = _x((128,))
    first = comp.compress(x, "w")[0]
    comp.compress(x, "v")
    comp.reset("w")
    assert torch.equal(comp.compress(x, "w")[0], first)
    assert comp.state_dict()["steps"] == {"w": 1, "v": 1}
    comp.reset()
    assert comp.state_dict()["steps"] == {}


# -- non-finite policy (casts, quantize) ---------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_casts_keep_non_finite(dtype):
    x = torch.tensor([1.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    for comp in (FP16Compressor(), BF16Compressor(), FP16Compressor(predivide=3)):
        y = comp.decompress(*comp.compress(x))
        assert y[1] == float("inf") and y[2] == float("-inf") and y[3].isnan()


def test_fp16_overflow_becomes_inf_not_finite():
    y = FP16Compressor().decompress(*FP16Compressor().compress(torch.tensor([1e6, 1.0])))
    assert y[0] == float("inf")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_quantize_non_finite_bucket_decodes_to_nan(bad):
    x = _x((200,))
    x[70] = bad
    comp = QuantizeCompressor(bits=4, bucket_size=64)
    y = comp.decompress(*comp.compress(x))
    assert y[64:128].isnan().all()
    assert torch.isfinite(y[:64]).all() and torch.isfinite(y[128:]).all()


def test_auto_and_planned_are_policies_not_compressors():
    """They decide per tensor inside the gradient exchange: resolve() takes them, a single
    collective (as_compressor) refuses them with what to pass instead."""
    from cgx.compression import (AutoCompression, PlannedCompression, Policy, as_compressor,
                                 resolve)
    for policy in (Compression.auto(), Compression.planned()):
        assert isinstance(policy, Policy) and not isinstance(policy, Compressor)
        assert resolve(policy) is policy
        with pytest.raises(ValueError, match="takes a fixed compressor"):
            as_compressor(policy)
        with pytest.raises(ValueError, match="takes a fixed compressor"):
            ErrorFeedback(policy)
        # What these settings wrote when they were compressors still loads.
        policy.load_state_dict({"format": 1, "kind": "quantize"})
        policy.load_state_dict(policy.state_dict())
        with pytest.raises(ValueError):
            policy.load_state_dict({"format": 1, "kind": "topk"})
    assert isinstance(resolve(" AUTO "), AutoCompression)
    assert not isinstance(resolve(Compression.fp16), (AutoCompression, PlannedCompression))
    with pytest.raises(ValueError, match="takes a fixed compressor"):
        as_compressor("auto")
