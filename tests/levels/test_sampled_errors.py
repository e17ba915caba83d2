"""A large layer's candidate errors are estimated from samples, PowerSGD's in closed form:
the estimates agree with the full measurements and keep the candidates' order."""

import math

import pytest
import torch

from cgx.policy.levels import Candidate, Family, candidates_for
from cgx.policy.levels.stats import (SAMPLE_VALUES, bucket_sample, candidate_errors, cast_error,
                                lowrank_errors, quantization_error, topk_errors)
from cgx.config import Rounding
from cgx.quant.codec import QuantSpec

from benchmarks.adaptive import embedding_gradient


FAMILIES = [Family.QUANTIZE, Family.TOPK, Family.FP16, Family.BF16]


def _layer(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A gradient whose rows differ in scale by 100x and whose values are heavy-tailed,
    as a fully connected layer's are."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, rows).unsqueeze(1)
    x = torch.randn(rows, cols, generator=g) * scale
    return (x * torch.rand(rows, cols, generator=g).pow(3)).reshape(-1)


def test_lowrank_errors_are_the_norms_of_what_the_factors_leave_out():
    g = torch.Generator().manual_seed(1)
    M = torch.randn(50, 30, generator=g) @ torch.diag(torch.linspace(4, 0.1, 30))
    P = torch.randn(50, 4, generator=g)  # not orthonormal: the formula does not need it
    Q = M.T @ P
    want = [float(torch.linalg.matrix_norm(M - P[:, :r] @ Q[:, :r].T)) for r in (1, 2, 4)]
    assert lowrank_errors(M, P, Q, [1, 2, 4]) == pytest.approx(want, rel=1e-6)


def test_a_bucket_sample_is_made_of_whole_buckets_of_the_layer():
    # Every 4096-value chunk holds the same values: a sample of whole, aligned chunks
    # has exactly the layer's error per value; a misaligned one would not.
    pattern = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * \
        torch.linspace(0.01, 5, 4096)
    x = pattern.repeat(3 * SAMPLE_VALUES // 4096)
    sample, weights = bucket_sample(x, 4096, key=7)
    # equal chunks: drawn evenly, each standing for 3 of the layer's
    assert sample.numel() == SAMPLE_VALUES and weights.tolist() == pytest.approx(
        [3.0] * (SAMPLE_VALUES // 4096))
    for bits, bucket in ((2, 128), (4, 1024), (3, 4096)):
        spec = QuantSpec(bits, bucket, Rounding.NEAREST)
        assert quantization_error(sample, spec, weights=weights) == pytest.approx(
            quantization_error(x, spec), rel=1e-3)
    small = torch.randn(SAMPLE_VALUES)
    assert bucket_sample(small, 4096, key=7) == (small, None)  # measured whole
    zeros = torch.zeros(3 * SAMPLE_VALUES)  # nothing to weigh by: drawn evenly
    sample, weights = bucket_sample(zeros, 4096, key=7)
    assert sample.numel() == SAMPLE_VALUES and weights.tolist() == pytest.approx(
        [3.0] * (SAMPLE_VALUES // 4096))


def _embedding_gradient() -> torch.Tensor:
    """An embedding's gradient (benchmarks/adaptive.py's): 300 of 8192 rows used."""
    return embedding_gradient(8192, 512, used=300).reshape(-1)


@pytest.mark.parametrize("rounding", [Rounding.NEAREST, Rounding.STOCHASTIC])
def test_a_sparse_layers_sampled_errors_follow_its_mass(rounding):
    # Chunks drawn by their sum of squares: every draw within 8% of the full measurement.
    # Chunks spread evenly over the rows (the sampling before) measured 13-80% of it here.
    x = _embedding_gradient()
    for bits, bucket in ((2, 128), (4, 1024), (8, 4096)):
        spec = QuantSpec(bits, bucket, rounding)
        full = quantization_error(x, spec, key=3)
        for key in range(5):
            sample, weights = bucket_sample(x, 4096, key=key, limit=SAMPLE_VALUES // 4)
            assert sample.numel() <= SAMPLE_VALUES // 4
            assert quantization_error(sample, spec, key=3, weights=weights) == \
                pytest.approx(full, rel=0.08), (bits, bucket, key)
    for family in (Family.FP16, Family.BF16):  # the casts on the same chunks
        full = cast_error(x, family)
        for key in range(5):
            sample, weights = bucket_sample(x, 4096, key=key, limit=SAMPLE_VALUES // 4)
            assert cast_error(sample, family, weights) == pytest.approx(full, rel=0.08), key


@pytest.mark.parametrize("rounding", [Rounding.NEAREST, Rounding.STOCHASTIC])
def test_a_large_layers_sampled_errors_match_the_full_measurement(rounding):
    x = _layer(1024, 4 * SAMPLE_VALUES // 1024)
    cands = [c for c in candidates_for((x.numel(),), FAMILIES) if c.family is not Family.EXACT]
    got = candidate_errors(x, cands, rounding=rounding, key=123)
    for c, e in zip(cands, got):
        if c.family is Family.QUANTIZE:
            full = quantization_error(x, QuantSpec(c.bits, c.bucket_size, rounding), key=123)
        elif c.family is Family.TOPK:
            from cgx.compression.topk import TopKCompressor
            full = topk_errors(x, [TopKCompressor(c.density).num_selected(x.numel())])[0]
        else:
            full = cast_error(x, c.family)
        # 256 buckets of 4096 in the sample: within 6% on this layer (over 5 keys)
        assert e == pytest.approx(full, rel=0.08), c.label
    # The candidates keep their order: fewer bits, more error, at every bucket size.
    quant = {(c.bits, c.bucket_size): e for c, e in zip(cands, got)
             if c.family is Family.QUANTIZE}
    for (bits, bucket), e in quant.items():
        if (bits + 1, bucket) in quant:
            assert e > quant[(bits + 1, bucket)]


def test_the_same_key_draws_the_same_sample_and_another_key_another():
    x = _layer(512, 3 * SAMPLE_VALUES // 512)
    cands = [Candidate(Family.QUANTIZE, 4, 512), Candidate(Family.TOPK, density=0.01)]
    a = candidate_errors(x, cands, key=5)
    assert candidate_errors(x, cands, key=5) == a
    assert candidate_errors(x, cands, key=6) != a


def test_a_value_beyond_float16_outside_the_sample_still_makes_fp16_infinite():
    # One value past float16's range among large in-range ones: its chunk holds 0.13% of the
    # mass and is drawn in none of these samples; the peak, read over the whole layer,
    # still makes fp16 infinite.
    x = torch.full((4 * SAMPLE_VALUES,), 2000.0)
    x[12345] = 7e4
    cands = [Candidate(Family.FP16), Candidate(Family.BF16)]
    for key in (1, 4, 5):
        sample, _ = bucket_sample(x, 4096, key)
        assert not bool((sample == 7e4).any()), key  # (not drawn)
        fp16, bf16 = candidate_errors(x, cands, key=key)
        assert fp16 == math.inf and math.isfinite(bf16)


def test_casts_below_float16s_normal_range_are_weighed_too():
    # Under float16's smallest normal value a cast errs by about its fixed step whatever
    # the value's size: rows at 5e-7 hold half of the fp16 error and 1e-4 of the mass.
    # Drawn by mass alone they are hardly sampled (0.71x the error at every draw); the
    # draws spread evenly keep them in.
    g = torch.Generator().manual_seed(4)
    scale = torch.where(torch.arange(2048) < 1024, 5e-5, 5e-7).unsqueeze(1)
    x = (torch.randn(2048, 2048, generator=g) * scale).reshape(-1)
    full = cast_error(x, Family.FP16)
    for key in range(5):
        sample, weights = bucket_sample(x, 4096, key=key, limit=SAMPLE_VALUES // 4)
        assert cast_error(sample, Family.FP16, weights) == pytest.approx(full, rel=0.08), key
