"""Top-k sparsification against torch.topk + a dense scatter."""

from __future__ import annotations

import math

import pytest
import torch

from cgx.comm.base import ReduceOp, SingleProcessTransport
from cgx.compression import Compression, TopKCompressor
from cgx.compression.topk import TopKContext

from compression_refs import topk_dense


def _x(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("density", [1e-4, 0.01, 0.1, 0.37, 1.0])
@pytest.mark.parametrize("shape", [(1,), (5,), (33, 7), (4, 3, 5, 2), (1000,)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=str)
def test_matches_reference(density, shape, dtype):
    x = _x(shape, dtype)
    comp = TopKCompressor(density)
    payload, ctx = comp.compress(x)
    k = max(1, math.ceil(density * x.numel() - 1e-9))
    assert ctx.k == k
    y = comp.decompress(payload, ctx)
    assert y.dtype == dtype and y.shape == x.shape
    ref = topk_dense(x, k)
    # Ties in |x| (likely in half precision) may pick other positions of the same magnitude.
    assert torch.equal(y.abs().sort().values, ref.abs().sort().values)
    kept = y != 0
    assert torch.equal(y[kept], x[kept])
    assert int(kept.sum()) <= k


def test_k_formula():
    comp = TopKCompressor(0.07)
    assert comp.num_selected(100) == 7  # 0.07 * 100 = 7.000000000000001 in binary
    assert comp.num_selected(101) == 8
    assert comp.num_selected(1) == 1
    assert comp.num_selected(0) == 0
    assert TopKCompressor(1e-9).num_selected(10) == 1
    assert TopKCompressor(1.0).num_selected(10) == 10


def test_payload_layout():
    x = torch.tensor([0.5, -4.0, 1.0, 3.0, -0.25, 2.0])
    comp = TopKCompressor(0.5)
    payload, ctx = comp.compress(x)
    assert ctx == TopKContext(x.shape, torch.float32, 6, 3, torch.int32)
    assert payload.dtype == torch.uint8 and payload.numel() == 3 * (4 + 4)
    assert payload.numel() == comp.payload_nbytes(6)
    idx = payload[:12].view(torch.int32)
    vals = payload[12:].view(torch.float32)
    assert sorted(idx.tolist()) == [1, 3, 5]
    assert torch.equal(vals, x[idx.long()])


def test_float64_uses_int64_indices():
    comp = TopKCompressor(0.3)
    payload, ctx = comp.compress(_x((11,), torch.float64))
    assert ctx.index_dtype == torch.int64
    assert payload.numel() == ctx.k * 16 == comp.payload_nbytes(11, torch.float64)


def test_payload_size_is_equal_for_equal_shapes():
    comp = TopKCompressor(0.05)
    sizes = {comp.compress(_x((97, 3), seed=s))[0].numel() for s in range(5)}
    assert len(sizes) == 1


def test_empty_tensor():
    comp = TopKCompressor(0.5)
    payload, ctx = comp.compress(torch.empty(0, 3))
    assert payload.numel() == 0 and ctx.k == 0
    assert comp.decompress(payload, ctx).shape == (0, 3)
    assert comp.allreduce(torch.empty(0), SingleProcessTransport()).shape == (0,)


def test_non_contiguous_input():
    x = _x((20, 10)).t()
    comp = TopKCompressor(0.1)
    y = comp.decompress(*comp.compress(x))
    assert torch.equal(y.abs().sort().values, topk_dense(x, 20).abs().sort().values)


def test_allreduce_one_rank_sum_and_average():
    x = _x((50,))
    t = SingleProcessTransport()
    ref = topk_dense(x, 5)
    assert torch.equal(TopKCompressor(0.1).allreduce(x, t, op=ReduceOp.SUM), ref)
    assert torch.equal(TopKCompressor(0.1).allreduce(x, t), ref)


def test_accumulate_is_scatter_add():
    comp = TopKCompressor(0.25)
    a, b = _x((16,), seed=1), _x((16,), seed=2)
    acc = torch.zeros(16)
    for x in (a, b):
        comp.accumulate(*comp.compress(x), acc)
    assert torch.allclose(acc, topk_dense(a, 4) + topk_dense(b, 4))


def test_split_rejects_mismatched_payload():
    comp = TopKCompressor(0.5)
    payload, ctx = comp.compress(_x((10,)))
    with pytest.raises(ValueError, match="sender and receiver disagree"):
        comp.split(payload[:-4], ctx)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), float("inf"), "0.1", True, None])
def test_density_validation(bad):
    with pytest.raises(ValueError, match=r"density=.* is out of range; expected a fraction with "
                                         r"0 < density <= 1"):
        TopKCompressor(bad)
    with pytest.raises(ValueError, match="density="):
        Compression.topk(density=bad)


# -- non-finite policy -----------------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_value_is_selected(bad):
    x = _x((100,)) * 10
    x[42] = bad
    comp = TopKCompressor(0.01)  # k = 1: the bad value beats every finite one
    y = comp.decompress(*comp.compress(x))
    assert not torch.isfinite(y).all()
    assert not torch.isfinite(y[42])


def test_more_non_finite_than_k_still_non_finite():
    x = torch.full((10,), float("nan"))
    x[0] = 1e30
    y = TopKCompressor(0.2).decompress(*TopKCompressor(0.2).compress(x))
    assert y.isnan().sum() == 2


def test_non_finite_output_of_allreduce():
    x = _x((64,))
    x[3] = float("nan")
    out = TopKCompressor(0.05).allreduce(x, SingleProcessTransport())
    assert out.isnan().any()
