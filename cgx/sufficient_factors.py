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

The layer's bias, when it trains, travels with the weight: its gradient is the sum
of the output gradients' rows, rebuilt from the same gathered factors.

The torch adapter records the factors with hooks (``cgx.torch.factor_capture``); the
Keras adapter routes its ``Dense`` layers' products through a custom gradient that
exchanges them (``cgx.tensorflow.keras.sufficient_factors``); this module decides and
exchanges for both.

The rebuild replaces the layer's gradient, so the factors may go only when their
product is the parameters' whole gradient on every rank. A rank's factors are
*faithful* when each backward pass of the step saw exactly one forward call of the
layer, recorded its input unchanged and its output gradient, and the weight (and the
bias that travels with it) received in that pass the layer's own contribution and
nothing else: no second use of the weight (tied or shared weights, ``F.linear`` on it
elsewhere, a custom autograd function), no gradient hook that changed it. The torch
adapter proves this exactly, by tensor identity and counts
(:mod:`cgx.torch.factor_capture`). Otherwise the layer falls back to the plain
reduction for that step. The choice is agreed by every rank with one small allgather
per layer and step (K and the faithfulness flag), because the ranks must issue the
same collectives: one unfaithful rank sends every rank down the plain path. Each
layer's exchange starts as soon as its weight gradient is ready, beside the rest of
backward.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class Capture:
    """What one linear layer recorded since the last exchange (filled by the adapter).

    Attributes:
        name: the weight's name.
        module: the layer.
        blocks: per backward pass, the layer's factors as one float32 block ``[dy | x]``
            (K x (M + N)): its output gradient and its input, copied as backward reached
            the layer.
        forwards: forward calls recorded (training, with gradients enabled).
        expected: contributions the layer's product sent to its parameters (one per
            forward and trainable parameter).
        sole: gradients its parameters received that were exactly such a contribution.
        foreign: gradients its parameters received that were not (another use of the
            parameter added to it, a hook replaced or edited it, the layer had no part).
    """

    name: str
    module: torch.nn.Linear
    blocks: list = dataclasses.field(default_factory=list)
    forwards: int = 0
    expected: int = 0
    sole: int = 0
    foreign: int = 0

    def clear(self) -> None:
        self.blocks.clear()
        self.forwards = self.expected = self.sole = self.foreign = 0

    def rows(self) -> int:
        return sum(b.shape[0] for b in self.blocks)

    def pairs(self, out_features: int) -> list:
        """Per backward pass, ``(dy, x)``: views of the block."""
        return [(b[:, :out_features], b[:, out_features:]) for b in self.blocks]

    def faithful(self, passes: int) -> bool:
        """One forward per backward pass, each with its factors, and every gradient the
        parameters received was the layer's own contribution, alone."""
        return (self.forwards == len(self.blocks) == passes and self.foreign == 0
                and self.sole == self.expected)


def worth_it(rows: int, ranks: int, out_features: int, in_features: int) -> bool:
    """Poseidon's rule: factors (``K x P x (M + N)`` values) beat the M x N gradient."""
    return rows * ranks * (out_features + in_features) < out_features * in_features


