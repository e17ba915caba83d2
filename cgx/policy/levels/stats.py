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

A layer larger than :data:`SAMPLE_VALUES` is measured on a sample of that many
values (a 4096 x 4096 layer's 24 quantization levels, top-k and PowerSGD took
seconds a step). Quantization and the 16-bit casts: on whole chunks of buckets drawn
mostly in proportion to their sum of squares (:func:`bucket_sample`, every level on
the same chunks; a fifth of the draws spread evenly), each chunk's squared error
weighted by the inverse of its expected draws, so the sum is unbiased. A chunk's
quantization error is at most a multiple of its sum of squares, and zero without one,
so drawing chunks by their mass keeps the estimate tight where the gradient's scale
varies across the layer: an embedding's gradient lives in the rows of the batch's
tokens, and chunks spread evenly over the layer missed or hit them (half of the
project's LM's embedding, sampled evenly: 35-50% off from one draw to the next; drawn
by mass: 2-3%). Top-k: on values drawn at random
(:func:`value_sample`), its squared error scaled by the layer's size over the
sample's. PowerSGD's errors come in closed form from its factors
(:meth:`PowerSGDScorer.step`), never from the full product.

``g`` is the gradient itself, without error-feedback residuals: a residual
depends on the plan in force (a layer planned at rank 1 carries a large one,
which would inflate its errors and the uniform default's, so an aggressive plan
would raise its own budget), while the gradient follows the training.

A step whose gradient is all zeros (the layer was not used, or frozen) is not
measured: it would give every candidate zero error. At a sampled step each layer is
measured by one rank, the ranks taking the layers in turn from one sampled step to
the next (:func:`measuring_ranks`, ``AdaptiveSchedule.measure_share``): the window's
measuring work is split over the ranks instead of repeated on each, and over a
window a layer is still measured on several ranks' gradients (L-GreCo's public code
looks at rank 0 alone). Each rank keeps, per layer and candidate, the sum of its
errors and how many steps it measured; one allreduce adds every rank's
(:func:`combine`), so every rank solves the same problem from the mean over all
measured steps.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from cgx.policy.levels.candidates import Candidate, Family
from cgx.quant import wire
from cgx.compression.base import stable_tensor_id
from cgx.compression.powersgd import PowerSGDCompressor
from cgx.quant.codec import QuantSpec, quantize
from cgx.config import Rounding

SAMPLES = 4  # steps of a window whose errors are measured (spread evenly over it)
SCORE_SEED = 0x5C0E  # stochastic rounding noise of the measurements (not the exchange's)
SAMPLE_VALUES = 1 << 20  # a larger layer's errors are estimated from this many of its values
CAST_CHUNK = 4096  # the chunk of a sample for the casts alone (no quantization candidate)
UNIFORM_SHARE = 0.2  # of a sample's draws spread evenly (the rest by the chunks' mass)


def sample_turn(offset: int, window: int) -> Optional[int]:
    """Which of the window's measured steps the step ``offset`` steps into a window of
    ``window`` steps is (0, 1, ...), or None when it is not measured (every
    ``ceil(window / SAMPLES)``-th step from the first; 10 steps: 0, 3, 6, 9)."""
    every = max(1, math.ceil(window / SAMPLES))
    return offset // every if offset % every == 0 else None


def sampled(offset: int, window: int) -> bool:
    """Whether the step ``offset`` steps into a window of ``window`` steps is measured."""
    return sample_turn(offset, window) is not None


def measuring_ranks(work: Sequence[int], world: int) -> list[int]:
    """Per layer (``work``: the values its measurement reads, a large layer's sample;
    0: not measured), the rank that measures it at a window's first sampled step: the
    largest first, each to the rank with the least work so far (ties: the lower rank,
    the earlier layer), so every rank of a collective derives the same deal."""
    load = [0] * max(1, world)
    out = [0] * len(work)
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + work[i]
    return out


def _generator(key: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(key) & 0x7FFF_FFFF_FFFF_FFFF)


