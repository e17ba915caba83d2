"""Rank functions that measure the simulated links with Gloo itself.

They run inside ranks started by :meth:`SlowNetwork.run_function` (the
process group is already up) and return plain dicts. Each timed repetition
starts after a barrier, so ranks start together to within one small round trip.
"""

from __future__ import annotations

import time
from typing import Any

MB = 10**6  # the figures in DESIGN.md are decimal megabytes


def _dtype(name: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype such as 'float32' or 'float16', got {name!r}")
    return dtype


def allreduce_probe(size_mb: float = 100.0, reps: int = 3, warmup: int = 1,
                    dtype: str = "float32") -> dict[str, Any]:
    """Time ``dist.all_reduce`` (sum) of a ``size_mb`` MB tensor and check its result.

    Rank r contributes the value r+1 everywhere, so every element must come
    back as N(N+1)/2 (exact in float16 too for small N).

    Returns:
        ``{"op", "dtype", "bytes", "world_size", "times_s", "correct"}``;
        ``times_s`` holds this rank's time of each timed repetition.
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dt = _dtype(dtype)
    numel = max(1, int(size_mb * MB) // torch.empty((), dtype=dt).element_size())
    buf = torch.empty(numel, dtype=dt)
    expected = world * (world + 1) // 2
    times, correct = [], True
    for i in range(warmup + reps):
        buf.fill_(rank + 1)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
        correct = correct and bool(torch.all(buf == expected))
    return {"op": "allreduce", "dtype": dtype, "bytes": numel * buf.element_size(),
            "world_size": world, "times_s": times, "correct": correct}


def sendrecv_probe(size_mb: float = 100.0, reps: int = 3, warmup: int = 1) -> dict[str, Any]:
    """Time a one-way ``dist.send`` rank 0 -> rank 1 of ``size_mb`` MB (other ranks idle).

    The receiver's time is the transfer time (a send may return once the data
    is buffered); only rank 1 reports times.
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    numel = int(size_mb * MB) // 4
    buf = torch.full((numel,), float(rank), dtype=torch.float32)
    times, correct = [], True
    for i in range(warmup + reps):
        if rank == 1:
            buf.fill_(-1.0)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, dst=1)
        elif rank == 1:
            dist.recv(buf, src=0)
        elapsed = time.perf_counter() - start
        if rank == 1:
            correct = correct and bool(torch.all(buf == 0.0))  # outside the timed region
            if i >= warmup:
                times.append(elapsed)
    dist.barrier()
    return {"op": "sendrecv", "bytes": numel * 4, "times_s": times, "correct": correct}


def selftest_probe(size_mb: float = 100.0, reps: int = 3) -> dict[str, Any]:
    """The selftest's measurements in one launch: fp32 allreduce, then one-way send/recv."""
    return {
        "allreduce": allreduce_probe(size_mb=size_mb, reps=reps, dtype="float32"),
        "sendrecv": sendrecv_probe(size_mb=size_mb, reps=reps),
    }


def fail_probe(rank_to_fail: int = 1, code: int = 3) -> None:
    """Exit with ``code`` on one rank after the group is up (tests the failure path)."""
    import sys

    import torch.distributed as dist

    if dist.get_rank() == rank_to_fail:
        sys.exit(code)
    dist.barrier()  # blocks: the failing rank never joins; the harness must stop us
