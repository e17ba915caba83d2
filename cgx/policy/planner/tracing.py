"""What the planned exchange traces: each gradient's ready time while calibrating, each
step's measured time for the drift checks, the profile every rank agrees on, and the
marks on the timeline's ``planner`` row.

The functions that take ``s`` take the :class:`cgx.policy.planner.schedule.PlannedSchedule`
whose traces (``s._ready``, ``s._starts``, ``s._end``, ``s._measured``) they keep.
"""

from __future__ import annotations

import statistics
import time

import torch

from cgx.policy.planner.costs import CostModel


def mark(timeline, name: str, args: dict) -> None:
    """A point on the timeline's ``planner`` row (nothing without an enabled timeline)."""
    if timeline is not None and timeline.enabled:
        timeline.instant(name, row="planner", args=args)


def note_ready(s, index: int, step: int) -> None:
    """Gradient ``index`` is ready (called from the backward hook)."""
    now = time.perf_counter()
    start = s._starts.get(step)
    if start is None:
        start = s._starts[step] = now
        for old in [k for k in s._starts if k < step - 4]:
            del s._starts[old]
    if step >= 1:  # step 0 warms up (allocations, first-call costs)
        s._ready[index].append(now - start)


def measure_previous(s, step: int) -> None:
    """At ``step``'s first reduction: the previous step's exchange ended with its latest
    reduction. The first step after a plan still carries the calibration; it is not
    measured."""
    if s._end is not None and s.planned_at is not None:
        done, end = s._end
        start = s._starts.get(done)
        if start is not None and done > s.planned_at and done < step:
            s._measured.append(end - start)


def pending_measurement(s) -> list[float]:
    """The step whose exchange ended last, measured: ``begin_step`` adds it at the next
    step's start, which a checkpoint taken between steps would otherwise lose."""
    if s._end is None or s.planned_at is None:
        return []
    done, end = s._end
    start = s._starts.get(done)
    return [end - start] if start is not None and done > s.planned_at else []


def agreed_profile(ready_times: list, settings, transport,
                   device=None) -> tuple[list, CostModel]:
    """The ready times and the cost model every rank plans with: MAX over ranks of
    the latest ready time, the slowest quantizer and factor rebuild (as 1/throughput)
    and the most crowded host; the link measured (or ``assume_gbit``). ``ready_times``:
    per tensor, this rank's traced ready times; ``settings``: the PlannedCompression;
    ``device``: the device profile to weigh placements with (None: no choice)."""
    from cgx.comm.base import ReduceOp
    from cgx.policy.planner.calibration import (contention, link_model, machine_throughput,
                                                ranks_on_this_host)
    n = len(ready_times)
    local = torch.tensor([statistics.median(r) if r else 0.0 for r in ready_times] + [
        0.0] * 5, dtype=torch.float64)
    tp = machine_throughput(settings.bits, settings.bucket_size)
    local[n:] = torch.tensor([1.0 / tp["compress_bps"], 1.0 / tp["decompress_bps"],
                              1.0 / tp["cast_bps"],
                              contention(ranks_on_this_host(transport),
                                         0 if transport.device.type == "cuda" else None),
                              1.0 / tp["matmul_flops"]], dtype=torch.float64)
    agreed = local.to(transport.device)
    if transport.size > 1:
        transport.allreduce(agreed, ReduceOp.MAX)
    agreed = agreed.cpu().tolist()
    ready, inv = agreed[:n], agreed[n:]
    speeds = dict(compress_bps=1 / inv[0], decompress_bps=1 / inv[1], cast_bps=1 / inv[2],
                  contention=inv[3], matmul_flops=1 / inv[4])
    speeds["device"] = device
    if settings.assume_gbit is not None:
        return ready, CostModel.uniform(transport.size, settings.assume_gbit, **speeds)
    return ready, CostModel(transport.size, link_model(transport), **speeds)


def device_profile(settings, transport):
    """Where compression may run, for the planner: ``settings.device_profile`` when given;
    on a CUDA transport, rank 0's :func:`cgx.policy.planner.placement.calibrate_device` (every
    rank plans with the same; a collective); else None (CPU tensors: no choice)."""
    given = getattr(settings, "device_profile", None)
    if given is not None or transport.device.type != "cuda":
        return given
    from cgx.policy.planner.placement import DeviceProfile, calibrate_device
    mine = calibrate_device(transport.device, bits=settings.bits,
                            bucket_size=settings.bucket_size).to_dict() \
        if transport.rank == 0 else None
    return DeviceProfile.from_dict(transport.allgather_object(mine)[0])
