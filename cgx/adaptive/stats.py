"""Per-layer error of each candidate, measured on accumulated gradients, combined over ranks.

For a layer's gradient ``G`` summed over the window (error-feedback-corrected
where error feedback is on: what the compressor would actually see), the error
of a candidate is the unsquared Frobenius norm ``||C(G) - G||``, as in L-GreCo;
quantization candidates run the real quantizer (nearest rounding: its error
is deterministic). Each rank measures its own table (layers x candidates);
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


def candidate_errors(grad: torch.Tensor, candidates: Sequence[Candidate],
                     threads: int = 1) -> list[float]:
    """``||C(grad) - grad||`` for each candidate (one quantize pass each)."""
    return [0.0 if c.family is Family.EXACT else
            quantization_error(grad, QuantSpec(c.bits, c.bucket_size, Rounding.NEAREST), threads)
            for c in candidates]


def error_table(grads: Sequence[torch.Tensor], candidates: Sequence[Sequence[Candidate]],
                threads: int = 1) -> list[list[float]]:
    """Per layer, per candidate: this rank's errors."""
    return [candidate_errors(g, cands, threads) for g, cands in zip(grads, candidates)]


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
