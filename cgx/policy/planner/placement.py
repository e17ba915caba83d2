"""Where a CUDA tensor's compression runs: on the GPU, or offloaded to the host's C path.

ByteComp (Wang et al., EuroSys 2023) decides per tensor between compressing on the GPU
and on the CPU from calibrated throughputs. Here, for each quantized option the cost
model offers (``sra-4bit``, ``allgather-4bit``, ...), a :class:`DeviceProfile` makes two:

* ``GPU`` (the option's own name): the Triton kernels. Their time is on the exchange's
  compression and decompression lanes, and, because they share the GPU with backward's
  kernels, ``gpu_busy`` of it is also taken from the compute (``Option.cpu_s``: the work
  that bounds the step below, whichever processor the compute runs on).
* ``CPU_OFFLOAD`` (the name plus ``@cpu``): D2H of the values, the host's C quantizer,
  H2D of the payload (and of the decoded values SRA writes back); the reverse to decode.
  All of it is lane time that overlaps the GPU's compute; the host's seconds are taken
  from the compute only where the cores are shared (``CostModel.contention``).

The planner (``cgx.policy.planner.strategy``) then weighs both like any other option: offload
wins where backward is the bottleneck and its longer lanes still hide (a busy GPU, a fast
host and PCIe, tensors small or early enough); the GPU wins where the lanes are the
bottleneck (slow PCIe, large or late tensors) or the GPU idles. Both variants share the
option's collective calls (``Option.calls``): a fused call may mix placements
(``ReduceContext.placements``). :func:`costs` and :func:`decide` give the same comparison
for one tensor or one fusion group against the slack its lanes have.

Throughputs are GB/s of float32 input (``numel * 4`` bytes per second), as the kernel
benchmarks report them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

from cgx.collectives.offload import Placement

OFFLOAD_SUFFIX = "@cpu"

# The kernels' figures, measured: docs/results/kernels-h200.md (H200, 4 bits, stochastic
# rounding; dequantize with accumulation, as the reduction runs it). The host's C path:
# docs/results/kernels.json (the 2-core AVX2 CI host, 1 and 2 threads), not the GPU
# machine's host. PCIe: not measured; the nominal rate of a PCIe 5.0 x16 link with pinned
# memory (about 50 of its 64 GB/s), to be replaced by calibrate_device()'s figures.
_H200 = dict(gpu_quantize_gbps=697.4, gpu_dequantize_gbps=1324.4,
             host_quantize_gbps=((1, 9.36), (2, 17.64)),
             host_dequantize_gbps=((1, 18.14), (2, 17.5)),
             d2h_gbps=50.0, h2d_gbps=50.0)


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value <= 0:
        raise ValueError(f"DeviceProfile.{name} must be a finite number > 0 (GB/s or seconds), "
                         f"got {value!r}")
    return float(value)


def _table(name: str, rows) -> tuple[tuple[int, float], ...]:
    """``((threads, GB/s), ...)`` sorted by threads, from pairs or a mapping."""
    items = rows.items() if isinstance(rows, dict) else rows
    try:
        out = sorted((int(k), _positive(f"{name}[{k}]", v)) for k, v in items)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"DeviceProfile.{name} must map thread counts >= 1 to GB/s > 0, "
                         f"e.g. {{1: 9.4, 2: 17.6}}; {exc}") from None
    if not out or out[0][0] < 1:
        raise ValueError(f"DeviceProfile.{name} needs at least one entry, thread counts >= 1; "
                         f"got {rows!r}")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """What the placement decision knows of a GPU and its host (picklable, hashable).

    Attributes:
        gpu_quantize_gbps / gpu_dequantize_gbps: the Triton kernels, GB/s of float32.
        host_quantize_gbps / host_dequantize_gbps: the C path per thread count,
            ``((threads, GB/s), ...)`` (a dict ``{threads: GB/s}`` is accepted).
        d2h_gbps / h2d_gbps: pinned copies device to host and back, GB/s.
        gpu_busy: fraction of backward during which the GPU computes (0..1): that share
            of a compression kernel's time delays the compute.
        threads: host threads an offloaded (de)quantization uses (``CGX_CPU_THREADS``);
            the tables' largest entry not above it applies.
        kernel_s: GPU time of the smallest kernel (a launch's floor), per kernel.
        copy_s: fixed cost of one host-device copy and its sync, per copy.
        source: where the figures come from ("measured on ...", "given").
    """

    gpu_quantize_gbps: float
    gpu_dequantize_gbps: float
    host_quantize_gbps: tuple
    host_dequantize_gbps: tuple
    d2h_gbps: float
    h2d_gbps: float
    gpu_busy: float = 1.0
    threads: int = 1
    kernel_s: float = 5e-6
    copy_s: float = 10e-6
    source: str = "given"

    def __post_init__(self):
        for name in ("gpu_quantize_gbps", "gpu_dequantize_gbps", "d2h_gbps", "h2d_gbps"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        for name in ("host_quantize_gbps", "host_dequantize_gbps"):
            object.__setattr__(self, name, _table(name, getattr(self, name)))
        if isinstance(self.gpu_busy, bool) or not isinstance(self.gpu_busy, (int, float)) \
                or not 0.0 <= self.gpu_busy <= 1.0:
            raise ValueError(f"DeviceProfile.gpu_busy is the fraction of backward the GPU "
                             f"computes, in [0, 1]; got {self.gpu_busy!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"DeviceProfile.threads must be an int >= 1, got {self.threads!r}")
        for name in ("kernel_s", "copy_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
                raise ValueError(f"DeviceProfile.{name} is seconds per call, in [0, 1); got {v!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"DeviceProfile.source must be a string, got {self.source!r}")

    @classmethod
    def h200(cls, **overrides) -> "DeviceProfile":
        """The H200 figures of docs/results/kernels-h200.md (H100: not measured; its
        kernels run at about the same fraction of its lower memory bandwidth)."""
        fields = dict(_H200, source="kernels measured on an H200 (docs/results/kernels-h200.md); "
                                    "host C path on the CI host; PCIe nominal")
        fields.update(overrides)
        return cls(**fields)

    def host_gbps(self, table: Sequence[tuple[int, float]]) -> float:
        """The C path's rate at :attr:`threads`: the table's largest entry not above it."""
        usable = [g for t, g in table if t <= self.threads]
        return usable[-1] if usable else table[0][1]

    def to_dict(self) -> dict:
        """Plain values (JSON, checkpoints): the inverse of :meth:`from_dict`."""
        d = dataclasses.asdict(self)
        for name in ("host_quantize_gbps", "host_dequantize_gbps"):
            d[name] = [list(row) for row in d[name]]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceProfile":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"DeviceProfile.from_dict: unknown fields {sorted(unknown)}; "
                             f"expected some of {sorted(names)}")
        return cls(**d)  # the tables' lists become tuples in __post_init__


class PlacementCost(NamedTuple):
    """One placement of one option: seconds on the exchange's lanes (compression and
    decompression), seconds taken from the compute, bytes over PCIe."""

    compress_s: float
    decompress_s: float
    compute_s: float
    pcie_bytes: float


def costs(compress_s: float, decompress_s: float, bytes_sent: int, numel: int, collectives: int,
          compress_bps: float, decompress_bps: float, contention: float,
          device: DeviceProfile) -> dict[Placement, PlacementCost]:
    """Both placements of a quantized option the cost model priced at ``compress_s`` and
    ``decompress_s`` with its quantizer rates (``compress_bps``, ``decompress_bps``), so
    ``compress_s * compress_bps`` bytes go through quantization; ``bytes_sent`` per
    rank (received alike); ``collectives`` calls, one kernel or copy pair each way per call."""
    q, dq = compress_s * compress_bps, decompress_s * decompress_bps
    written_back = max(0.0, q - 4 * numel)  # SRA's reduced chunk, decoded in place
    gpu_c = collectives * device.kernel_s + q / (device.gpu_quantize_gbps * 1e9)
    gpu_d = collectives * device.kernel_s + dq / (device.gpu_dequantize_gbps * 1e9)
    host_q = q / (device.host_gbps(device.host_quantize_gbps) * 1e9)
    host_dq = dq / (device.host_gbps(device.host_dequantize_gbps) * 1e9)
    d2h, h2d = device.d2h_gbps * 1e9, device.h2d_gbps * 1e9
    copies = 2 * collectives * device.copy_s
    off_c = copies + q / d2h + host_q + (bytes_sent + written_back) / h2d
    off_d = copies + bytes_sent / d2h + host_dq + dq / h2d
    host_taken = (host_q + host_dq) if contention else 0.0
    return {Placement.GPU: PlacementCost(gpu_c, gpu_d, device.gpu_busy * (gpu_c + gpu_d), 0.0),
            Placement.CPU_OFFLOAD: PlacementCost(off_c, off_d, host_taken,
                                                 q + dq + 2 * bytes_sent + written_back)}


def decide(placed: Sequence[dict[Placement, PlacementCost]], slack_s: float) -> Placement:
    """One placement for a tensor or a fusion group (its members' :func:`costs`), alone:
    the lanes hide up to ``slack_s`` seconds (how long before they would delay the step),
    what they take beyond it and what is taken from the compute lengthen the step. Ties
    go to the GPU."""
    if not slack_s >= 0:
        raise ValueError(f"slack_s must be >= 0 seconds, got {slack_s!r}")

    def step(p: Placement) -> float:
        lanes = sum(c[p].compress_s + c[p].decompress_s for c in placed)
        return max(0.0, lanes - slack_s) + sum(c[p].compute_s for c in placed)

    return Placement.CPU_OFFLOAD if step(Placement.CPU_OFFLOAD) < step(Placement.GPU) \
        else Placement.GPU


def place(options: list, quantized: frozenset, numel: int, compress_bps: float,
          decompress_bps: float, contention: float, device: DeviceProfile) -> list:
    """``options`` (``cgx.policy.planner.costs.Option``, as ``OptionMaker`` made them) with each
    one named in ``quantized`` replaced by its GPU variant followed by its ``@cpu``
    variant, and every other option's kernels (casts, rebuilds) taking ``gpu_busy`` of
    their time from the compute."""
    out = []
    for o in options:
        own = (o.compress_s + o.decompress_s) if contention else 0.0
        transport = o.cpu_s - own  # the transport's CPU work (OptionMaker's convention)
        if o.name not in quantized:
            kernels = o.compress_s + o.decompress_s
            out.append(o._replace(cpu_s=transport + device.gpu_busy * kernels) if kernels else o)
            continue
        both = costs(o.compress_s, o.decompress_s, o.bytes_sent, numel, len(o.wire),
                     compress_bps, decompress_bps, contention, device)
        for p, name in ((Placement.GPU, o.name), (Placement.CPU_OFFLOAD, o.name + OFFLOAD_SUFFIX)):
            c = both[p]
            out.append(o._replace(name=name, compress_s=c.compress_s, decompress_s=c.decompress_s,
                                  cpu_s=transport + c.compute_s))
    return out


def _seconds(fn, sync, reps: int) -> float:
    """The median of ``reps`` timed runs of ``fn`` after a warm-up."""
    import statistics
    import time
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gbps(fn, nbytes: int, sync, reps: int) -> float:
    """GB/s of ``fn`` over ``nbytes``."""
    return nbytes / _seconds(fn, sync, reps) / 1e9


def _offload_fixed_s(x, spec, sync, reps: int) -> float:
    """The fixed cost of one offloaded copy, for :attr:`DeviceProfile.copy_s`: a small
    tensor's quantize and decode through the host (pinned buffers, the side stream's
    waits and the host syncs of four copies, the C path's few microseconds) over four."""
    from cgx.collectives import offload
    n = min(x.numel(), 8 * spec.bucket_size)
    small = x[:n]
    payload, acc = offload.quantize(small, spec), small.new_zeros(n)
    t = _seconds(lambda: offload.dequantize(offload.quantize(small, spec, out=payload), n, spec,
                                            out=acc, accumulate=True), sync, reps)
    return min(t / 4, 0.5)


def calibrate_device(device="cuda", numel: int = 1 << 24, threads: Sequence[int] = (1,),
                     gpu_busy: float = 1.0, bits: int = 4, bucket_size: int = 1024,
                     reps: int = 5) -> DeviceProfile:
    """Measure a :class:`DeviceProfile` on a CUDA ``device`` (about a second): the Triton
    kernels, the host's C path at each of ``threads``, pinned copies each way, and the
    fixed cost of an offloaded call (``copy_s``).
    ``gpu_busy`` is given (the share of backward the GPU computes: 1.0 for a model whose
    backward is kernels back to back). Stochastic rounding; dequantize accumulates."""
    import torch

    from cgx.quant.codec import QuantSpec, dequantize, quantize
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"calibrate_device() measures a CUDA device, got {device!r} "
                         f"(CUDA available: {torch.cuda.is_available()}); pass a "
                         "DeviceProfile instead (e.g. DeviceProfile.h200())")
    spec = QuantSpec(bits=bits, bucket_size=bucket_size)
    n4 = 4 * numel
    sync = torch.cuda.synchronize
    x = torch.randn(numel, device=dev)
    payload, acc = quantize(x, spec), torch.zeros_like(x)
    gpu_q = _gbps(lambda: quantize(x, spec, out=payload), n4, sync, reps)
    gpu_dq = _gbps(lambda: dequantize(payload, numel, spec, out=acc, accumulate=True), n4, sync,
                   reps)
    hx, hacc = x.cpu().pin_memory(), torch.zeros(numel).pin_memory()
    hpay = payload.cpu().pin_memory()
    d2h = _gbps(lambda: hx.copy_(x, non_blocking=True), n4, sync, reps)
    h2d = _gbps(lambda: acc.copy_(hx, non_blocking=True), n4, sync, reps)
    host_q, host_dq = [], []
    for t in sorted(set(threads)):
        host_q.append((t, _gbps(lambda: quantize(hx, spec, out=hpay, threads=t), n4,
                                lambda: None, reps)))
        host_dq.append((t, _gbps(lambda: dequantize(hpay, numel, spec, out=hacc,
                                                    accumulate=True, threads=t), n4,
                                 lambda: None, reps)))
    copy_s = _offload_fixed_s(x, spec, sync, reps)
    name = torch.cuda.get_device_name(dev)
    return DeviceProfile(gpu_q, gpu_dq, tuple(host_q), tuple(host_dq), d2h, h2d, gpu_busy,
                         threads=max(threads), copy_s=copy_s, source=f"measured on {name}")


def placement_of(option_name: str) -> Placement:
    """The placement an option of :func:`place` stands for (by its name)."""
    return Placement.CPU_OFFLOAD if option_name.endswith(OFFLOAD_SUFFIX) else Placement.GPU


__all__ = ["DeviceProfile", "Placement", "PlacementCost", "calibrate_device", "costs", "decide",
           "place", "placement_of", "OFFLOAD_SUFFIX"]
