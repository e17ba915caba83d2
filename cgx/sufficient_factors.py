"""Sufficient-factor exchange for fully connected layers: send the factors, rebuild exactly.

Reference: H. Zhang, Z. Zheng, S. Xu, W. Dai, Q. Ho, X. Liang, Z. Hu, J. Wei, P. Xie,
E. P. Xing, "Poseidon: An Efficient Communication Architecture for Distributed Deep
Learning on GPU Clusters", USENIX ATC 2017.

A linear layer ``y = x W^T + b`` with ``W`` of shape M x N sees, in a batch of
K rows, the weight gradient ``G = dy^T x``: a sum of K outer products. When
``K x P x (M + N) < M x N`` (P ranks), all-gathering every rank's factors
``(x, dy)`` moves fewer bytes than reducing G, and every rank rebuilds the
exact averaged gradient ``(1/P) sum_r dy_r^T x_r`` (the same arithmetic on the
same gathered data: bit-identical on every rank).

The torch adapter records the factors (``cgx.torch.factor_capture``); this module
decides and exchanges. The factors are a faithful record only if each backward pass saw exactly one
forward call of the layer; otherwise (a layer used twice, a forward without a
backward) the layer falls back to the plain reduction for that step. The
choice is agreed by every rank with one small MAX allreduce per step (K and
the faithfulness flag per layer), because the ranks must issue the same
collectives.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cgx.comm.base import ReduceOp


@dataclasses.dataclass
class Capture:
    """What one linear layer recorded since the last exchange.

    Attributes:
        name: the weight's name.
        inputs, grads: per backward pass, the layer input (K x N) and the gradient of
            its output (K x M), both float32 and detached.
        forwards: forward calls recorded (training, with gradients enabled).
    """

    name: str
    module: torch.nn.Linear
    inputs: list = dataclasses.field(default_factory=list)
    grads: list = dataclasses.field(default_factory=list)
    forwards: int = 0

    def clear(self) -> None:
        self.inputs.clear()
        self.grads.clear()
        self.forwards = 0

    def rows(self) -> int:
        return sum(x.shape[0] for x in self.inputs)

    def faithful(self, passes: int) -> bool:
        """One forward per backward pass, each matched by its output gradient."""
        return self.forwards == len(self.inputs) == len(self.grads) == passes


def worth_it(rows: int, ranks: int, out_features: int, in_features: int) -> bool:
    """Poseidon's rule: factors (``K x P x (M + N)`` values) beat the M x N gradient."""
    return rows * ranks * (out_features + in_features) < out_features * in_features


def exchange(captures: list, weights: list, transport, passes: int, average: bool,
             plain, record=None, choose=None) -> list:
    """Engine thread, every rank at the same point: rebuild or reduce each layer's weight grad.

    Args:
        captures: the :class:`Capture` of each layer, in a fixed order.
        weights: their weight parameters (``p.grad`` is overwritten with the result).
        transport: the world transport.
        passes: backward passes per step (the optimizer's ``backward_passes_per_step``).
        average: divide by the number of ranks.
        plain: ``plain(weights)`` reduces those weights' gradients the ordinary way (fallback).
        record: ``record(ReduceStats)`` adds the bytes this rank sent to cgx's statistics.
        choose: ``choose(name, rows, ranks, out_features, in_features)`` -> send this layer
            as factors? (default: Poseidon's rule, :func:`worth_it`); it must decide the same
            on every rank (the planned exchange's plan does).

    Returns:
        Per layer, True when its gradient travelled as factors.
    """
    from cgx.collectives.functional import allgather_rows
    P = transport.size
    local = torch.tensor([[c.rows(), 0 if c.faithful(passes) else 1] for c in captures],
                         dtype=torch.int64, device=transport.device).view(-1)
    if P > 1 and local.numel():
        transport.allreduce(local, ReduceOp.MAX)  # the same decision on every rank
    agreed = local.view(-1, 2).tolist()
    used, fallback = [], []
    for (rows, unfaithful), cap, w in zip(agreed, captures, weights):
        m, n = w.shape
        if not unfaithful and rows > 0 and (choose(cap.name, rows, P, m, n) if choose
                                            else worth_it(rows, P, m, n)):
            x = torch.cat(cap.inputs) if cap.inputs else torch.zeros(0, n)
            g = torch.cat(cap.grads) if cap.grads else torch.zeros(0, m)
            xs = allgather_rows(x.contiguous(), f"sfb.{cap.name}.inputs")
            gs = allgather_rows(g.contiguous(), f"sfb.{cap.name}.grads")
            grad = gs.t().mm(xs)
            if average:
                grad.div_(P)
            if record is not None:
                from cgx.collectives.reducer import ReduceStats
                sent = (P - 1) * 4 * rows * (m + n)  # this rank's padded rows, to P-1 ranks
                record(ReduceStats(calls=1, numel=m * n, input_bytes=4 * m * n,
                                   wire_bytes=sent, seconds={
                                       "_fp32_wire": float(2 * (P - 1) * 4 * m * n // P)}))
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            w.grad.copy_(grad.to(w.grad.dtype))
            used.append(True)
        else:
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            fallback.append(w)
            used.append(False)
    if fallback:
        plain(fallback)
    return used


def factor_bytes(rows: int, ranks: int, out_features: int, in_features: int) -> int:
    """Bytes one rank receives in the factor allgather (float32)."""
    return 4 * rows * ranks * (out_features + in_features)


def gradient_bytes(out_features: int, in_features: int, spec: Optional[object] = None) -> int:
    """Bytes of the gradient itself, compressed by ``spec`` (a QuantSpec) or float32."""
    numel = out_features * in_features
    return spec.nbytes(numel) if spec is not None else 4 * numel
