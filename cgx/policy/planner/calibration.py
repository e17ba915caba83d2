"""Measuring what the cost model needs, in seconds rather than minutes.

* :func:`link_model`: alpha-beta per collective of the real transport (every rank calls
  it, at the same point: it runs collectives). Two message sizes per collective; the
  slowest rank's time of each, agreed with a MAX allreduce, so every rank fits the same
  model and plans the same way. Also the transport's CPU seconds per byte (the slope of
  this process's CPU time between the two sizes, the highest rank's).
* :func:`contention`: how much the exchange's CPU work delays the compute, from the
  cores, the ranks on this host and the compute threads per rank.
* :func:`compressor_throughput`: bytes of float32 per second through this device's
  quantizer, both ways, and through an fp16 cast (per CPU second of the calling thread
  on a CPU, so a measurement beside backward still gives the work it costs);
  :func:`machine_throughput`: the same, measured once per process and setting (a
  property of the machine: the planner's later rounds reuse it).
* :func:`trace_backward`: per parameter, when backward produces its gradient (from the
  start of backward), backward's length and the optimizer's; for ``nn.Linear`` weights
  the batch rows the layer saw (what sufficient factors cost).
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from typing import Callable, Optional

import torch

from cgx.policy.planner.costs import AlphaBeta, Collective, TensorProfile


def _timed(fn: Callable[[], None], reps: int) -> float:
    return _timed_cpu(fn, reps)[0]


def _process_cpu() -> float:
    """CPU seconds of this process's threads (the transport's own included), except the
    main thread's when another thread measures: a job calibrates on its engine thread
    while backward may still run on the main one."""
    total = time.process_time()
    main = threading.main_thread()
    if threading.current_thread() is not main and hasattr(time, "pthread_getcpuclockid"):
        total -= time.clock_gettime(time.pthread_getcpuclockid(main.ident))
    return total


def _timed_cpu(fn: Callable[[], None], reps: int,
               clock: Callable[[], float] = _process_cpu) -> tuple[float, float]:
    """Median wall seconds and median CPU seconds (``clock``) of ``fn``."""
    fn()  # warm-up
    times, cpu = [], []
    for _ in range(reps):
        c0, t0 = clock(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        cpu.append(clock() - c0)
    return statistics.median(times), statistics.median(cpu)


def _fit(small: tuple[int, float], large: tuple[int, float],
         cpu: tuple[float, float] = (0.0, 0.0)) -> AlphaBeta:
    """Through the two (bytes, seconds) points; ``cpu``: CPU seconds at each, whose slope
    is the transport's CPU time per byte (a call's fixed CPU cost is in alpha)."""
    (b0, t0), (b1, t1) = small, large
    beta = max((t1 - t0) / max(b1 - b0, 1), 1e-13)
    return AlphaBeta(max(t0 - beta * b0, 0.0), beta, max(cpu[1] - cpu[0], 0.0) / max(b1 - b0, 1))


def large_probe_bytes(transport, target_s: float = 0.05, lo: int = 1 << 16,
                      hi: int = 1 << 24) -> int:
    """The large size of the link's fit: about ``target_s`` seconds of one allreduce on this
    link (a power of two in [lo, hi], agreed by every rank), so a slow link is measured in
    a fraction of a second instead of seconds per call. A collective."""
    numel = 1 << 18  # 1 MB
    took = link_probe(transport, numel, warm=True)
    sent = 2 * (transport.size - 1) * numel * 4 // transport.size
    want = sent / max(took, 1e-9) * target_s
    return int(min(max(1 << max(int(want).bit_length() - 1, 0), lo), hi))


def link_probe(transport, numel: int = 1 << 18, warm: bool = False, reps: int = 1) -> float:
    """Seconds of a float32 allreduce of ``numel`` values after a barrier (the fastest of
    ``reps``), the slowest rank's (a collective): a cheap reading of the link's speed now."""
    from cgx.comm.base import ReduceOp
    ar = torch.zeros(numel, dtype=torch.float32, device=transport.device)
    if warm:
        transport.allreduce(ar)
    best = float("inf")
    for _ in range(reps):
        transport.barrier()
        t0 = time.perf_counter()
        transport.allreduce(ar)
        best = min(best, time.perf_counter() - t0)
    took = torch.tensor([best], dtype=torch.float64, device=transport.device)
    transport.allreduce(took, ReduceOp.MAX)
    return float(took.item())


def link_model(transport, sizes=None, reps: int = 3) -> dict[Collective, AlphaBeta]:
    """Fit ``alpha + beta x bytes sent per rank`` for each collective of ``transport``, and
    its CPU seconds per byte (``AlphaBeta.cpu``). ``sizes``: the small and large payloads
    in bytes (default: 4 KiB, and :func:`large_probe_bytes`: up to 16 MiB, less on a slow
    link)."""
    P = transport.size
    dev = transport.device
    if P == 1:
        return {c: AlphaBeta(0.0, 0.0) for c in Collective}
    if sizes is None:
        sizes = (1 << 12, large_probe_bytes(transport))
    measured: dict[Collective, list[tuple[int, float]]] = {c: [] for c in Collective}
    cpu: dict[Collective, list[float]] = {c: [] for c in Collective}
    for n in sizes:
        chunk = max(8, n // P // 8 * 8)
        a2a_in = torch.zeros(P * chunk, dtype=torch.uint8, device=dev)
        a2a_out = torch.empty_like(a2a_in)
        ag_in = torch.zeros(chunk, dtype=torch.uint8, device=dev)
        ag_out = torch.empty(P * chunk, dtype=torch.uint8, device=dev)
        ar = torch.zeros(max(1, n // 4), dtype=torch.float32, device=dev)
        runs = {
            Collective.ALLTOALL: ((P - 1) * chunk, lambda: transport.alltoall(a2a_out, a2a_in)),
            Collective.ALLGATHER: ((P - 1) * chunk, lambda: transport.allgather(ag_out, ag_in)),
            Collective.ALLREDUCE: (2 * (P - 1) * ar.numel() * 4 // P, lambda: transport.allreduce(ar)),
        }
        for kind, (sent, fn) in runs.items():
            transport.barrier()
            wall, used = _timed_cpu(fn, reps)
            measured[kind].append((sent, wall))
            cpu[kind].append(used)
    # The slowest rank decides, and every rank fits the same numbers.
    flat = torch.tensor([t for kind in Collective for _, t in measured[kind]]
                        + [c for kind in Collective for c in cpu[kind]], dtype=torch.float64,
                        device=dev)
    from cgx.comm.base import ReduceOp
    transport.allreduce(flat, ReduceOp.MAX)
    values = iter(flat.tolist())
    out = {}
    points = {kind: [(sent, next(values)) for sent, _ in measured[kind]] for kind in Collective}
    for kind in Collective:
        used = [next(values) for _ in measured[kind]]
        out[kind] = _fit(points[kind][0], points[kind][-1], (used[0], used[-1]))
    return out


def ranks_on_this_host(transport) -> int:
    """How many of ``transport``'s ranks share this host's cores (a collective: every rank
    calls it). Network namespaces on one machine count as one host: they share its cores."""
    import socket
    return transport.allgather_object(socket.gethostname()).count(socket.gethostname())


def contention(local_ranks: int, threads: Optional[int] = None,
               cores: Optional[int] = None) -> float:
    """:attr:`CostModel.contention` for ``local_ranks`` ranks on this host, each computing
    with ``threads`` threads (default: torch's) on ``cores`` cores (default: this process's
    CPU affinity).

    0 when every rank has a core left for its exchange beside its compute threads: the
    exchange runs beside backward. Otherwise the compute's threads per core (at least 1):
    each CPU second of the exchange costs the compute that many seconds. For a GPU job
    pass ``threads=0``: the compute is not on these cores.
    """
    import os
    if threads is None:
        threads = torch.get_num_threads()
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    if local_ranks < 1 or cores < 1 or threads < 0:
        raise ValueError(f"contention() needs local_ranks >= 1, cores >= 1, threads >= 0; got "
                         f"{local_ranks}, {cores}, {threads}")
    if threads == 0 or local_ranks * (threads + 1) <= cores:
        return 0.0
    return max(1.0, local_ranks * threads / cores)


def compressor_throughput(numel: int = 1 << 21, bits: int = 4, bucket_size: int = 1024,
                          device: str = "cpu", reps: int = 3) -> dict[str, float]:
    """Float32 bytes per second: ``compress_bps``, ``decompress_bps`` (with accumulation, as
    the reduction runs it) and ``cast_bps`` (fp32 to fp16 and back, per direction); and
    ``matmul_flops``, multiply-adds per second of a sufficient-factor rebuild (a
    2048 x 2048 gradient from 16 gathered rows, written in place, as
    ``cgx.sufficient_factors`` does)."""
    from cgx.quant.codec import QuantSpec, dequantize, quantize
    x = torch.randn(numel, device=device)
    spec = QuantSpec(bits=bits, bucket_size=bucket_size)
    payload = quantize(x, spec)
    acc = torch.zeros_like(x)
    half = torch.empty(numel, dtype=torch.float16, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)

    def q():
        quantize(x, spec, out=payload)
        sync()

    def dq():
        dequantize(payload, numel, spec, out=acc, accumulate=True)
        sync()

    def cast():
        half.copy_(x)
        acc.copy_(half)
        sync()

    rows, side = 16, 2048
    dy, xs = torch.randn(rows, side, device=device), torch.randn(rows, side, device=device)
    grad = torch.empty(side, side, device=device)

    def rebuild():
        torch.mm(dy.t(), xs, out=grad)
        sync()

    n4 = 4 * numel
    if x.is_cuda:
        timed = lambda fn: _timed(fn, reps)  # noqa: E731
    else:
        # The calling thread's CPU time, not the wall clock: in a job this runs beside
        # backward on shared cores, and the work is what the model needs (contention is
        # the model's, CostModel.contention)
        timed = lambda fn: _timed_cpu(fn, reps, clock=time.thread_time)[1]  # noqa: E731
    return {"compress_bps": n4 / timed(q), "decompress_bps": n4 / timed(dq),
            "cast_bps": 2 * n4 / timed(cast), "matmul_flops": rows * side * side / timed(rebuild)}


def machine_throughput(bits: int, bucket_size: int, device: str = "cpu") -> dict[str, float]:
    """:func:`compressor_throughput` of 2^22 values, measured at the first call for these
    settings and reused after (on a CPU it is CPU time, not the wall clock: what other
    work shares the cores with it does not move it; that is the model's contention).
    A copy: the caller may change it."""
    return dict(_measured_throughput(bits, bucket_size, device))


@functools.lru_cache(maxsize=None)
def _measured_throughput(bits: int, bucket_size: int, device: str) -> dict[str, float]:
    return compressor_throughput(numel=1 << 22, bits=bits, bucket_size=bucket_size,
                                 device=device, reps=2)


def trace_backward(model: torch.nn.Module, step: Callable[[], torch.Tensor],
                   optimizer: Optional[torch.optim.Optimizer] = None,
                   steps: int = 3) -> tuple[list[TensorProfile], float, float]:
    """Run ``steps`` local training steps and time them (no communication).

    Args:
        model: the model; its parameters with ``requires_grad`` are traced.
        step: runs the forward pass and returns the loss (the caller's batch and loss).
        optimizer: timed after backward (its ``step``), when given.

    Returns:
        (one :class:`TensorProfile` per traced parameter, in ``named_parameters`` order,
        backward seconds, optimizer seconds); medians over the steps after the first.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows: dict[int, int] = {}
    handles = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            def record(m, inputs, output):
                x = inputs[0]
                rows[id(m.weight)] = max(rows.get(id(m.weight), 0),
                                         x.numel() // max(1, x.shape[-1]))
            handles.append(mod.register_forward_hook(record))
    ready: dict[str, list[float]] = {n: [] for n, _ in named}
    t_start = [0.0]
    for n, p in named:
        handles.append(p.register_post_accumulate_grad_hook(
            lambda _p, n=n: ready[n].append(time.perf_counter() - t_start[0])))
    backward, update = [], []
    try:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            loss = step()
            t_start[0] = time.perf_counter()
            loss.backward()
            backward.append(time.perf_counter() - t_start[0])
            if optimizer is not None:
                t0 = time.perf_counter()
                optimizer.step()
                update.append(time.perf_counter() - t0)
    finally:
        for h in handles:
            h.remove()
    keep = slice(1, None) if steps > 1 else slice(None)
    profiles = []
    for n, p in named:
        times = ready[n][keep] or [0.0]
        linear = p.dim() == 2 and id(p) in rows
        profiles.append(TensorProfile(n, p.numel(), statistics.median(times),
                                      tuple(p.shape) if linear else None,
                                      rows.get(id(p)) if linear else None))
    return (profiles, statistics.median(backward[keep]),
            statistics.median(update[keep]) if update else 0.0)

