"""Which compensation suits a layer, measured: the optimizer's update followed on a sample of
the layer's values, once with the true gradients and once per compensation.

Whether feeding quantization errors back helps depends on the optimizer and on the layer
(:mod:`cgx.policy.update_rule`): SGD's update is linear in the gradients, so classic
error feedback, whose sent errors telescope, keeps its trajectory closest; Adam divides by
a running root mean square, so the doubled error power of classic feedback shrinks every
step (a bias that accumulates), and whether a moving average (or nothing) is better
depends on how large the quantization error is against the layer's gradient and how much
of it is systematic. Rather than assume, auto measures it during its window:

For each layer it plans, one rank (the layers dealt out as the error measurements are,
:func:`cgx.policy.levels.stats.measuring_ranks`) follows a fixed sample of the layer's values
(up to :data:`PROBE_VALUES`, whole quantization buckets spread evenly over the layer)
through every step of the window. At each step the sample of the gradient ``g`` is
quantized at the layer's level in force three ways, one per :class:`Compensation`,
each with its own residual (classic: ``e = q``; moving average: ``e = beta e + (1-beta) q``,
added clipped to the bucket's range, as :mod:`cgx.exchange.compensation` does), all
with the same rounding noise. Each of the three sent sequences, and the true one, goes
through a shadow of the optimizer's update (:class:`ShadowUpdate`: Adam's bias-corrected
moments with beta 0.9/0.999, or SGD's momentum 0.9), and the probe follows the paths the
parameters would take, the true ``U_t`` and the sent ``S_t`` (sums of the updates so far).
Two numbers per compensation (:func:`measures`): the *shortfall* ``|1 - rho|``, where
``rho`` is the share of the true path the sent one covers (its projection), and the
*noise*, what the sent path adds across the true one, both relative to the true path's
length. Under Adam an inflated second moment shrinks every step, and that shortfall is
lost for good, while noise averages out over the steps: so progress decides first and
noise second (:func:`choose`). On the project's LM at 2 bits the probe finds classic
feedback's shortfall 0.04-0.10 of the path larger than none's under AdamW on every layer
(in training it ends 5% higher), and under SGD classic feedback's shortfall the smallest
and its noise 7-9% of none's (in training it ends lowest; docs/results/adaptive-probe-2bit.md,
adaptive-probe-2bit-sgd.md, adaptive.md). The per-layer sums are added over ranks with one
allreduce at the re-plan (:func:`cgx.policy.levels.stats.combine`), so every rank takes the
same decision.

The sample is the rank's own gradient (before the average), quantized once: the exchange
quantizes the predivided gradient and then the reduced chunk, so the probe ranks the
compensations on a comparable error, not the same one. The shadow uses the named
optimizer family's default betas, not the run's.

A checkpoint keeps the decisions (``AdaptiveSchedule.state_dict``), not a window's probes:
resumed inside a window, the next decision rests on the window's steps after the resume.

Hidden cost: at each window step, for each probed layer on its rank, three quantize
passes and about 30 elementwise passes over at most :data:`PROBE_VALUES` values.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from cgx.policy.update_rule import Compensation, UpdateRule, average_in, bucket_clamp

PROBE_VALUES = 1 << 13  # values of a layer the probe follows (whole buckets)
SHORTFALL_TIE = 0.005  # shortfalls this close (a share of the path) are a tie
NOISE_TIE = 0.02  # a residual must cut none's noise by more than this share
ADAM = (0.9, 0.999, 1e-8)  # the shadow's betas and epsilon for adaptive optimizers
MOMENTUM = 0.9  # the shadow's momentum for linear ones
VARIANTS = (Compensation.NONE, Compensation.ERROR_FEEDBACK, Compensation.MOVING_AVERAGE)


def sample_index(numel: int, bucket: int,
                 limit: int = PROBE_VALUES) -> Optional[torch.Tensor]:
    """The values of a layer of ``numel`` the probe follows: whole buckets of ``bucket``
    values spread evenly over the layer (``limit // bucket`` of them, at least one), as
    one index tensor; None: the whole layer (it is no larger than ``limit``)."""
    if numel <= limit:
        return None
    whole = numel // bucket
    count = max(1, min(whole, limit // bucket))
    starts = torch.arange(count, dtype=torch.int64) * whole // count * bucket
    return (starts[:, None] + torch.arange(bucket, dtype=torch.int64)).reshape(-1)


class ShadowUpdate:
    """The optimizer's update direction, followed on a sample: Adam's bias-corrected
    ``m / (sqrt(v) + eps)`` (``adaptive``), or SGD's momentum buffer."""

    def __init__(self, numel: int, adaptive: bool):
        self.m = torch.zeros(numel, dtype=torch.float32)
        self.v = torch.zeros(numel, dtype=torch.float32) if adaptive else None
        self.t = 0

    def update(self, g: torch.Tensor) -> torch.Tensor:
        """The update for gradient ``g`` (a new tensor)."""
        self.t += 1
        if self.v is None:
            return self.m.mul_(MOMENTUM).add_(g).clone()
        b1, b2, eps = ADAM
        self.m.mul_(b1).add_(g, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        m_hat = self.m / (1 - b1 ** self.t)
        return m_hat.div_((self.v / (1 - b2 ** self.t)).sqrt_().add_(eps))


class LayerProbe:
    """One layer's shadow paths over a window (see the module docstring).

    Args:
        numel: the layer's values.
        spec: the ``QuantSpec`` of its level in force.
        rule: the optimizer's :class:`UpdateRule` (ADAPTIVE: Adam's shadow; else momentum).
        beta: the moving average's weight (``cgx.exchange.compensation.MovingAverage``).
    """

    def __init__(self, numel: int, spec, rule: UpdateRule, beta: float):
        self.spec, self.beta = spec, float(beta)
        self.index = sample_index(numel, spec.bucket_size)
        n = numel if self.index is None else self.index.numel()
        adaptive = rule is UpdateRule.ADAPTIVE
        self.true = ShadowUpdate(n, adaptive)
        self.shadows = {v: ShadowUpdate(n, adaptive) for v in VARIANTS}
        self.held = {v: torch.zeros(n, dtype=torch.float32) for v in VARIANTS
                     if v is not Compensation.NONE}  # the residuals
        self.path = torch.zeros(n, dtype=torch.float32)  # U_t
        self.paths = {v: torch.zeros(n, dtype=torch.float32) for v in VARIANTS}  # S_t
        self.sums = [0.0] * (1 + 2 * len(VARIANTS))  # see :meth:`sums_now`

    def step(self, g: torch.Tensor, key: int) -> None:
        """One window step with the layer's gradient ``g`` (any shape, finite)."""
        x = g.detach().reshape(-1)
        if self.index is not None and self.index.device != x.device:
            self.index = self.index.to(x.device)  # a CUDA gradient: gathered on its device
        x = (x if self.index is None else x[self.index]).to("cpu", torch.float32, copy=True)
        self.path.add_(self.true.update(x))
        self.sums[0] += float(self.path.square().sum())
        for k, v in enumerate(VARIANTS):
            s = self.paths[v].add_(self.shadows[v].update(self._send(v, x, key)))
            self.sums[1 + 2 * k] += float(s.dot(self.path))
            self.sums[2 + 2 * k] += float(s.square().sum())

    def _send(self, v: Compensation, x: torch.Tensor, key: int) -> torch.Tensor:
        """What the exchange sends for ``x`` under compensation ``v``; updates its residual."""
        from cgx.quant.codec import quantize
        if v is Compensation.NONE:
            y = x.clone()
            quantize(y, self.spec, write_back=True, threads=1, key=key)
            return y
        e = self.held[v]
        y = x + (e if v is Compensation.ERROR_FEEDBACK else
                 bucket_clamp(e, x, self.spec.bucket_size))
        before = y.clone()
        quantize(y, self.spec, write_back=True, threads=1, key=key)
        if v is Compensation.ERROR_FEEDBACK:
            torch.sub(before, y, out=e)
        else:
            self.held[v] = average_in(e, before - y, self.beta)
        return y

    def sums_now(self) -> list[float]:
        """``[sum_t ||U_t||^2]`` then per :data:`VARIANTS` ``sum_t <S_t, U_t>`` and
        ``sum_t ||S_t||^2``: what :func:`measures` reads, summable over windows and ranks
        (zeros when a value is not finite)."""
        return list(self.sums) if all(math.isfinite(v) for v in self.sums) else \
            [0.0] * len(self.sums)


def measures(sums: Sequence[float]) -> Optional[list[tuple[float, float]]]:
    """Per :data:`VARIANTS`, ``(shortfall, noise)`` from :meth:`LayerProbe.sums_now`:
    ``|1 - rho|`` with ``rho = sum <S,U> / sum ||U||^2`` the share of the true path the
    sent one covers, and ``sum ||S - rho U||^2 / sum ||U||^2`` what it adds across it;
    None when the layer did not move."""
    path = sums[0]
    if not path > 0:
        return None
    out = []
    for k in range(len(VARIANTS)):
        rho = sums[1 + 2 * k] / path
        out.append((abs(1.0 - rho), max(0.0, sums[2 + 2 * k] / path - rho * rho)))
    return out


def options_for(explicit: Optional[bool], fixed: Optional[Compensation]) -> tuple:
    """The compensations auto measures between for its quantized layers: none with
    ``explicit`` False; with True, the ones that keep a residual (``fixed``, the form
    ``CGX_COMPENSATION`` names, alone); with None, none too."""
    if explicit is False:
        return (Compensation.NONE,)
    kept = (fixed,) if fixed is not None else (Compensation.MOVING_AVERAGE,
                                               Compensation.ERROR_FEEDBACK)
    return kept if explicit else (Compensation.NONE, *kept)


def choose(measured: Sequence[tuple[float, float]],
           options: Sequence[Compensation]) -> Compensation:
    """The compensation of a layer from its :func:`measures` (per :data:`VARIANTS`):
    progress first, then noise. The options whose shortfall is within
    :data:`SHORTFALL_TIE` of the smallest are kept (a step shrunk by an inflated second
    moment is lost for good, noise averages out over the steps), and of those the least
    noisy is chosen; one that keeps a residual must be less noisy than none, when none is
    kept, by more than the share :data:`NOISE_TIE` (none costs no memory and no passes)."""
    m = dict(zip(VARIANTS, measured))
    least = min(m[v][0] for v in options)
    near = [v for v in options if m[v][0] <= least + SHORTFALL_TIE]
    best = min(near, key=lambda v: (m[v][1], VARIANTS.index(v)))
    if Compensation.NONE in near and m[best][1] > (1 - NOISE_TIE) * m[Compensation.NONE][1]:
        return Compensation.NONE
    return best