def bucket_sample(x: torch.Tensor, chunk: int, key: int,
                  limit: int = SAMPLE_VALUES) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A sample of ``x`` (flat) in whole chunks of ``chunk`` values, and per chunk of the
    sample the weight that makes the sum of their weighted squared errors an unbiased
    estimate of all of ``x``'s (float64, on the CPU; None: the sample is ``x`` itself).

    Chunk ``i`` is drawn with probability ``p_i = (1 - UNIFORM_SHARE) * mass_i / total +
    UNIFORM_SHARE / chunks`` (``mass``: its sum of squares): ``limit // chunk`` points
    spaced evenly over the cumulative ``p``, shifted by an offset drawn from ``key``
    (systematic sampling); a chunk hit ``h`` times weighs ``h / expected hits``. The
    uniform share keeps every chunk's weight bounded where the error is not in proportion
    to the mass (an fp16 cast of values below its normal range errs by about its fixed
    step whatever their size). ``chunk`` is a multiple of every bucket size measured, so
    each bucket of the sample is a bucket of ``x``; the values after the last whole chunk
    count in proportion. ``x`` itself when it is no larger than ``limit`` or too few
    chunks would fit."""
    n = x.numel()
    count = limit // max(1, chunk)
    whole = n // max(1, chunk)
    if n <= limit or count < 16 or whole <= count:
        return x, None
    rows = x[:whole * chunk].view(whole, chunk)
    wide = torch.float64 if rows.dtype == torch.float64 else torch.float32
    mass = torch.linalg.vector_norm(rows, dim=1, dtype=wide).cpu().double().square()
    total = float(mass.sum())
    p = torch.full((whole,), 1.0 / whole, dtype=torch.float64)
    if total > 0 and math.isfinite(total):
        p = (1 - UNIFORM_SHARE) * mass / total + UNIFORM_SHARE * p
    cum = p.cumsum(0)
    offset = float(torch.rand((), generator=_generator(key), dtype=torch.float64))
    points = ((torch.arange(count, dtype=torch.float64) + offset) / count).clamp_(
        max=float(cum[-1]) * (1 - 1e-12))
    hits = torch.bincount(torch.searchsorted(cum, points, right=True).clamp_(max=whole - 1),
                          minlength=whole)
    picked = torch.nonzero(hits).reshape(-1)
    weights = hits[picked].double() / (count * p[picked]) * (n / (whole * chunk))
    return rows[picked.to(x.device)].reshape(-1), weights


def value_sample(x: torch.Tensor, key: int,
                 limit: int = SAMPLE_VALUES) -> tuple[torch.Tensor, float]:
    """``limit`` values of ``x`` (flat) drawn at random with replacement (from ``key``),
    and the factor that scales a sum of squares over them to all of ``x``; ``x``
    itself (factor 1) when it is no larger than ``limit``."""
    n = x.numel()
    if n <= limit:
        return x, 1.0
    idx = torch.randint(0, n, (limit,), generator=_generator(key ^ 0x5A5A))
    return x[idx.to(x.device)], n / limit


def quantization_error(x: torch.Tensor, spec: QuantSpec, threads: int = 1,
                       key: int = 0, weights: Optional[torch.Tensor] = None) -> float:
    """``||Q(x) - x||`` with the real quantizer (hidden cost: one quantize pass of a copy);
    ``key``: the stochastic-rounding key (``wire.noise_key``); ``weights``: ``x`` is a
    :func:`bucket_sample` in ``len(weights)`` equal chunks, each squared error weighted."""
    x = x.detach().reshape(-1).to(torch.float32).contiguous()
    if x.numel() == 0:
        return 0.0
    y = x.clone()
    quantize(y, spec, write_back=True, threads=threads, key=key)
    return _norm(y - x, weights)


def _norm(d: torch.Tensor, weights: Optional[torch.Tensor]) -> float:
    """``||d||``, or with a :func:`bucket_sample`'s ``weights``, the estimate of the layer's
    from the sample's chunks (each chunk's squared norm weighted)."""
    if weights is None:
        return float(torch.linalg.vector_norm(d))
    per_chunk = d.view(len(weights), -1).square().sum(1, dtype=torch.float64)
    return float((per_chunk.cpu() * weights).sum()) ** 0.5


CAST_DTYPES = {Family.FP16: torch.float16, Family.BF16: torch.bfloat16}


def cast_error(x: torch.Tensor, family: Family,
               weights: Optional[torch.Tensor] = None) -> float:
    """``||cast(x) - x||`` for a 16-bit cast family (infinite when a value overflows it);
    ``weights``: ``x`` is a :func:`bucket_sample`, as in :func:`quantization_error`.

    The gradient itself is cast: the exchange divides by the world size first
    (``Compression.fp16``'s predivide), which moves only values near either end of the
    range (exactly none for a power-of-two world)."""
    v = x.detach().reshape(-1).float()
    err = _norm(v.to(CAST_DTYPES[family]).float() - v, weights)
    return err if math.isfinite(err) else math.inf


def _overflows(peak: torch.Tensor, family: Family) -> bool:
    """Whether a tensor whose largest magnitude is ``peak`` has a value beyond the cast's
    range (the cast is monotone: the largest magnitude decides)."""
    return not bool(torch.isfinite(peak.to(CAST_DTYPES[family])))


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
    with an (., r_max) one; the errors come from the factors' (r, r) Gram matrices
    (:func:`lowrank_errors`).
    """

    def __init__(self):
        self.compressor = PowerSGDCompressor(min_compression_rate=0.0, error_feedback=False)

    def step(self, name: str, grad: torch.Tensor, shape: Sequence[int], ranks: Sequence[int],
             measure: bool) -> Optional[list[float]]:
        """One power iteration on ``grad`` (advancing the warm start); with ``measure``,
        ``||P_r Q_r^T - grad||`` for each of ``ranks``."""
        M = grad.detach().reshape(int(shape[0]), -1).float()
        self.compressor.ranks[name] = max(ranks)
        factors = self.compressor.factors(M, name)
        if not measure:
            return None
        if factors is None:  # not compressed (cannot happen for a candidate): sent whole
            return [0.0 for _ in ranks]
        return lowrank_errors(M, *factors, ranks)

    def state_dict(self) -> dict:
        return self.compressor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.compressor.load_state_dict(state)


def lowrank_errors(M: torch.Tensor, P: torch.Tensor, Q: torch.Tensor,
                   ranks: Sequence[int]) -> list[float]:
    """``||M - P_r Q_r^T||`` for each r (the leading r columns), where ``Q = M^T P``:
    ``||M||^2 - 2 tr(Q_r^T Q_r) + <P_r^T P_r, Q_r^T Q_r>``, exact whether or not P's
    columns are orthonormal, and no (n, m) product formed."""
    total = float(torch.linalg.vector_norm(M, dtype=torch.float64)) ** 2
    P, Q = P.double(), Q.double()
    G, H = P.T @ P, Q.T @ Q
    out = []
    for r in ranks:
        h = H[:r, :r]
        out.append(max(0.0, total - 2 * float(h.trace()) + float((G[:r, :r] * h).sum())) ** 0.5)
    return out


def candidate_errors(grad: torch.Tensor, candidates: Sequence[Candidate], *,
                     rounding: Rounding = Rounding.NEAREST, key: int = 0, threads: int = 1,
                     lowrank: Optional[list] = None,
                     sample_values: int = SAMPLE_VALUES) -> list[float]:
    """``||C(grad) - grad||`` for each candidate, PowerSGD's from ``lowrank`` (the errors
    :meth:`PowerSGDScorer.step` measured, in the order of the PowerSGD candidates); a
    layer larger than ``sample_values`` is measured on samples drawn from ``key``."""
    out = [0.0] * len(candidates)
    flat = grad.detach().reshape(-1)
    topk = [i for i, c in enumerate(candidates) if c.family is Family.TOPK]
    if topk:
        from cgx.compression.topk import TopKCompressor
        values, scale = value_sample(flat, key, sample_values)
        ks = [TopKCompressor(candidates[i].density).num_selected(flat.numel()) for i in topk]
        errs = topk_errors(values, [min(values.numel(), round(k / scale)) for k in ks])
        for i, k, e in zip(topk, ks, errs):
            out[i] = 0.0 if k >= flat.numel() else e * scale ** 0.5
    low = [i for i, c in enumerate(candidates) if c.family is Family.POWERSGD]
    if low:
        if lowrank is None or len(lowrank) != len(low):
            raise ValueError(f"{len(low)} PowerSGD candidates need as many measured errors, "
                             f"got {lowrank!r}")
        for i, e in zip(low, lowrank):
            out[i] = e
    own = [i for i, c in enumerate(candidates) if c.custom]
    if own:  # registered families: each level's own round trip, on one sample of the values
        values, scale = value_sample(flat, key, sample_values)
        v = values.float()
        for i in own:
            comp = candidates[i].compressor()
            payload, ctx = comp.compress(v.clone())
            err = float(torch.linalg.vector_norm(
                comp.decompress(payload, ctx).float().reshape(-1) - v))
            out[i] = err * scale ** 0.5 if math.isfinite(err) else math.inf
    quant = [i for i, c in enumerate(candidates) if c.family is Family.QUANTIZE]
    casts = [i for i, c in enumerate(candidates) if c.family in CAST_DTYPES]
    if not (quant or casts):
        return out
    # every level and cast on the same whole buckets of one sample
    chunk = math.lcm(*(candidates[i].bucket_size for i in quant)) if quant else CAST_CHUNK
    sample, weights = bucket_sample(flat, chunk, key, sample_values)
    for i in quant:
        c = candidates[i]
        out[i] = quantization_error(sample, QuantSpec(c.bits, c.bucket_size, rounding),
                                    threads, key, weights)
    peak = flat.abs().amax() if casts and weights is not None else None  # one pass for all
    for i in casts:
        fam = candidates[i].family
        out[i] = math.inf if peak is not None and _overflows(peak, fam) else \
            cast_error(sample, fam, weights)
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
