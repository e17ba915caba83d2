"""PowerSGD against an explicit QR-based implementation of the same math."""

from __future__ import annotations

import pytest
import torch

from cgx.comm.base import ReduceOp, SingleProcessTransport
from cgx.compression import Compression, ErrorFeedback, PowerSGDCompressor
from cgx.compression.powersgd import LowRankContext, initial_q, orthogonalize_

from compression_refs import powersgd_reference


def _x(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("warm_start", [True, False])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_matches_reference_over_steps(rank, warm_start, error_feedback):
    comp = PowerSGDCompressor(rank=rank, warm_start=warm_start, error_feedback=error_feedback,
                              seed=7)
    steps = [[_x((24, 17), seed=s)] for s in range(4)]
    expect, residuals = powersgd_reference(steps, rank, seed=7, name="w",
                                           error_feedback=error_feedback, warm_start=warm_start)
    for (x,), ref in zip(steps, expect):
        out = comp.allreduce(x, SingleProcessTransport(), name="w")
        assert torch.allclose(out.double(), ref, atol=2e-5), (out.double() - ref).abs().max()
    if error_feedback:
        assert torch.allclose(comp.residual("w").double(), residuals[0], atol=2e-5)
    else:
        assert comp.residual("w") is None


def test_local_compress_equals_one_rank_allreduce():
    a, b = PowerSGDCompressor(rank=2), PowerSGDCompressor(rank=2)
    for s in range(3):
        x = _x((16, 3, 3), seed=s)  # conv-like: viewed as (16, 9)
        payload, ctx = a.compress(x, name="conv")
        assert ctx == LowRankContext(x.shape, torch.float32, 16, 9, 2)
        assert payload.numel() == (16 + 9) * 2 == a.payload_numel(x.shape)
        assert torch.allclose(a.decompress(payload, ctx),
                              b.allreduce(x, SingleProcessTransport(), name="conv"), atol=1e-6)


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (7, 2, 3)], ids=str)
def test_full_rank_reproduces_the_matrix(shape):
    x = _x(shape)
    n, m = shape[0], x.numel() // shape[0]
    comp = PowerSGDCompressor(rank=min(n, m), min_compression_rate=0, error_feedback=False)
    out = comp.allreduce(x, SingleProcessTransport())
    assert torch.allclose(out, x, atol=1e-4)  # float32 Gram-Schmidt of a square P


def test_exact_low_rank_matrix_is_recovered():
    u, v = _x((30, 2), seed=1), _x((2, 40), seed=2)
    x = u @ v
    comp = PowerSGDCompressor(rank=2, error_feedback=False)
    out = comp.allreduce(x, SingleProcessTransport())
    assert torch.allclose(out, x, atol=1e-4)


@pytest.mark.parametrize("shape", [(100,), (), (3, 4), (0, 5)], ids=str)
def test_uncompressed_tensors_pass_exactly(shape):
    x = _x(shape)
    comp = PowerSGDCompressor(rank=1)  # (3, 4): 1 * 7 * 2 >= 12, not worth it
    assert comp.effective_rank(shape) == 0
    assert comp.payload_numel(shape) == x.numel()
    payload, ctx = comp.compress(x, name="v")
    assert ctx.rank == 0 and torch.equal(comp.decompress(payload, ctx), x)
    assert torch.equal(comp.allreduce(x, SingleProcessTransport(), name="v"), x)
    assert comp.residual("v") is None


def test_min_compression_rate_rule():
    # torch's rule: compress when r * (n + m) * rate < n * m
    assert PowerSGDCompressor(rank=2, min_compression_rate=2).effective_rank((10, 10)) == 2
    assert PowerSGDCompressor(rank=2, min_compression_rate=3).effective_rank((10, 10)) == 0
    assert PowerSGDCompressor(rank=2, min_compression_rate=2.5).effective_rank((10, 10)) == 0
    assert PowerSGDCompressor(rank=50, min_compression_rate=0).effective_rank((4, 9)) == 4


