"""Error feedback: what compression drops is carried to later steps, never lost or poisoned."""

from __future__ import annotations

import pytest
import torch

from cgx.comm.base import SingleProcessTransport
from cgx.compression import (BF16Compressor, Compression, ErrorFeedback, FP16Compressor,
                             QuantizeCompressor, TopKCompressor)


def _x(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def _inner():
    return {
        "topk": lambda: TopKCompressor(0.05),
        "quantize2": lambda: QuantizeCompressor(bits=2, bucket_size=64),
        "quantize_nearest": lambda: QuantizeCompressor(bits=3, bucket_size=64, rounding="nearest"),
        "fp16": lambda: FP16Compressor(),
        "bf16": lambda: BF16Compressor(),
    }


@pytest.mark.parametrize("inner", list(_inner()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_transmitted_plus_residual_equals_inputs(inner, dtype):
    comp = ErrorFeedback(_inner()[inner]())
    total_in = torch.zeros(40, 9, dtype=torch.float64)
    total_sent = torch.zeros(40, 9, dtype=torch.float64)
    for step in range(6):
        x = _x((40, 9), dtype, seed=step)
        payload, ctx = comp.compress(x, name="w")
        sent = comp.decompress(payload, ctx)
        assert sent.dtype == dtype and sent.shape == x.shape
        total_in += x.double()
        # The compressor decodes in the gradient's dtype; the residual absorbed the rest.
        total_sent += comp.compressor.decompress(payload, ctx.inner).double()
    residual = comp.residual("w")
    assert residual.dtype == torch.float32
    assert torch.allclose(total_sent + residual.double(), total_in, atol=1e-5)


def test_conservation_through_allreduce():
    comp = Compression.topk(density=0.1)
    t = SingleProcessTransport()
    total_in, total_out = torch.zeros(200), torch.zeros(200)
    for step in range(5):
        x = _x((200,), seed=step)
        total_in += x
        total_out += comp.allreduce(x, t, name="g")
    assert torch.allclose(total_out + comp.residual("g"), total_in, atol=1e-5)


def test_feedback_makes_topk_unbiased_over_time():
    # A constant gradient: without feedback the small entries are never sent.
    g = _x((100,))
    plain, fed = TopKCompressor(0.05), ErrorFeedback(TopKCompressor(0.05))
    steps = 200
    sent_plain = sum(plain.decompress(*plain.compress(g)) for _ in range(steps)) / steps
    sent_fed = sum(fed.decompress(*fed.compress(g, "g")) for _ in range(steps)) / steps
    assert (sent_plain - g).abs().max() > 0.5
    assert (sent_fed - g).abs().max() < 0.1


def test_first_step_without_residual_is_plain_compression():
    x = _x((64,))
    payload, _ = ErrorFeedback(TopKCompressor(0.1)).compress(x, "w")
    assert torch.equal(payload, TopKCompressor(0.1).compress(x)[0])


def test_residuals_are_per_name():
    comp = ErrorFeedback(TopKCompressor(0.1))
    comp.compress(_x((50,)), "a")
    comp.compress(_x((7, 3)), "b")
    assert comp.residual("a").shape == (50,) and comp.residual("b").shape == (7, 3)
    assert comp.residual("c") is None


def test_kind_and_summable_follow_the_inner_compressor():
    assert ErrorFeedback(FP16Compressor()).summable
    assert not ErrorFeedback(TopKCompressor()).summable
    assert ErrorFeedback(Compression.fp16).compressor is Compression.fp16.compress.__self__


def test_integer_tensors_bypass_feedback():
    comp = ErrorFeedback(FP16Compressor())
    ints = torch.arange(5)
    payload, ctx = comp.compress(ints, "n")
    assert torch.equal(comp.decompress(payload, ctx), ints) and comp.residual("n") is None
    with pytest.raises(TypeError, match="compresses floating-point tensors"):
        ErrorFeedback(QuantizeCompressor()).compress(ints, "n")


def test_state_dict_holds_residuals_and_inner_state():
    comp = Compression.quantize(bits=2, bucket_size=64, error_feedback=True)
    comp.compress(_x((100,)), "w")
    state = comp.state_dict()
    assert state["kind"] == "error_feedback"
    assert set(state["residuals"]) == {"w"} and state["compressor"]["steps"] == {"w": 1}
    fresh = Compression.quantize(bits=2, bucket_size=64, error_feedback=True)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.residual("w"), comp.residual("w"))
    assert fresh.residual("w") is not state["residuals"]["w"]


def test_reset():
    comp = Compression.quantize(bits=2, bucket_size=64, error_feedback=True)
    comp.compress(_x((100,)), "a")
    comp.compress(_x((100,)), "b")
    comp.reset("a")
    assert comp.residual("a") is None and comp.residual("b") is not None
    assert comp.compressor.state_dict()["steps"] == {"b": 1}
    comp.reset()
    assert comp.residual("b") is None


def test_shape_mismatch_for_a_name():
    comp = ErrorFeedback(TopKCompressor(0.1))
    comp.compress(_x((50,)), "w")
    with pytest.raises(ValueError, match=r"residual of 'w' has shape \(50,\) but the tensor has "
                                         r"shape \(5, 10\): give every tensor its own name"):
        comp.compress(_x((5, 10)), "w")


def test_wrapping_twice_refused():
    with pytest.raises(ValueError, match="already has error feedback; wrap it only once"):
        ErrorFeedback(ErrorFeedback(TopKCompressor()))
    with pytest.raises(TypeError, match="compression must be a cgx compressor"):
        ErrorFeedback(42)


# -- non-finite policy -----------------------------------------------------------------

@pytest.mark.parametrize("inner", list(_inner()))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_step_keeps_previous_residual(inner, bad):
    comp = ErrorFeedback(_inner()[inner]())
    comp.compress(_x((40, 9), seed=1), "w")
    before = comp.residual("w").clone()
    x = _x((40, 9), seed=2)
    x[5, 5] = bad
    payload, ctx = comp.compress(x, "w")
    assert not torch.isfinite(comp.decompress(payload, ctx)).all()  # visible, not hidden
    assert torch.equal(comp.residual("w"), before)
    comp.compress(_x((40, 9), seed=3), "w")
    assert torch.isfinite(comp.residual("w")).all()


def test_non_finite_first_step_leaves_zero_residual():
    comp = ErrorFeedback(TopKCompressor(0.1))
    x = _x((30,))
    x[0] = float("nan")
    comp.compress(x, "w")
    assert torch.equal(comp.residual("w"), torch.zeros(30))


def test_fp16_overflow_is_not_stored_as_residual():
    comp = ErrorFeedback(FP16Compressor())
    comp.compress(_x((8,)), "w")
    before = comp.residual("w").clone()
    out = comp.decompress(*comp.compress(torch.full((8,), 1e6), "w"))  # finite in, inf on wire
    assert torch.isinf(out).all()
    assert torch.equal(comp.residual("w"), before)
