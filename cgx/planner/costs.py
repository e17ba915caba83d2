"""The cost model: what each option of a tensor costs in compute and on the wire.

Times come from an alpha-beta model per collective (``alpha`` seconds per call, ``beta``
seconds per byte one rank sends) and from the measured throughput of compression
(bytes of float32 input per second). The byte counts are the ones cgx's collectives
put on the wire (``cgx.compression.wire.packed_nbytes`` for quantized segments), so a
plan's predicted traffic is what the statistics will report.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, NamedTuple, Optional

from cgx.compression.wire import packed_nbytes


class Collective(enum.Enum):
    ALLREDUCE = "allreduce"  # a ring allreduce of uncompressed values
    ALLTOALL = "alltoall"  # SRA's scatter-reduce phase
    ALLGATHER = "allgather"

    __hash__ = object.__hash__  # members are singletons; Enum's own hash is slow Python


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """``alpha + beta * bytes``: seconds for one call in which each rank sends ``bytes``."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes if nbytes > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What the planner knows of this job's machines.

    Args:
        world: ranks.
        links: alpha-beta per collective.
        compress_bps / decompress_bps: float32 bytes per second through the quantizer.
        cast_bps: float32 bytes per second through an fp16 cast (each way).
        matmul_flops: multiply-adds per second (rebuilding a gradient from its factors).
    """

    world: int
    links: Mapping[Collective, AlphaBeta]
    compress_bps: float = 2e9
    decompress_bps: float = 6e9
    cast_bps: float = 4e9
    matmul_flops: float = 2e10

    @classmethod
    def uniform(cls, world: int, gbit_per_s: float, latency_s: float = 50e-6, **kw) -> "CostModel":
        """The same link for every collective: ``gbit_per_s`` and ``latency_s`` per call."""
        ab = AlphaBeta(latency_s, 8 / (gbit_per_s * 1e9))
        return cls(world, {c: ab for c in Collective}, **kw)

    def comm(self, kind: Collective, nbytes: float) -> float:
        return self.links[kind].time(nbytes)


@dataclasses.dataclass(frozen=True)
class TensorProfile:
    """One gradient: its size, when backward produces it, and (for a linear layer) its factors.

    ``ready_s`` counts from the start of backward. ``shape`` (M, N) and ``rows`` (K, the
    batch rows the layer saw) make sufficient factors an option.
    """

    name: str
    numel: int
    ready_s: float
    shape: Optional[tuple[int, int]] = None
    rows: Optional[int] = None


class Option(NamedTuple):
    """One way to exchange a tensor: compute before, collectives (bytes sent per rank), compute after.

    A named tuple, not a dataclass: the planner builds a few per tensor on every decision.
    """

    name: str
    compress_s: float
    wire: tuple[tuple[Collective, int], ...]
    decompress_s: float
    linear_s: float = 0.0  # sum of beta x bytes over its collectives (set by options_for)
    # The calls it makes, (name, collective); options of one name in a fusion group share them.
    calls: tuple = ()

    @property
    def bytes_sent(self) -> int:
        return sum(b for _, b in self.wire)

    def network_s(self, m: "CostModel") -> float:
        """Uncontended network time: alpha per call plus the linear part."""
        return self.linear_s + sum(m.links[k].alpha for _, k in self.calls)


def _option(m: CostModel, name: str, compress_s: float, wire, decompress_s: float) -> Option:
    """An option with its linear network time and its calls filled in for ``m``."""
    links = m.links
    linear, calls = 0.0, []
    for k, b in wire:
        linear += links[k].beta * b
        if b > 0:
            calls.append((name, k))
    return Option(name, compress_s, tuple(wire), decompress_s, linear, tuple(calls))


def exact(t: TensorProfile, m: CostModel) -> Option:
    P = m.world
    return _option(m, "exact", 0.0, ((Collective.ALLREDUCE, 2 * (P - 1) * 4 * t.numel // P),), 0.0)


def fp16(t: TensorProfile, m: CostModel) -> Option:
    P = m.world
    cast = 4 * t.numel / m.cast_bps
    return _option(m, "fp16", cast, ((Collective.ALLREDUCE, 2 * (P - 1) * 2 * t.numel // P),), cast)


def sra(t: TensorProfile, m: CostModel, bits: int, bucket: int = 1024) -> Option:
    """Scatter-reduce-allgather of quantized chunks (cgx's SRA): each rank owns 1/P."""
    P = m.world
    chunk = packed_nbytes(-(-t.numel // P), bits, bucket)
    n4 = 4 * t.numel
    # Compress everything once, then the reduced own chunk again; decompress the P-1
    # received chunks (reduce) and the P-1 gathered ones.
    return _option(m, f"sra-{bits}bit", n4 * (1 + 1 / P) / m.compress_bps,
                  ((Collective.ALLTOALL, (P - 1) * chunk), (Collective.ALLGATHER, (P - 1) * chunk)),
                  2 * n4 * (P - 1) / P / m.decompress_bps)


def allgather(t: TensorProfile, m: CostModel, bits: int, bucket: int = 1024) -> Option:
    """Every rank gathers every rank's quantized tensor and sums (cgx's allgather)."""
    P = m.world
    n4 = 4 * t.numel
    return _option(m, f"allgather-{bits}bit", n4 / m.compress_bps,
                  ((Collective.ALLGATHER, (P - 1) * packed_nbytes(t.numel, bits, bucket)),),
                  n4 * (P - 1) / m.decompress_bps)


def sufficient_factors(t: TensorProfile, m: CostModel) -> Optional[Option]:
    """All-gather each rank's K x (M + N) factors and rebuild; only where Poseidon's rule holds."""
    if t.shape is None or not t.rows:
        return None
    from cgx.sufficient_factors import worth_it
    rows, (out_f, in_f) = t.rows, t.shape
    if not worth_it(rows, m.world, out_f, in_f):
        return None
    P = m.world
    return _option(m, "sfb", 0.0, ((Collective.ALLGATHER, (P - 1) * 4 * rows * (out_f + in_f)),),
                  rows * P * out_f * in_f / m.matmul_flops)


# The planner weighs time, not error: offered more levels it would always take the
# fewest bits. The level is the user's (or compression="auto"'s) decision; the planner
# decides whether and how each tensor is compressed at that level.
DEFAULT_BITS = (4,)


def options_for(t: TensorProfile, m: CostModel, bits=DEFAULT_BITS, families=None) -> list[Option]:
    """Every option of ``t``, exact first (the planner keeps the first of equal options)."""
    fams = set(families or ("exact", "fp16", "sra", "allgather", "sfb"))
    out = [exact(t, m)]
    if m.world == 1:
        return out
    if "fp16" in fams:
        out.append(fp16(t, m))
    for b in bits:
        if "sra" in fams:
            out.append(sra(t, m, b))
        if "allgather" in fams:
            out.append(allgather(t, m, b))
    if "sfb" in fams:
        sf = sufficient_factors(t, m)
        if sf is not None:
            out.append(sf)
    return out
