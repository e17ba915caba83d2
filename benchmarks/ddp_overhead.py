"""What DDP itself costs a step, beside what cgx's exchange costs, on loopback.

VGG-11 (benchmarks/training.py's model, 28 M parameters), batch 8 per rank, SGD, one
thread per rank, 2 ranks on this machine (Gloo over 127.0.0.1, no shaped link). Every
route is built once in the same processes and the routes take one step each in turn, for
``--steps`` turns after ``--warmup``: a slow minute of the machine slows every route alike.
A step's CPU is the rank's process time (every thread: the engine's too) over that step.

    .venv/bin/python benchmarks/ddp_overhead.py --steps 40 --out docs/results/ddp-overhead

Routes: ``compute`` (no DDP, no exchange), ``ddp-noop`` / ``ddp-noop-view`` (DDP with a
comm hook that returns the bucket untouched: DDP's own bookkeeping and copies, without and
with ``gradient_as_bucket_view=True``), ``cgx-optimizer`` (``DistributedOptimizer``, fixed
4-bit), ``cgx-ddp-hook`` / ``cgx-ddp-hook-view`` (DDP with ``cgx_hook``, fixed 4-bit, without
and with bucket views). Each row: the median step and CPU of rank 0, and its CPU over the
``compute`` route's.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.outputs import save  # noqa: E402

ROUTES = ["compute", "ddp-noop", "ddp-noop-view", "cgx-optimizer", "cgx-ddp-hook",
          "cgx-ddp-hook-view"]


def rank_main(rank: int, world: int, port: int, routes: list, steps: int, warmup: int,
              batch: int) -> dict:
    """One rank: every route's per-step wall and CPU seconds."""
    import torch
    import torch.distributed as dist

    from benchmarks.training import torch_method

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)
    step = {r: torch_method(r, x, y).step for r in routes}
    times: dict = {r: {"wall_s": [], "cpu_s": []} for r in routes}
    for turn in range(warmup + steps):
        for r in routes:
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            step[r]()
            if turn >= warmup:
                times[r]["wall_s"].append(time.perf_counter() - t)
                times[r]["cpu_s"].append(time.process_time() - c)
    dist.barrier()
    dist.destroy_process_group()
    return times


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    times = rank_main(rank, world, port, args.routes, args.steps, args.warmup, args.batch)
    if rank == 0:
        queue.put(times)


def measure(args) -> dict:
    """Every route's rank-0 step times, from 2 processes on loopback."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(2, port, args, queue), nprocs=2, start_method="spawn")
    return queue.get()


def summarize(times: dict, routes: list) -> list[dict[str, Any]]:
    """Per route: the median step and CPU seconds, and the CPU over ``compute``'s."""
    base = statistics.median(times["compute"]["cpu_s"]) if "compute" in times else None
    rows = []
    for r in routes:
        cpu = statistics.median(times[r]["cpu_s"])
        rows.append({"route": r, "step_s": statistics.median(times[r]["wall_s"]),
                     "cpu_s": cpu, "cpu_over_compute_s": None if base is None else cpu - base})
    return rows


def table(rows: list, args) -> str:
    cmd = " ".join([".venv/bin/python benchmarks/ddp_overhead.py", *args.argv])
    lines = [f"`{cmd}` (2 ranks on one machine of {os.cpu_count()} cores, loopback, batch "
             f"{args.batch}, {args.steps} turns after {args.warmup}, rank 0's medians)", "",
             "| route | s/step | CPU s/step | CPU over compute |", "|---|---:|---:|---:|"]
    for r in rows:
        over = "" if r["cpu_over_compute_s"] is None else f"{r['cpu_over_compute_s'] * 1e3:+.1f} ms"
        lines.append(f"| {r['route']} | {r['step_s']:.3f} | {r['cpu_s']:.3f} | {over} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routes", type=lambda s: [x for x in s.split(",") if x], default=ROUTES,
                   help=f"from {ROUTES}")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/ddp-overhead")
    args = p.parse_args(argv)
    bad = [r for r in args.routes if r not in ROUTES]
    if bad:
        p.error(f"routes {bad}: choose from {ROUTES}")
    args.argv = argv
    rows = summarize(measure(args), args.routes)
    save(args.out, {"batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                    "rows": rows}, table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