def exchange_layer(cap: Capture, weight: torch.Tensor, transport, passes: int, average: bool,
                   plain, record=None, choose=None, shadow: bool = False,
                   bias: Optional[torch.Tensor] = None) -> bool:
    """Engine thread, every rank at the same point: rebuild or reduce one layer's weight grad.

    Launched as soon as the weight's gradient is ready, so the exchange overlaps the rest
    of backward (Poseidon's wait-free backpropagation); the optimizer launches these in
    its fixed bucket order, so every rank issues the same collectives. Two collectives:
    a tiny allgather of every rank's (rows, faithful) - the decision, the same on every
    rank - and one allgather of the factors ``[dy | x]`` (K x (M + N) float32 per rank,
    padded to the largest K).

    Args:
        cap: the layer's :class:`Capture`.
        weight: its weight parameter (``weight.grad`` is overwritten with the result).
        bias: its bias, when it travels with the weight: rebuilt as the averaged sum of
            the gathered output gradients (``bias.grad`` overwritten); ``plain()`` then
            reduces it with the weight when the factors do not go.
        transport: the world transport.
        passes: backward passes per step (the optimizer's ``backward_passes_per_step``).
        average: divide by the number of ranks.
        plain: ``plain()`` reduces this weight's (and bias's) gradient the ordinary way.
        record: ``record(ReduceStats)`` counts the layer in cgx's statistics.
        choose: ``choose(name, rows, ranks, out_features, in_features)`` -> send this layer
            as factors? (default: Poseidon's rule, :func:`worth_it`); it must decide the same
            on every rank (the planned exchange's plan does).
        shadow: this rank takes part without a gradient of its own (``join()``, or a
            layer that got no gradient): it offers no factors, so the layer goes plain.

    Returns:
        True when the gradient travelled as factors.
    """
    dev = transport.device
    m, n = weight.shape
    factors = gathered(transport, cap.pairs(m), m, n, rows=0 if shadow else cap.rows(),
                       faithful=(not shadow) and cap.faithful(passes), average=average,
                       choose=(lambda k, P: choose(cap.name, k, P, m, n)) if choose else None,
                       record=record, bias=bias is not None,
                       block=cap.blocks[0] if len(cap.blocks) == 1 else None)
    if factors is None:
        plain()
        return False
    dy, x = factors
    # The product is written straight into the gradient: an M x N temporary would cost
    # three more passes over the largest tensor of the model (allocate, scale, copy).
    _write_grad(weight, lambda out: torch.mm(dy.t(), x, out=out), dev)
    if bias is not None:  # d loss / d bias = the sum of the output gradients' rows
        _write_grad(bias, lambda out: torch.sum(dy, 0, out=out), dev)
    return True