def test_start_step_runs_plain_allreduce_first():
    comp = PowerSGDCompressor(rank=1, start_step=2)
    x = _x((20, 20))
    t = SingleProcessTransport()
    assert torch.equal(comp.allreduce(x, t, name="w"), x)
    assert torch.equal(comp.allreduce(x, t, name="w"), x)
    assert comp.residual("w") is None
    assert not torch.equal(comp.allreduce(x, t, name="w"), x)
    assert comp.residual("w") is not None


def test_sum_scales_by_world():
    x = _x((20, 20))
    avg = PowerSGDCompressor(rank=2).allreduce(x, SingleProcessTransport())
    total = PowerSGDCompressor(rank=2).allreduce(x, SingleProcessTransport(), op=ReduceOp.SUM)
    assert torch.allclose(avg, total)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_dtypes(dtype):
    x = _x((24, 16), dtype)
    comp = PowerSGDCompressor(rank=2)
    payload, ctx = comp.compress(x, name="w")
    assert payload.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    y = comp.decompress(payload, ctx)
    assert y.dtype == dtype and y.shape == x.shape
    assert comp.allreduce(x, SingleProcessTransport(), name="w").dtype == dtype


def test_warm_start_draws_once_and_cold_start_every_step():
    warm, cold = PowerSGDCompressor(rank=1), PowerSGDCompressor(rank=1, warm_start=False)
    for s in range(3):
        warm.compress(_x((20, 20), seed=s), "w")
        cold.compress(_x((20, 20), seed=s), "w")
    assert warm.state_dict()["draws"] == {"w": 1} and "w" in warm.state_dict()["q"]
    assert cold.state_dict()["draws"] == {"w": 3} and cold.state_dict()["q"] == {}


def test_initial_q_is_reproducible_and_per_name():
    a = initial_q(0, "w", 0, 9, 2)
    assert torch.equal(a, initial_q(0, "w", 0, 9, 2))
    assert not torch.equal(a, initial_q(0, "v", 0, 9, 2))
    assert not torch.equal(a, initial_q(0, "w", 1, 9, 2))
    assert not torch.equal(a, initial_q(1, "w", 0, 9, 2))


def test_orthogonalize():
    m = _x((30, 4))
    orthogonalize_(m)
    assert torch.allclose(m.T @ m, torch.eye(4), atol=1e-5)


def test_orthogonalize_zero_column_stays_zero():
    m = _x((10, 3))
    m[:, 1] = 0
    orthogonalize_(m)
    assert torch.isfinite(m).all()
    assert torch.equal(m[:, 1], torch.zeros(10))
    eps = _x((10, 2))
    eps[:, 0] = 0
    orthogonalize_(eps, epsilon=1e-8)
    assert torch.isfinite(eps).all()


def test_zero_gradient_gives_zero_not_nan():
    comp = PowerSGDCompressor(rank=2)
    out = comp.allreduce(torch.zeros(16, 16), SingleProcessTransport(), name="w")
    assert torch.equal(out, torch.zeros(16, 16))
    x = _x((16, 16))
    assert torch.isfinite(comp.allreduce(x, SingleProcessTransport(), name="w")).all()


def test_rank_change_after_load_redraws_q():
    a = PowerSGDCompressor(rank=1, error_feedback=False)
    a.compress(_x((20, 20)), "w")
    b = PowerSGDCompressor(rank=3, error_feedback=False)
    b.load_state_dict(a.state_dict())
    payload, ctx = b.compress(_x((20, 20)), "w")
    assert ctx.rank == 3 and payload.numel() == 40 * 3


def test_shape_mismatch_for_a_name():
    comp = PowerSGDCompressor(rank=1)
    comp.compress(_x((20, 20)), "w")
    with pytest.raises(ValueError, match=r"residual of 'w' is for a \(20, 20\) matrix but the "
                                         r"tensor is viewed as \(20, 30\)"):
        comp.compress(_x((20, 30)), "w")
    cold = PowerSGDCompressor(rank=1, error_feedback=False)
    cold.compress(_x((20, 20)), "w")
    with pytest.raises(ValueError, match="warm-start Q of 'w' has 20 rows but the tensor has 30"):
        cold.compress(_x((20, 30)), "w")
    comp.reset("w")
    comp.compress(_x((20, 30)), "w")


