"""The cost model: what each option of a tensor costs in compute and on the wire.

Times come from an alpha-beta model per collective (``alpha`` seconds per call, ``beta``
seconds per byte one rank sends, ``cpu`` seconds of the transport's own CPU work per
byte) and from the measured throughput of compression (bytes of float32 input per
second).

Where the ranks' compute already fills the cores (two single-threaded ranks on two
cores), the exchange's CPU work - compressing, decompressing and the transport's
copies and reductions - does not run beside backward for free: it takes the core from
it. ``CostModel.contention`` says how much (0: each rank has a spare core). The
simulator then bounds the step below by the compute plus that work, which the three
lanes alone cannot see: on a fast link an exact allreduce "hidden" under backward
still costs its reduction's CPU time. The byte counts are the ones cgx's collectives
put on the wire (``cgx.quant.wire.packed_nbytes`` for quantized segments), so a
plan's predicted traffic is what the statistics will report.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping, NamedTuple, Optional

from cgx.policy.planner.placement import DeviceProfile, place
from cgx.quant.wire import packed_nbytes


class Collective(enum.Enum):
    ALLREDUCE = "allreduce"  # a ring allreduce of uncompressed values
    ALLTOALL = "alltoall"  # SRA's scatter-reduce phase
    ALLGATHER = "allgather"

    __hash__ = object.__hash__  # members are singletons; Enum's own hash is slow Python


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """``alpha + beta * bytes``: seconds for one call in which each rank sends ``bytes``;
    ``cpu * bytes``: the CPU seconds the transport spends on it in this process (its
    threads' copies, reductions and polling)."""

    alpha: float
    beta: float
    cpu: float = 0.0

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
        contention: seconds the compute is delayed per CPU second of the transport
            (:func:`cgx.policy.planner.calibration.contention`): 0 when every rank has a core to
            spare for communication; otherwise the ranks per core of compute, and the
            exchange's compression and decompression (measured in this job, so already
            in its seconds) delay the compute one for one.
        device: for gradients on a GPU, its :class:`~cgx.policy.planner.placement.DeviceProfile`:
            each quantized option then comes placed on the GPU and offloaded to the host
            (``"sra-4bit@cpu"``), see :mod:`cgx.policy.planner.placement`; None: no choice.
    """

    world: int
    links: Mapping[Collective, AlphaBeta]
    compress_bps: float = 2e9
    decompress_bps: float = 6e9
    cast_bps: float = 4e9
    matmul_flops: float = 2e10
    contention: float = 0.0
    device: Optional[DeviceProfile] = None

    def __post_init__(self):
        if not self.contention >= 0:
            raise ValueError(f"contention must be >= 0, got {self.contention!r}")
        if self.device is not None and not isinstance(self.device, DeviceProfile):
            raise TypeError(f"device must be a cgx.policy.planner.placement.DeviceProfile or None, "
                            f"got {type(self.device).__name__}")

    @classmethod
    def uniform(cls, world: int, gbit_per_s: float, latency_s: float = 50e-6,
                cpu_per_byte: float = 0.0, **kw) -> "CostModel":
        """The same link for every collective: ``gbit_per_s``, ``latency_s`` per call and
        the transport's ``cpu_per_byte`` CPU seconds."""
        ab = AlphaBeta(latency_s, 8 / (gbit_per_s * 1e9), cpu_per_byte)
        return cls(world, {c: ab for c in Collective}, **kw)

    def comm(self, kind: Collective, nbytes: float) -> float:
        return self.links[kind].time(nbytes)

    def to_dict(self) -> dict:
        """Plain values (checkpoints): the inverse of :meth:`from_dict`."""
        d = {"world": self.world, "links": {k.value: [ab.alpha, ab.beta, ab.cpu]
                                            for k, ab in self.links.items()},
             "compress_bps": self.compress_bps, "decompress_bps": self.decompress_bps,
             "cast_bps": self.cast_bps, "matmul_flops": self.matmul_flops,
             "contention": self.contention}
        if self.device is not None:
            d["device"] = self.device.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(int(d["world"]), {Collective(k): AlphaBeta(*v) for k, v in d["links"].items()},
                   float(d["compress_bps"]), float(d["decompress_bps"]), float(d["cast_bps"]),
                   float(d["matmul_flops"]), float(d.get("contention", 0.0)),
                   DeviceProfile.from_dict(d["device"]) if d.get("device") else None)


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
    # What it takes from the compute where the CPU is shared (CostModel.contention):
    # compression, decompression and the transport's CPU work, in seconds.
    cpu_s: float = 0.0

    @property
    def bytes_sent(self) -> int:
        return sum(b for _, b in self.wire)


# The planner weighs time, not error: offered more levels it would always take the
# fewest bits. The level is the user's (or compression="auto"'s) decision; the planner
# decides whether and how each tensor is compressed at that level.
DEFAULT_BITS = (4,)


