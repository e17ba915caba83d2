"""Per-layer error of each candidate, measured on what it sends for per-step gradients.

The error of a candidate on a step's gradient ``g`` is the unsquared Frobenius
norm ``||C(g) - g||`` (as in L-GreCo), where ``C(g)`` is what that compressor
sends for ``g``:

- quantization: the real quantizer with the exchange's rounding (stochastic
  rounding draws its noise from a key of the step and the layer, so a run
  measures the same numbers every time);
- top-k: the norm of what the k largest magnitudes leave, from one sort of
  the squared values (every density at once);
- PowerSGD: one power iteration from the warm start, as the exchange runs it
  (:class:`PowerSGDScorer`: the warm start follows the window's gradients,
  one iteration per step, and survives from one window to the next);
- 16-bit casts: the cast of the gradient and back (:func:`cast_error`); a value
  beyond float16's range makes the error infinite (the solver never picks it).

The window's gradients are measured one step at a time, not summed: a sum over
``n`` steps is less noisy and of lower rank than each step's gradient, which
made top-k and PowerSGD look better than what they send. Errors are taken at
up to :data:`SAMPLES` steps spread over the window and averaged.

``g`` is the gradient itself, without error-feedback residuals: a residual
depends on the plan in force (a layer planned at rank 1 carries a large one,
which would inflate its errors and the uniform default's, so an aggressive plan
would raise its own budget), while the gradient follows the training.

A step whose gradient is all zeros (the layer was not used, or frozen) is not
measured: it would give every candidate zero error. Each rank keeps, per layer
and candidate, the sum of its errors and how many steps it measured; one
allreduce adds every rank's (:func:`combine`), so every rank solves the same
problem from the mean over all measured steps of all ranks, and no rank's
gradients are ignored (L-GreCo's public code looks at rank 0 alone).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from cgx.adaptive.candidates import Candidate, Family
from cgx.quant import wire
from cgx.compression.base import stable_tensor_id
from cgx.compression.powersgd import PowerSGDCompressor
from cgx.quant.codec import QuantSpec, quantize
from cgx.config import Rounding

SAMPLES = 4  # steps of a window whose errors are measured (spread evenly over it)
SCORE_SEED = 0x5C0E  # stochastic rounding noise of the measurements (not the exchange's)


def sampled(offset: int, window: int) -> bool:
    """Whether the step ``offset`` steps into a window of ``window`` steps is measured
    (every ``ceil(window / SAMPLES)``-th step from the first; 10 steps: 0, 3, 6, 9)."""
    return offset % max(1, math.ceil(window / SAMPLES)) == 0


def quantization_error(x: torch.Tensor, spec: QuantSpec, threads: int = 1,
                       key: int = 0) -> float:
    """``||Q(x) - x||`` with the real quantizer (hidden cost: one quantize pass of a copy);
    ``key``: the stochastic-rounding key (``wire.noise_key``)."""
    x = x.detach().reshape(-1).to(torch.float32).contiguous()
    if x.numel() == 0:
        return 0.0
    y = x.clone()
    quantize(y, spec, write_back=True, threads=threads, key=key)
    return float(torch.linalg.vector_norm(y - x))


CAST_DTYPES = {Family.FP16: torch.float16, Family.BF16: torch.bfloat16}


def cast_error(x: torch.Tensor, family: Family) -> float:
    """``||cast(x) - x||`` for a 16-bit cast family (infinite when a value overflows it).

    The gradient itself is cast: the exchange divides by the world size first
    (``Compression.fp16``'s predivide), which moves only values near either end of the
    range (exactly none for a power-of-two world)."""
    v = x.detach().reshape(-1).float()
    err = float((v.to(CAST_DTYPES[family]).float() - v).norm())
    return err if math.isfinite(err) else math.inf


def topk_errors(x: torch.Tensor, ks: Sequence[int]) -> list[float]:
    """``||x - topk_k(x)||`` for each k (one top-k of the squares, at the largest k)."""
    sq = x.detach().reshape(-1).float().square()
    n = sq.numel()
    if n == 0:
        return [0.0 for _ in ks]
    total = float(sq.sum(dtype=torch.float64))
    kmax = min(n, max(ks))
    head = torch.topk(sq, kmax, sorted=True).values.double().cumsum(0)
    return [0.0 if k >= n else max(0.0, total - (float(head[k - 1]) if k > 0 else 0.0)) ** 0.5
            for k in ks]


class PowerSGDScorer:
    """What warm-started PowerSGD sends, at every rank of a layer, from one power iteration.

    The exchange's algorithm (``PowerSGDCompressor``, without error feedback) run
    locally at the layer's largest candidate rank: modified Gram-Schmidt and
    ``Q = M^T P`` act column by column, so the leading ``r`` columns of that run
    are exactly what rank ``r`` sends from the leading ``r`` columns of the warm
    start, which is also how the exchange keeps a warm start when a re-plan
    lowers the rank. One run gives every rank's error.

    Hidden cost: per layer and observed step, two products of the (n, m) matrix
    with an (., r_max) one, and at measured steps one (n, m) difference per rank.
    """

    def __init__(self):
        self.compressor = PowerSGDCompressor(min_compression_rate=0.0, error_feedback=False)

    def step(self, name: str, grad: torch.Tensor, shape: Sequence[int], ranks: Sequence[int],
             measure: bool) -> Optional[list[float]]:
        """One power iteration on ``grad`` (advancing the warm start); with ``measure``,
        ``||P_r Q_r^T - grad||`` for each of ``ranks``."""
        n = int(shape[0])
        M = grad.detach().reshape(n, -1).float()
        self.compressor.ranks[name] = max(ranks)
        payload, ctx = self.compressor.compress(M, name)
        if not measure:
            return None
        if ctx.rank == 0:  # not compressed (cannot happen for a candidate): sent whole
            return [0.0 for _ in ranks]
        P = payload[:ctx.n * ctx.rank].view(ctx.n, ctx.rank)
        Q = payload[ctx.n * ctx.rank:].view(ctx.m, ctx.rank)
        return [float(torch.linalg.matrix_norm(M - P[:, :r] @ Q[:, :r].T)) for r in ranks]

    def state_dict(self) -> dict:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state)


def candidate_errors(grad: torch.Tensor, candidates: Sequence[Candidate], *,
                     rounding: Rounding = Rounding.NEAREST, key: int = 0, threads: int = 1,
                     lowrank: Optional[list] = None) -> list[float]:
    """``||C(grad) - grad||`` for each candidate, PowerSGD's from ``lowrank`` (the errors
    :meth:`PowerSGDScorer.step` measured, in the order of the PowerSGD candidates)."""
    out = [0.0] * len(candidates)
    topk = [i for i, c in enumerate(candidates) if c.family is Family.TOPK]
    if topk:
        from cgx.compression.topk import TopKCompressor
        ks = [TopKCompressor(candidates[i].density).num_selected(grad.numel()) for i in topk]
        for i, e in zip(topk, topk_errors(grad, ks)):
            out[i] = e
    low = [i for i, c in enumerate(candidates) if c.family is Family.POWERSGD]
    if low:
        if lowrank is None or len(lowrank) != len(low):
            raise ValueError(f"{len(low)} PowerSGD candidates need as many measured errors, "
                             f"got {lowrank!r}")
        for i, e in zip(low, lowrank):
            out[i] = e
    for i, c in enumerate(candidates):
        if c.family is Family.QUANTIZE:
            out[i] = quantization_error(grad, QuantSpec(c.bits, c.bucket_size, rounding),
                                        threads, key)
        elif c.family in CAST_DTYPES:
            out[i] = cast_error(grad, c.family)
    return out


def step_key(step: int, name: str) -> int:
    """The stochastic-rounding key of a measurement of layer ``name`` at ``step``."""
    return wire.noise_key(SCORE_SEED, step, stable_tensor_id(name))


def combine(sums: list[list[float]], counts: list[int], transport) -> list[Optional[list]]:
    """Per layer: the mean error of each candidate over every measured step of every rank
    (one float64 allreduce of the sums and counts; identical on every rank), or None for
    a layer no rank measured."""
    from cgx.comm.base import ReduceOp
    lens = [len(row) for row in sums]
    flat = torch.tensor([v for row in sums for v in row] + [float(c) for c in counts],
                        dtype=torch.float64, device=transport.device)
    if transport.size > 1 and flat.numel():
        transport.allreduce(flat, ReduceOp.SUM)
    vals = flat.cpu().tolist()
    total = vals[len(vals) - len(counts):]
    out, k = [], 0
    for n, c in zip(lens, total):
        out.append([v / c for v in vals[k:k + n]] if c > 0 else None)
        k += n
    return out
