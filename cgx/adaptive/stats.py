"""Per-layer error of each candidate, measured on accumulated gradients, combined over ranks.

For a layer's gradient ``G`` summed over the window, the error
of a candidate is the unsquared Frobenius norm ``||C(G) - G||``, as in L-GreCo:

- quantization runs the real quantizer (nearest rounding: deterministic);
- top-k: the norm of what the k largest magnitudes leave, from one sort of
  the squared values (every density at once);
- PowerSGD: the tail of the singular values beyond rank r,
  ``sqrt(||G||^2 - s_1^2 - ... - s_r^2)``, with the leading singular values from
  a few subspace iterations started from a fixed seed (the same numbers on
  every run; they underestimate the singular values slightly, so the error is
  if anything overstated).

``G`` is the sum of the gradients themselves, without error-feedback
residuals. Over a window the residuals telescope (what is sent sums to the
gradients plus the residual at the start minus the one at the end), and a
residual depends on the plan in force: a layer planned at rank 1 carries a
large one, which would inflate its errors and the uniform default's, so an
aggressive plan would raise its own budget (seen on the digits MLP: the budget
tripled within one re-plan). Measured on the gradients, the budget follows the
training, not the plan.

Each rank measures its own table (layers x candidates);
one allreduce averages the tables, so every rank solves the same problem and
derives the same plan, and no rank's gradients are ignored (L-GreCo's public
code looks at rank 0 alone).
"""

from __future__ import annotations

from typing import Sequence

import torch

from cgx.adaptive.candidates import Candidate, Family
from cgx.compression.quantization import QuantSpec, quantize
from cgx.config import Rounding


def quantization_error(x: torch.Tensor, spec: QuantSpec, threads: int = 1) -> float:
    """``||Q(x) - x||`` with the real quantizer (hidden cost: one quantize pass of a copy)."""
    x = x.detach().reshape(-1).to(torch.float32).contiguous()
    if x.numel() == 0:
        return 0.0
    y = x.clone()
    quantize(y, spec, write_back=True, threads=threads)
    return float(torch.linalg.vector_norm(y - x))


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


SUBSPACE_ITERATIONS = 2
SUBSPACE_SEED = 1234


def lowrank_errors(x: torch.Tensor, shape: Sequence[int], ranks: Sequence[int]) -> list[float]:
    """``||X - X_r||`` (best rank-r approximation) for each r, X the (n, m) matrix view.

    Hidden cost: ``2 * SUBSPACE_ITERATIONS + 1`` products of X with an (m, q)
    matrix, q = max(ranks) + 4 (float32; about a second for a 25088 x 4096 layer on
    one CPU core), once per plan.
    """
    n = int(shape[0])
    X = x.detach().reshape(n, -1).float()
    m = X.shape[1]
    total = float(X.square().sum(dtype=torch.float64))
    q = min(max(ranks) + 4, n, m)
    gen = torch.Generator().manual_seed(SUBSPACE_SEED)
    Q = torch.linalg.qr(X @ torch.randn(m, q, generator=gen)).Q
    for _ in range(SUBSPACE_ITERATIONS):
        Q = torch.linalg.qr(X @ torch.linalg.qr(X.T @ Q).Q).Q
    s2 = torch.linalg.svdvals((Q.T @ X).double()).square()
    head = torch.cumsum(s2, 0)
    return [max(0.0, total - float(head[min(r, q) - 1])) ** 0.5 for r in ranks]


def candidate_errors(grad: torch.Tensor, candidates: Sequence[Candidate],
                     threads: int = 1, shape: Sequence[int] = None) -> list[float]:
    """``||C(grad) - grad||`` for each candidate (``shape``: the layer's, for PowerSGD)."""
    out = [0.0] * len(candidates)
    topk = [i for i, c in enumerate(candidates) if c.family is Family.TOPK]
    if topk:
        from cgx.compression.topk import TopKCompressor
        ks = [TopKCompressor(candidates[i].density).num_selected(grad.numel()) for i in topk]
        for i, e in zip(topk, topk_errors(grad, ks)):
            out[i] = e
    low = [i for i, c in enumerate(candidates) if c.family is Family.POWERSGD]
    if low:
        errs = lowrank_errors(grad, shape if shape is not None else grad.shape,
                              [candidates[i].rank for i in low])
        for i, e in zip(low, errs):
            out[i] = e
    for i, c in enumerate(candidates):
        if c.family is Family.QUANTIZE:
            out[i] = quantization_error(grad, QuantSpec(c.bits, c.bucket_size,
                                                        Rounding.NEAREST), threads)
    return out


def error_table(grads: Sequence[torch.Tensor], candidates: Sequence[Sequence[Candidate]],
                threads: int = 1, shapes: Sequence[Sequence[int]] = None) -> list[list[float]]:
    """Per layer, per candidate: this rank's errors."""
    shapes = shapes if shapes is not None else [g.shape for g in grads]
    return [candidate_errors(g, cands, threads, s)
            for g, cands, s in zip(grads, candidates, shapes)]


def combine(table: list[list[float]], transport) -> list[list[float]]:
    """The mean of every rank's table (one float64 allreduce); identical on every rank."""
    from cgx.comm.base import ReduceOp
    lens = [len(row) for row in table]
    flat = torch.tensor([v for row in table for v in row], dtype=torch.float64,
                        device=transport.device)
    if transport.size > 1 and flat.numel():
        transport.allreduce(flat, ReduceOp.SUM)
        flat /= transport.size
    vals = flat.cpu().tolist()
    out, k = [], 0
    for n in lens:
        out.append(vals[k:k + n])
        k += n
    return out
