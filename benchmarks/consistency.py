"""What the mismatch check costs: per-call latency of small functional allreduces, with and
without ``CGX_CHECK_CONSISTENCY`` (2 ranks, Gloo on this machine).

The check is one 16-byte MAX allreduce of a digest per functional collective
(optimizer steps carry it in their existing status exchange, DDP buckets once
per layout).

Usage::

    .venv/bin/python benchmarks/consistency.py [--calls 500] [--out docs/results/consistency]

Prints the table and, with ``--out``, writes it to ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time


def _rank(rank, world, port, check, calls, numel, out):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      CGX_CHECK_CONSISTENCY="1" if check else "0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import cgx.torch as hvd
    hvd.init()
    x = torch.ones(numel)
    for i in range(20):
        hvd.allreduce(x, name="warm")
    times = []
    for i in range(calls):
        t0 = time.perf_counter()
        hvd.allreduce(x, name="metric")
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(statistics.median(times)))
    dist.destroy_process_group()


def measure(check: bool, calls: int, numel: int) -> float:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t")
        mp.start_processes(_rank, args=(2, port, check, calls, numel, out), nprocs=2,
                           start_method="spawn")
        with open(out) as f:
            return float(f.read())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--out", help="also write <out>.json and <out>.md")
    args = p.parse_args(argv)
    lines = ["| allreduce size | check off | check on | added per call |", "|---:|---:|---:|---:|"]
    print("\n".join(lines))
    rows = []
    for numel in (256, 262144):
        off, on = measure(False, args.calls, numel), measure(True, args.calls, numel)
        rows.append({"bytes": numel * 4, "off_s": off, "on_s": on})
        lines.append(f"| {numel * 4 / 1024:g} KiB | {off * 1e6:.0f} us | {on * 1e6:.0f} us | "
                     f"{(on - off) * 1e6:.0f} us |")
        print(lines[-1])
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"calls": args.calls, "rows": rows}, f, indent=1)
        load = os.getloadavg()[0]  # other work on the machine slows every call
        with open(args.out + ".md", "w") as f:
            f.write(f"Command: `.venv/bin/python benchmarks/consistency.py --calls {args.calls} "
                    f"--out {os.path.relpath(args.out)}` (2 ranks, Gloo, one machine of "
                    f"{os.cpu_count()} cores, load average {load:.1f} at the end; the median "
                    "latency of one functional allreduce)\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
