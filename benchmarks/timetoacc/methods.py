"""How each method wraps a model and its optimizer, and what it reports.

Names:
    ddp-fp32, ddp-fp16, ddp-bf16, ddp-powersgd-r1/-r4       PyTorch DDP and its comm hooks
        (ddp-bf16: the bf16 compress hook's body, which torch runs on NCCL only, on Gloo)
    horovod-fp32, horovod-fp16                             Horovod 0.28.1 (Gloo), Compression.fp16
    cgx-<bits>bit[-ef][-sfb][-flat]                        cgx's DistributedOptimizer, quantized;
        -ef error feedback, -sfb fully connected layers as sufficient factors,
        -flat no hierarchical reduction on 2 hosts x 2 ranks (the default there is hierarchical)
    cgx-auto                                               compression="auto" (per-layer levels)
    cgx-planned[-sfb]                                      Compression.planned(): exact or 4-bit
        per tensor, as cgx.policy.planner predicts is fastest on the measured link
    cgx-decide[-flat]                                      Compression.auto(objective="time"):
        the model proposes whole plans, trials keep the fastest within the error budget
    cgx-diloco-h<N>, cgx-diloco-auto, cgx-diloco-streaming, cgx-localsgd[-h<N>],
    torch-postlocal-sgd[-h<N>], torchft-diloco[-streaming][-h<N>]
        local steps with periodic outer updates (benchmarks/timetoacc/methods_diloco.py)
    fsdp-fp32, fsdp-bf16, cgx-fsdp-8bit, cgx-fsdp-4bit, cgx-fsdp-hier, cgx-fsdp-4bit-p8
        sharded training, FSDP2's reduce-scatter or cgx's (benchmarks/timetoacc/methods_fsdp.py)

Every method reports the bytes it accounts for (cgx: its own statistics;
the others: the ring-allreduce formula of what they send), next to what the
network interface really carried (measured by the caller).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Optional

from benchmarks.timetoacc.counters import cgx_counters, init_cgx, ring_bytes

DEFAULT_METHODS = ("ddp-fp32", "ddp-fp16", "ddp-bf16", "ddp-powersgd-r1", "ddp-powersgd-r4",
                   "horovod-fp32", "horovod-fp16", "cgx-8bit", "cgx-4bit", "cgx-2bit-ef", "cgx-auto",
                   "cgx-4bit-sfb", "cgx-planned", "cgx-planned-sfb")
POWERSGD_START = 10  # exact allreduce for the first steps (PyTorch's start_powerSGD_iter)
_CGX = re.compile(r"^cgx-(?:(?P<bits>[1-8])bit(?P<flags>(?:-ef|-sfb|-flat)*)"
                  r"|(?P<mode>auto|planned|decide|exact|bf16|fp16)(?P<aflags>(?:-sfb|-flat)*))$")
_CAST_MODES = ("exact", "bf16", "fp16")  # cgx-<mode>: every gradient exact or cast, fused
_FIXED = {"ddp-fp32", "ddp-fp16", "ddp-bf16", "ddp-powersgd-r1", "ddp-powersgd-r4",
          "horovod-fp32", "horovod-fp16"}


def check(name: str) -> str:
    """The name, if it is a method; ValueError naming the choices otherwise."""
    from benchmarks.timetoacc import methods_diloco  # cgx-diloco-*, torch-postlocal-sgd
    from benchmarks.timetoacc import methods_fsdp  # fsdp-*, cgx-fsdp-*
    if name in _FIXED or _CGX.match(name) or methods_diloco.handles(name) \
            or methods_fsdp.handles(name):
        return name
    raise ValueError(f"unknown method {name!r}; choose from {sorted(_FIXED)}, "
                     "cgx-<1..8>bit[-ef][-sfb][-flat], cgx-auto[-flat], cgx-planned[-sfb][-flat], "
                     "cgx-decide[-flat], cgx-exact, cgx-bf16, cgx-fp16, "
                     "cgx-diloco-h<N>, cgx-diloco-auto, cgx-diloco-streaming, "
                     "cgx-localsgd[-h<N>], torch-postlocal-sgd[-h<N>], "
                     "torchft-diloco[-streaming][-h<N>], "
                     "or one of "
                     f"{', '.join(methods_fsdp.FSDP_METHODS)}")


def family(name: str) -> str:
    return name.split("-")[0]


@dataclasses.dataclass
class Setup:
    module: object  # what the forward pass calls (a DDP wrapper or the model)
    optimizer: object
    accounted_bytes: Callable[[int], float]  # steps done -> bytes this rank sent, by the method's count
    compression_seconds: Callable[[], float] = lambda: 0.0
    close: Callable[[], None] = lambda: None
    plan: Callable[[], Optional[str]] = lambda: None  # cgx-auto: the current per-layer plan
    barrier: Optional[Callable[[], None]] = None  # None: torch.distributed's
    note: str = ""
    # Sharded models (FSDP): every rank calls evaluate(workload's evaluate) -> its result;
    # None: rank 0 alone evaluates the model
    evaluate: Optional[Callable[[Callable], dict]] = None


def bf16_gloo_hook(process_group, bucket):
    """DDP's ``bf16_compress_hook`` for Gloo: the bucket cast to bfloat16 and divided by
    the world size, allreduced, cast back. (DDP refuses any hook *named*
    ``bf16_compress_hook`` unless CUDA and NCCL are there; Gloo reduces bfloat16.)"""
    import torch
    import torch.distributed as dist
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f):
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(decompress)


def powersgd_values(model, rank: int, min_rate: float = 2.0) -> int:
    """Values one PowerSGD step allreduces (PyTorch's hook: P and Q per compressed matrix)."""
    total = 0
    for p in model.parameters():
        if p.dim() < 2:
            total += p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        low = (n + m) * min(rank, n, m)
        total += low if low * min_rate < n * m else p.numel()
    return total


def build(name: str, model, make_optimizer, world: int) -> Setup:
    check(name)
    params = sum(p.numel() for p in model.parameters())
    from benchmarks.timetoacc import methods_diloco
    if methods_diloco.handles(name):
        return Setup(**methods_diloco.build(name, model, make_optimizer, world))
    from benchmarks.timetoacc import methods_fsdp
    if methods_fsdp.handles(name):
        return Setup(**methods_fsdp.build(name, model, make_optimizer, world))
    if name.startswith("ddp"):
        return _ddp(name, model, make_optimizer, world, params)
    if name.startswith("horovod"):
        return _horovod(name, model, make_optimizer, world, params)
    return _cgx(name, model, make_optimizer)


def _ddp(name, model, make_optimizer, world, params) -> Setup:
    from torch.nn.parallel import DistributedDataParallel as DDP
    if name.startswith("ddp-powersgd"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        r = int(name.rsplit("-r", 1)[1])
        # PyTorch's PowerSGD hook issues its collectives in a different order on
        # different ranks when several buckets are in flight (Gloo then fails with
        # "Received data size doesn't match expected size"); one bucket avoids it.
        ddp = DDP(model, bucket_cap_mb=1024)
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                 start_powerSGD_iter=POWERSGD_START, min_compression_rate=2,
                                 use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
        low = powersgd_values(model, r)

        def accounted(steps: int) -> float:
            exact = min(steps, POWERSGD_START)
            return ring_bytes(4 * (exact * params + (steps - exact) * low), world)

        return Setup(ddp, make_optimizer(ddp.parameters()), accounted,
                     note=f"rank {r}, error feedback, warm start, exact for {POWERSGD_START} steps")
    ddp = DDP(model)
    width = 4
    if name in ("ddp-fp16", "ddp-bf16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook if name == "ddp-fp16"
                               else bf16_gloo_hook)
        width = 2
    return Setup(ddp, make_optimizer(ddp.parameters()),
                 lambda steps: ring_bytes(width * params * steps, world))


def _horovod(name, model, make_optimizer, world, params) -> Setup:
    """Horovod's own Gloo controller, its rendezvous served by rank 0 (as horovodrun does).

    Once Horovod's library is loaded, torch.distributed's Gloo must not be used
    in the process any more (both carry a Gloo and the symbols clash: torch's
    next collective connects to the wrong address), so Horovod's own barrier
    synchronizes the ranks from then on.
    """
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    host, hosts = int(os.environ.get("GROUP_RANK", rank)), int(os.environ.get("GROUP_WORLD_SIZE", world))
    port = torch.zeros(1, dtype=torch.int64)
    server = None
    if rank == 0:
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.http.http_server import RendezvousServer
        server = RendezvousServer()
        port[0] = server.start()
        server.init(get_host_assignments(
            parse_hosts(",".join(f"host{h}:{local_size}" for h in range(hosts))), world))
    dist.broadcast(port, 0)
    os.environ.update(
        HOROVOD_GLOO_RENDEZVOUS_ADDR=os.environ["MASTER_ADDR"],
        HOROVOD_GLOO_RENDEZVOUS_PORT=str(int(port)), HOROVOD_CONTROLLER="gloo",
        HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE=os.environ["GLOO_SOCKET_IFNAME"],
        HOROVOD_HOSTNAME=f"host{host}", HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(world),
        HOROVOD_LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"), HOROVOD_LOCAL_SIZE=str(local_size),
        HOROVOD_CROSS_RANK=str(host), HOROVOD_CROSS_SIZE=str(hosts))
    import horovod.torch as hvd
    hvd.init()
    fp16 = name == "horovod-fp16"
    opt = hvd.DistributedOptimizer(
        make_optimizer(model.parameters()), named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)

    def close():
        hvd.shutdown()
        if server is not None:
            server.stop()

    return Setup(model, opt, lambda steps: ring_bytes((2 if fp16 else 4) * params * steps, world),
                 close=close, barrier=hvd.barrier)


def _cgx(name, model, make_optimizer) -> Setup:
    m = _CGX.match(name)
    flags = (m.group("flags") or m.group("aflags") or "").split("-")
    if "flat" in flags:
        os.environ["CGX_HIERARCHICAL"] = "off"
    hvd = init_cgx(model)
    if m.group("bits"):
        comp = hvd.Compression.quantize(bits=int(m.group("bits")), error_feedback="ef" in flags)
    elif m.group("mode") == "planned":
        comp = hvd.Compression.planned()
    elif m.group("mode") == "decide":
        comp = hvd.Compression.auto(objective="time", window=10)
    elif m.group("mode") in _CAST_MODES:
        comp = getattr(hvd.Compression, m.group("mode"))
    else:
        comp = hvd.Compression.auto(alpha=1.0, window=10, adjust_every=50)
    opt = hvd.DistributedOptimizer(make_optimizer(model.parameters()),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   sufficient_factors=model if "sfb" in flags else None)
    accounted, compression_seconds = cgx_counters(hvd)

    def plan() -> Optional[str]:
        if m.group("bits") or m.group("mode") in _CAST_MODES:
            return None
        if m.group("mode") == "planned":
            from cgx.policy.planner import format_exchange as planned_table
            return planned_table(opt.exchange_plan(), limit=12)
        from cgx.policy.levels import format_levels
        if m.group("mode") == "decide" and opt.exchange_trials():
            from cgx.policy.trials import PlanRecord, format_trials
            last = opt.exchange_trials()[-1]
            records = [PlanRecord(**p) for p in last["plans"]]
            kept = [r.label for r in records].index(last["chosen"])
            return format_trials(records, kept) + "\n\n" + format_levels(opt.compression_plan())
        return format_levels(opt.compression_plan())

    return Setup(model, opt, accounted, compression_seconds, plan=plan)
