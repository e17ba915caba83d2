"""Straightforward references for the compressor tests (readable, slow, float64)."""

from __future__ import annotations

import zlib

import torch

from cgx.compression.powersgd import initial_q


def make_input(case: str, rank: int, shape, dtype=torch.float32, scale: float = 1.0):
    """Deterministic per-(case, rank) input, so the parent can recompute every rank's tensor."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    return (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) * scale).to(dtype)


def topk_dense(x: torch.Tensor, k: int) -> torch.Tensor:
    """Zeros except the k largest |x|, via torch.topk and a dense scatter."""
    flat = x.reshape(-1)
    out = torch.zeros_like(flat)
    idx = torch.topk(flat.abs().double(), k).indices
    out[idx] = flat[idx]
    return out.view(x.shape)


def powersgd_reference(steps, rank: int, seed: int = 0, name=None, error_feedback: bool = True,
                       warm_start: bool = True):
    """PowerSGD over W simulated ranks, written out with QR (float64).

    Args:
        steps: list over steps of lists over ranks of 2-D tensors (n, m).

    Returns:
        (outputs per step (the mean approximation), final residuals per rank).
    """
    world = len(steps[0])
    n, m = steps[0][0].shape
    r = min(rank, n, m)
    residuals = [torch.zeros(n, m, dtype=torch.float64) for _ in range(world)]
    q, draws, outputs = None, 0, []
    for inputs in steps:
        Ms = [x.double() + (res if error_feedback else 0) for x, res in zip(inputs, residuals)]
        if q is None or not warm_start:
            q = initial_q(seed, name, draws, m, r, torch.float64)
            draws += 1
        q = torch.linalg.qr(q).Q
        P = torch.linalg.qr(sum(M @ q for M in Ms)).Q
        q = sum(M.T @ P for M in Ms) / world
        out = P @ q.T
        outputs.append(out)
        residuals = [M - out for M in Ms]
    return outputs, residuals