def gathered(transport, pairs, out_features: int, in_features: int, rows: int,
             faithful: bool, average: bool, choose=None, record=None,
             bias: bool = False, *, block: Optional[torch.Tensor] = None
             ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank, same point: agree on the layer, then all-gather its factors if they go.

    Args:
        pairs: this rank's (output gradient, input) per backward pass.
        rows: their total rows (0: this rank offers none); ``faithful``: they are a
            faithful record of the step.
        average: scale the gathered output gradients by 1/P.
        choose: ``choose(rows, ranks)`` -> send as factors? (default: :func:`worth_it`).
        record: ``record(ReduceStats)``, called when the factors go.
        bias: the layer's bias travels with it (for the statistics).
        block: optional, ``pairs`` stacked already as one float32 ``[dy | x]`` tensor;
            sent as it is when it needs no padding (see :func:`gather`).

    Returns:
        ``(dy, x)`` of every rank's rows, in rank order, ``dy`` scaled by 1/P when
        ``average``: the same arithmetic on the same rows gives a bit-identical rebuild on
        every rank. None: the layer goes the plain way (a rank offers no faithful factors,
        or they would not pay).
    """
    P = transport.size
    m, n = out_features, in_features
    counts, all_faithful = agree(transport, rows, faithful)
    k = max(counts)
    if not (all_faithful and k > 0 and (choose(k, P) if choose else worth_it(k, P, m, n))):
        return None
    dy, x = gather(transport, pairs, m, n, counts, block=block)
    if record is not None:
        record(factor_stats(P, m, n, bias))
    return (dy / P if average else dy), x


def gather_each(transport, mine: torch.Tensor) -> torch.Tensor:
    """Every rank's ``mine`` (same shape and dtype on every rank), stacked in rank order:
    one allgather of its bytes, the agreement every factor decision rests on."""
    mine = mine.to(transport.device).contiguous()
    if transport.size == 1:
        return mine.unsqueeze(0)
    every = torch.empty((transport.size,) + tuple(mine.shape), dtype=mine.dtype,
                        device=transport.device)
    transport.allgather(every.view(-1).view(torch.uint8), mine.view(-1).view(torch.uint8))
    return every


def agree(transport, rows: int, faithful: bool) -> tuple[list[int], bool]:
    """Every rank's row count, and whether every rank's factors are faithful: one 16-byte
    allgather, so that every rank takes the same decision (and issues the same
    collectives) for the layer."""
    pairs = gather_each(transport, torch.tensor([rows, int(faithful)],
                                                dtype=torch.int64)).tolist()
    return [r for r, _ in pairs], all(f for _, f in pairs)


def agree_scaled(transport, checks: torch.Tensor) -> list[bool]:
    """``checks``: this rank's ``[exact, c]`` per layer (``exact`` 1 where the layer's
    received gradient is exactly ``c`` times what its factors give). Per layer, True
    where every rank is exact with the same ``c``: one allgather for all the layers."""
    every = gather_each(transport, checks.to(torch.float64))
    return ((every[..., 0] == 1).all(0) & (every[..., 1] == every[0, :, 1]).all(0)).tolist()


def gather(transport, pairs, out_features: int, in_features: int,
           counts: list[int], *, block: Optional[torch.Tensor] = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' factors: ``(dy, x)`` of ``sum(counts)`` rows each, in rank order.

    ``pairs``: this rank's (output gradient K_i x M, input K_i x N) per backward pass;
    ``counts``: every rank's total rows (from :func:`agree`). One allgather of a
    ``K x (M + N)`` float32 block ``[dy | x]`` per rank, padded to the largest K with zero
    rows (dropped here). ``block``: optional, the pairs stacked already as that block
    (contiguous float32 on the transport's device); sent without a copy when this rank
    has the largest K.
    """
    m, n, dev = out_features, in_features, transport.device
    k = max(counts)
    if block is not None and block.shape == (k, m + n) and block.dtype == torch.float32 \
            and block.device == dev and block.is_contiguous():
        send = block
    else:
        send = torch.zeros(k, m + n, dtype=torch.float32, device=dev)
        at = 0
        for out_grad, inp in pairs:  # one pair per backward pass
            send[at:at + out_grad.shape[0], :m].copy_(out_grad)
            send[at:at + inp.shape[0], m:].copy_(inp)
            at += inp.shape[0]
    if transport.size == 1:
        recv = send
    else:
        recv = torch.empty(transport.size * k, m + n, dtype=torch.float32, device=dev)
        transport.allgather(recv.view(-1).view(torch.uint8), send.view(-1).view(torch.uint8))
    if any(c != k for c in counts):  # drop the padding rows
        recv = torch.cat([recv[r * k: r * k + c] for r, c in enumerate(counts)])
    return recv[:, :m], recv[:, m:]


def factor_stats(ranks: int, out_features: int, in_features: int, bias: bool):
    """cgx's statistics for one layer sent as factors: the gradient's values and what
    their float32 allreduce would have sent (the bytes the factors took are counted
    by the transport)."""
    from cgx.collectives.reducer import ReduceStats
    P, m, n = ranks, out_features, in_features
    numel = m * n + (m if bias else 0)
    return ReduceStats(calls=1, numel=numel, input_bytes=4 * numel,
                       seconds={"_fp32_wire": float(2 * (P - 1) * 4 * numel // P)})


def _write_grad(param: torch.Tensor, compute, dev) -> None:
    """``param.grad = compute(out)``, computed into the existing float32 gradient when
    there is one on ``dev`` (no temporary), else into a new tensor and converted."""
    g = param.grad
    if g is not None and g.dtype == torch.float32 and g.device == dev and g.is_contiguous():
        compute(g)
        return
    shape = param.shape
    out = compute(torch.empty(shape, dtype=torch.float32, device=dev))
    out = out.to(device=param.device, dtype=param.dtype)
    if g is None:
        param.grad = out
    else:
        g.copy_(out)


def factor_bytes(rows: int, ranks: int, out_features: int, in_features: int) -> int:
    """Bytes one rank receives in the factor allgather (float32)."""
    return 4 * rows * ranks * (out_features + in_features)


def gradient_bytes(out_features: int, in_features: int, spec: Optional[object] = None) -> int:
    """Bytes of the gradient itself, compressed by ``spec`` (a QuantSpec) or float32."""
    numel = out_features * in_features
    return spec.nbytes(numel) if spec is not None else 4 * numel
