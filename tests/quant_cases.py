"""Inputs and comparisons shared by the quantization tests (tests/test_quant_*.py)."""

from __future__ import annotations

import torch

from cgx.quant import wire

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALL_BITS = tuple(range(1, 9))
# irregular sizes around the bucket and group (8 values) boundaries, for bucket 64
SIZES_64 = (1, 7, 8, 9, 63, 64, 65, 1023, 1025, 64 * 5 + 3)


def randn(n: int, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(dtype)


def special_inputs(bucket: int = 64) -> dict[str, torch.Tensor]:
    """Named float32 inputs that stress the edge cases of the wire format."""
    b = bucket
    x = randn(3 * b + 5, seed=1)
    cases = {
        "zeros": torch.zeros(2 * b + 3),
        "constant": torch.full((2 * b + 3,), -3.25),
        "constant_per_bucket": torch.arange(3).repeat_interleave(b).float() * 7.0 - 1.0,
        "huge": randn(2 * b, seed=2).clamp(-1, 1) * 1e38,  # range 2e38 < FLT_MAX
        "tiny": randn(2 * b, seed=3) * 1e-38,  # unit < FLT_MIN: constant bucket
        "subnormal": randn(2 * b, seed=4) * 1e-42,
        "mixed_scales": torch.cat([randn(b, 5) * 1e-6, randn(b, 6) * 1e6, randn(b + 1, 7)]),
        "signed_zeros": torch.tensor([0.0, -0.0] * b),
        # exact half-level ties: 0..15 with +0.5 offsets, unit 1 at 4 bits
        "ties": torch.cat([torch.tensor([0.0, 15.0]), torch.arange(15) + 0.5,
                           torch.zeros(b - 17)]).float(),
        "one_value": torch.tensor([2.5]),
        "inf": x.clone().index_fill_(0, torch.tensor([b + 3]), float("inf")),
        "neg_inf": x.clone().index_fill_(0, torch.tensor([0]), float("-inf")),
        "nan_last_bucket": x.clone().index_fill_(0, torch.tensor([3 * b + 4]), float("nan")),
        "all_nan": torch.full((b + 1,), float("nan")),
    }
    return cases


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise equality of float tensors, except that any NaN matches any NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    a_nan, e_nan = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(a_nan, e_nan), f"NaN positions differ: {torch.nonzero(a_nan != e_nan)[:8]}"
    ibits = torch.int32 if actual.element_size() == 4 else torch.int16
    a = actual.view(ibits)[~a_nan]
    e = expected.view(ibits)[~e_nan]
    if not torch.equal(a, e):
        bad = torch.nonzero(a != e)[:8].flatten()
        raise AssertionError(f"values differ at (non-NaN) positions {bad.tolist()}: "
                             f"{actual[~a_nan][bad].tolist()} vs {expected[~e_nan][bad].tolist()}")


def assert_same_payload(actual: torch.Tensor, expected: torch.Tensor, numel: int,
                        bucket_size: int) -> None:
    """Byte equality of two segments, except the sign of a zero bucket minimum.

    A bucket holding both +0.0 and -0.0 may report either as its min (the
    reductions of the implementations visit values in different orders); the
    decoded values are the same either way (lo + unit * q with unit * q >= +0).
    """
    assert actual.dtype == torch.uint8 and expected.dtype == torch.uint8
    assert actual.numel() == expected.numel(), (actual.numel(), expected.numel())
    if torch.equal(actual, expected):
        return
    nb = wire.num_buckets(numel, bucket_size)
    meta_a = actual[: 8 * nb].clone().view(torch.float32).view(nb, 2)
    meta_e = expected[: 8 * nb].clone().view(torch.float32).view(nb, 2)
    codes_equal = torch.equal(actual[8 * nb:], expected[8 * nb:])
    units_equal = torch.equal(meta_a[:, 0].view(torch.int32), meta_e[:, 0].view(torch.int32))
    lo_a, lo_e = meta_a[:, 1], meta_e[:, 1]
    lo_ok = (lo_a.view(torch.int32) == lo_e.view(torch.int32)) | ((lo_a == 0) & (lo_e == 0))
    if codes_equal and units_equal and bool(lo_ok.all()):
        return
    diff = torch.nonzero(actual != expected).flatten()
    raise AssertionError(f"payloads differ at byte(s) {diff[:16].tolist()} "
                         f"(meta is bytes [0, {8 * nb}), codes after): "
                         f"{actual[diff[:16]].tolist()} vs {expected[diff[:16]].tolist()}")