ALL_FAMILIES = ("exact", "fp16", "sra", "allgather", "sfb")


def options_for(t: TensorProfile, m: CostModel, bits=DEFAULT_BITS, families=None) -> list[Option]:
    """Every option of ``t``, exact first (the planner keeps the first of equal options)."""
    return OptionMaker(m, bits, families)(t)


class OptionMaker:
    """:func:`options_for` with the model's constants looked up once: the planner builds
    the options of hundreds of tensors per decision. Same options, same order."""

    def __init__(self, m: CostModel, bits=DEFAULT_BITS, families=None):
        fams = set(families or ALL_FAMILIES)
        self.m, self.P = m, m.world
        self.fp16 = "fp16" in fams and m.world > 1
        self.sra = "sra" in fams and m.world > 1
        self.allgather = "allgather" in fams and m.world > 1
        self.sfb = "sfb" in fams and m.world > 1
        self.bits = tuple(bits)
        self.beta = {k: ab.beta for k, ab in m.links.items()}
        self.compress_bps, self.decompress_bps = m.compress_bps, m.decompress_bps
        self.cast_bps = m.cast_bps
        self.names = {b: (f"sra-{b}bit", f"allgather-{b}bit") for b in self.bits}
        self.contention = m.contention
        self.cpu = {k: m.contention * ab.cpu for k, ab in m.links.items()}
        self.device = m.device
        self.quantized = frozenset(n for pair in self.names.values() for n in pair)

    def _option(self, name: str, compress_s: float, wire, decompress_s: float) -> Option:
        """One option: its calls and times from the bytes of each collective (one or two)."""
        beta, cpu = self.beta, self.cpu
        (k0, b0), rest = wire[0], wire[1:]
        linear, moved = beta[k0] * b0, cpu[k0] * b0
        calls = ((name, k0),) if b0 else ()
        if rest:
            k1, b1 = rest[0]
            linear += beta[k1] * b1
            moved += cpu[k1] * b1
            if b1:
                calls += ((name, k1),)
        shared = compress_s + decompress_s + moved if self.contention else 0.0
        return Option(name, compress_s, wire, decompress_s, linear, calls, shared)

    def payload(self, name: str, t: TensorProfile, nbytes: int,
                kind: Collective = Collective.ALLGATHER) -> Option:
        """A compressor the model knows by its bytes only (top-k, PowerSGD): ``nbytes`` sent
        per rank through ``kind``, one pass over the input each way at the quantizer's
        speeds."""
        n4 = 4 * t.numel
        return self._option(name, n4 / self.compress_bps, ((kind, int(nbytes)),),
                            n4 / self.decompress_bps)

    def __call__(self, t: TensorProfile, bucket: int = 1024) -> list[Option]:
        P, n, make = self.P, t.numel, self._option
        AR, A2A, AG = Collective.ALLREDUCE, Collective.ALLTOALL, Collective.ALLGATHER
        # exact and fp16: a ring allreduce of 4 or 2 bytes per value, with a cast each way
        # for fp16. sra: scatter-reduce-allgather of quantized chunks (each rank owns 1/P):
        # compress everything once, then the reduced own chunk again; decompress the P-1
        # received chunks (reduce) and the P-1 gathered ones. allgather: every rank
        # gathers every rank's quantized tensor and sums.
        out = [make("exact", 0.0, ((AR, 2 * (P - 1) * 4 * n // P),), 0.0)]
        if P == 1:
            return out
        n4 = 4 * n
        if self.fp16:
            cast = n4 / self.cast_bps
            out.append(make("fp16", cast, ((AR, 2 * (P - 1) * 2 * n // P),), cast))
        for bits in self.bits:
            sra_name, ag_name = self.names[bits]
            if self.sra:
                c = (P - 1) * packed_nbytes(-(-n // P), bits, bucket)
                out.append(make(sra_name, n4 * (1 + 1 / P) / self.compress_bps,
                                ((A2A, c), (AG, c)), 2 * n4 * (P - 1) / P / self.decompress_bps))
            if self.allgather:
                c = (P - 1) * packed_nbytes(n, bits, bucket)
                out.append(make(ag_name, n4 / self.compress_bps, ((AG, c),),
                                n4 * (P - 1) / self.decompress_bps))
        if self.sfb and t.shape is not None and t.rows:
            # sfb: all-gather each rank's K x (M + N) factors and rebuild, only where
            # Poseidon's rule holds
            from cgx.sufficient_factors import worth_it
            rows, (out_f, in_f) = t.rows, t.shape
            if worth_it(rows, P, out_f, in_f):
                c = (P - 1) * 4 * rows * (out_f + in_f)
                out.append(make("sfb", 0.0, ((AG, c),),
                                rows * P * out_f * in_f / self.m.matmul_flops))
        if self.device is not None:
            out = place(out, self.quantized, n, self.compress_bps, self.decompress_bps,
                        self.contention, self.device)
        return out