def test_reset_all():
    comp = PowerSGDCompressor(rank=1)
    comp.compress(_x((20, 20)), "a")
    comp.compress(_x((20, 20)), "b")
    comp.reset()
    state = comp.state_dict()
    assert state["q"] == {} and state["residuals"] == {} and state["steps"] == {}


def test_wrapping_in_error_feedback_refused():
    with pytest.raises(ValueError, match="PowerSGD keeps its own residual"):
        ErrorFeedback(PowerSGDCompressor())


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(rank=0), ValueError, r"rank=0 is not valid; expected an int >= 1"),
    (dict(rank=1.5), ValueError, r"rank=1.5 is not valid"),
    (dict(rank=True), ValueError, r"rank=True is not valid"),
    (dict(min_compression_rate=-1), ValueError, r"min_compression_rate=-1 is not valid; "
                                                r"expected a finite number >= 0"),
    (dict(min_compression_rate=float("nan")), ValueError, "min_compression_rate=nan"),
    (dict(start_step=-1), ValueError, r"start_step=-1 is not valid; expected an int >= 0"),
    (dict(warm_start=1), TypeError, "warm_start must be True or False, got 1"),
    (dict(error_feedback="yes"), TypeError, "error_feedback must be True or False"),
    (dict(orthogonalization_epsilon=-1e-8), ValueError, "orthogonalization_epsilon=-1e-08"),
    (dict(seed=2**64), ValueError, r"seed=18446744073709551616 must be an int in \[0, 2\*\*64\)"),
])
def test_validation(kwargs, err, match):
    with pytest.raises(err, match=match):
        PowerSGDCompressor(**kwargs)
    with pytest.raises(err, match=match):
        Compression.powersgd(**kwargs)


# -- non-finite policy ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_in_non_finite_out_and_state_survives(bad):
    comp = PowerSGDCompressor(rank=2)
    t = SingleProcessTransport()
    comp.allreduce(_x((20, 20), seed=1), t, name="w")
    residual, q = comp.residual("w").clone(), comp.state_dict()["q"]["w"]
    x = _x((20, 20), seed=2)
    x[3, 4] = bad
    out = comp.allreduce(x, t, name="w")
    assert not torch.isfinite(out).all()
    assert torch.equal(comp.residual("w"), residual)  # step skipped: residual kept
    assert torch.isfinite(comp.state_dict()["q"]["w"]).all()
    assert torch.allclose(comp.state_dict()["q"]["w"], orthogonalize_(q.clone()), atol=1e-6)
    assert torch.isfinite(comp.allreduce(_x((20, 20), seed=3), t, name="w")).all()


def test_non_finite_local_compress():
    x = _x((20, 20))
    x[0, 0] = float("nan")
    comp = PowerSGDCompressor(rank=1)
    assert comp.decompress(*comp.compress(x, "w")).isnan().any()
    assert torch.equal(comp.residual("w"), torch.zeros(20, 20))  # first step: stays zero


def test_warm_start_survives_a_change_of_rank():
    """Raising the rank keeps the old Q as the leading columns; lowering it truncates."""
    from cgx.compression import Compression
    from cgx.compression.powersgd import orthogonalize_
    g = torch.Generator().manual_seed(0)
    comp = Compression.powersgd(rank=2, error_feedback=False)
    x = torch.randn(40, 30, generator=g)
    comp.compress(x, name="w")
    q2 = comp._q["w"].clone()
    comp.rank = 4
    M = x.clone()
    start = comp._start_q("w", M, 4)
    assert start.shape == (30, 4)
    assert torch.allclose(start[:, :2], orthogonalize_(q2.clone()), atol=1e-6)
    assert torch.allclose(start.T @ start, torch.eye(4), atol=1e-5)  # orthonormal
    comp.compress(x, name="w")
    q4 = comp._q["w"].clone()
    comp.rank = 1
    start = comp._start_q("w", M, 1)
    assert torch.allclose(start, orthogonalize_(q4[:, :1].clone()), atol=1e-6)
    # Truncating draws nothing; neither does the stored rank-4 Q at rank 4 again.
    draws = dict(comp._draws)
    comp._start_q("w", M, 4)
    assert comp._draws == draws
