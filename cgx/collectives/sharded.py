"""Reduce-scatter and all-gather of flat sharded buffers (the layout of FSDP/ZeRO), compressed.

A sharded data-parallel step reduces one flat buffer per parameter group: ``W`` equal
chunks, chunk ``c`` holding rank ``c``'s shard of every parameter of the group. Each
rank keeps the reduced chunk it owns (reduce-scatter of gradients), and before forward
the ranks gather every chunk back (all-gather of parameters).

* :func:`reduce_scatter_flat`: the quantized reduce-scatter of ``reduce_scatter.py``
  (SRA's first half: each rank quantizes the chunks other ranks own, one all-to-all,
  each owner sums) with error feedback on this rank's own input; or, given a
  :class:`Topology`, hierarchical as SDP4Bit: a reduce-scatter among the ranks of a
  host (``Levels.inner``, e.g. 8 bits), then one among the hosts (``Levels.cross``,
  e.g. 4 bits), each rank ending with the chunk it owns;
* :func:`all_gather_flat`: every rank's chunk quantized once (nearest rounding), one
  all-gather of the payloads, every rank decoding all of them, its own included, so
  that the gathered buffer is identical on every rank; returns the error it added.

Non-finite inputs are handled as the data-parallel allreduce does: a rank whose input
holds an inf or NaN makes the first value of every chunk NaN before quantizing, so the
reduced chunk of *every* rank is non-finite (each rank's loss scaler then skips the
step, as with an allreduce), and the residuals drop their non-finite entries afterwards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from cgx.comm.base import ReduceOp, Transport, count_sent
from cgx.collectives.reduce_scatter import reduce_scatter
from cgx.quant.codec import QuantSpec, dequantize, quantize


@dataclasses.dataclass(frozen=True)
class Levels:
    """How a flat gradient buffer travels.

    Attributes:
        inner: quantization among the ranks of a host (among all ranks when the
            reduction is flat); None: exact.
        cross: quantization between hosts (hierarchical reduction only); None: exact.
        error_feedback: keep what quantizing this rank's input dropped and add it to
            the next step's input (one float32 residual per level that quantizes).
    """

    inner: Optional[QuantSpec]
    cross: Optional[QuantSpec] = None
    error_feedback: bool = False


@dataclasses.dataclass(frozen=True)
class Topology:
    """Hosts for a hierarchical reduce-scatter.

    Attributes:
        local: the ranks of this host (``local.rank`` is this rank's position there).
        cross: the ranks with this local position, one per host.
        order: global ranks by (local position, host position): ``order[l * N + h]`` is
            the rank at local position ``l`` of host ``h`` (``N = cross.size``).
    """

    local: Transport
    cross: Transport
    order: tuple[int, ...]

    @classmethod
    def of(cls, world: Transport, local: Transport, cross: Transport) -> "Topology":
        """Every rank's place, agreed over ``world`` (one small all-gather; every rank calls)."""
        if local.size * cross.size != world.size:
            raise ValueError(f"{local.size} ranks per host x {cross.size} hosts != "
                             f"{world.size} ranks: a hierarchical reduce-scatter needs the same "
                             "number of ranks on every host")
        places = world.allgather_object((local.rank, cross.rank))
        order = [0] * world.size
        for g, (lpos, hpos) in enumerate(places):
            order[lpos * cross.size + hpos] = g
        return cls(local, cross, tuple(order))


@dataclasses.dataclass
class ShardState:
    """One parameter group's state on this rank (pickles; ``torch.save`` stores it).

    Attributes:
        step: reduce-scatters done (the stochastic-rounding key's step: the same on
            every rank, so restoring it restores the rounding).
        residuals: by the buffer's numel (a step where another set of parameters has
            gradients has another layout, hence its own residuals): one float32 tensor
            per quantizing level, inner first, in input units of this rank's buffer.
        gather_error_sq, gather_norm_sq: sums over all-gathers of the squared error the
            quantized all-gather added to this rank's chunk, and of its squared norm.
    """

    step: int = 0
    residuals: dict = dataclasses.field(default_factory=dict)
    gather_error_sq: float = 0.0
    gather_norm_sq: float = 0.0

    def gather_error(self) -> float:
        """Relative error (L2) the quantized all-gather added to the parameters so far."""
        return math.sqrt(self.gather_error_sq / self.gather_norm_sq) if self.gather_norm_sq else 0.0

    def copy(self) -> "ShardState":
        """A snapshot (tensors cloned)."""
        return dataclasses.replace(self, residuals={
            n: [r.clone() for r in rs] for n, rs in self.residuals.items()})


def poison_nonfinite(x: torch.Tensor, world: int) -> torch.Tensor:
    """``x``, or where it holds an inf/NaN, a copy with the first value of each of its
    ``world`` chunks NaN (so every owner's reduced chunk is non-finite).
    Cost: one float32-accumulated sum; the exact check and the copy only after an overflow."""
    if x.numel() == 0 or torch.isfinite(x.sum(dtype=torch.float32)) or bool(torch.isfinite(x).all()):
        return x
    x = x.clone()
    x.view(world, -1)[:, 0] = float("nan")
    return x


def _residuals(state: ShardState, levels: Levels, key: int, sizes: Sequence[Optional[int]],
               device) -> list:
    """The residuals of the layout ``key`` (the buffer's numel), made on first use: one per
    entry of ``sizes`` (None: that level is exact, no residual)."""
    if not levels.error_feedback:
        return [None] * len(sizes)
    want = [n for n in sizes if n is not None]
    kept = state.residuals.get(key, [])
    if [r.numel() for r in kept] != want:  # first use, or the levels changed ("auto")
        kept = state.residuals[key] = [torch.zeros(n, dtype=torch.float32, device=device)
                                       for n in want]
    it = iter(kept)
    return [next(it) if n is not None else None for n in sizes]


def _owed(x: torch.Tensor, state: ShardState, levels: Levels) -> torch.Tensor:
    """``x`` plus what an earlier quantized level still owes when this one is exact (a
    group ``"auto"`` moved to exact): sent now, exactly, and forgotten."""
    held = state.residuals.get(x.numel()) if levels.inner is None else None
    if not held:
        return x
    del state.residuals[x.numel()]
    return x + held[0].to(x.dtype).view_as(x)


def reduce_scatter_flat(x: torch.Tensor, out: torch.Tensor, transport: Transport,
                        levels: Levels, state: ShardState, *, average: bool, name: str = "",
                        seed: int = 0, threads: int = 1,
                        topology: Optional[Topology] = None) -> int:
    """Reduce the flat buffer ``x`` (``W`` equal chunks) and write this rank's chunk to ``out``.

    Args:
        x: contiguous, numel a multiple of ``transport.size``; not modified.
        out: ``x.numel() // W`` values, ``x``'s dtype.
        average: divide the sum by ``W``; else the sum.
        state: this group's :class:`ShardState` (its step advances by one).
        topology: hosts, for the hierarchical reduction; None: flat over ``transport``.

    Returns:
        Bytes this rank handed to the transports.
    """
    W = transport.size
    if x.numel() % W or out.numel() * W != x.numel():
        raise ValueError(f"a flat buffer of {x.numel()} values does not split into {W} chunks "
                         f"of {out.numel()}")
    x = poison_nonfinite(x, W)
    post = 1.0 / W if average else 1.0
    key = dict(name=name, seed=seed, step=state.step, threads=threads)
    with count_sent() as sent:
        if topology is None or topology.cross.size == 1 and topology.local.size == W:
            x = _owed(x, state, levels)
            (res,) = _residuals(state, levels, x.numel(),
                                [x.numel() if levels.inner else None], x.device)
            mine, _ = reduce_scatter(x.view(W, -1), transport, ReduceOp.SUM, post=post,
                                     spec=levels.inner, residual=res, **key)
        else:
            mine = _hierarchical(x, topology, levels, state, post, key)
    out.view(-1).copy_(mine.view(-1))
    state.step += 1
    return sent.total


def _hierarchical(x, topology: Topology, levels: Levels, state: ShardState, post: float,
                  key: dict) -> torch.Tensor:
    """Inside the host, then between hosts; each stage quantized as ``levels`` says."""
    L, N = topology.local.size, topology.cross.size
    n = x.numel()
    inner_res, cross_res = _residuals(
        state, levels, n, [n if levels.inner else None, n // L if levels.cross else None],
        x.device)
    # Chunks by (local position, host): local rank l reduces the N chunks of the ranks
    # at local position l, then hands each host its own.
    xs = x.view(L * N, -1)[torch.tensor(topology.order, device=x.device)]
    part, _ = reduce_scatter(xs.view(L, -1), topology.local, ReduceOp.SUM, spec=levels.inner,
                             residual=inner_res, **key)
    key = dict(key, name=key["name"] + "/cross")
    mine, _ = reduce_scatter(part.view(N, -1), topology.cross, ReduceOp.SUM, post=post,
                             spec=levels.cross, residual=cross_res, **key)
    return mine


def all_gather_flat(inp: torch.Tensor, out: torch.Tensor, transport: Transport,
                    spec: QuantSpec, state: Optional[ShardState] = None,
                    threads: int = 1) -> int:
    """Gather every rank's ``inp`` into ``out`` (rank order), each quantized once by ``spec``.

    Every rank decodes every payload, its own too, so ``out`` is identical on all ranks.
    With ``state``, the squared error this rank's chunk got and its squared norm are added
    to it (:meth:`ShardState.gather_error`). ``inp`` may be a view of ``out``.

    Returns:
        Bytes this rank handed to the transport.
    """
    W, r, n = transport.size, transport.rank, inp.numel()
    if out.numel() != W * n:
        raise ValueError(f"out holds {out.numel()} values; gathering {W} chunks of {n} needs "
                         f"{W * n}")
    nb = spec.nbytes(n)
    send = torch.empty(nb, dtype=torch.uint8, device=inp.device)
    recv = torch.empty(W * nb, dtype=torch.uint8, device=inp.device)
    mine = inp.detach().clone().view(-1)
    quantize(mine, spec, out=send, key=0, write_back=True, threads=threads)
    if state is not None:
        ref = inp.detach().view(-1).float()
        state.gather_error_sq += float((mine.float() - ref).square().sum())
        state.gather_norm_sq += float(ref.square().sum())
    with count_sent() as sent:
        transport.allgather(recv, send)
    flat = out.view(-1)
    for j in range(W):
        if j == r:
            flat[j * n:(j + 1) * n].copy_(mine)
        else:
            dequantize(recv[j * nb:(j + 1) * nb], n, spec, out=flat[j * n:(j + 1) * n],
                       threads=threads)
    return sent.total
