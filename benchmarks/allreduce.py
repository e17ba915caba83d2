"""Allreduce over simulated slow links: Gloo fp32/fp16 against cgx's compressed algorithms.

Every (link rate, buffer size) pair runs in fresh ranks, each in its own
network namespace, joined by veth links shaped with ``tc tbf`` (see
``benchmarks/netsim``). Inside one launch all methods run side by side on the
same buffer, so their figures share the same conditions.

    sudo .venv/bin/python benchmarks/allreduce.py                       # full sweep
    .venv/bin/python benchmarks/allreduce.py --rates 1gbit --sizes 100  # one point

Per method and size: the time of one allreduce (median over repetitions of
the slowest rank), the bus bandwidth ``2 (N-1)/N * bytes / time`` of the fp32
buffer (what an uncompressed ring would have to achieve to match), the
speedup over Gloo fp32, for cgx the split of the time into compress,
reduce (decode + add + requantize), decompress and waiting on the wire, and the
bytes each rank sent per allreduce twice: as counted (cgx: handed to its transport;
Gloo: its ring allreduce, ``2 (N-1)/N * bytes``) and as the rank's link carried them
(its veth's counter, TCP/IP headers and the timing's barrier included).
Results: ``<out>.json``, ``<out>.md`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

from cgx.console import progress

METHODS = {
    # name: (kind, bits, algorithm)
    "gloo-fp32": ("gloo", 32, None),
    "gloo-fp16": ("gloo", 16, None),
    "cgx-sra-8bit": ("cgx", 8, "sra"),
    "cgx-sra-4bit": ("cgx", 4, "sra"),
    "cgx-sra-2bit": ("cgx", 2, "sra"),
    "cgx-ring-4bit": ("cgx", 4, "ring"),
    "cgx-allgather-4bit": ("cgx", 4, "allgather"),
}
MB = 10**6


# -- rank side (runs inside each namespace) -------------------------------------

def rank_main(size_mb: float, methods: list, reps: int, bucket: int, rounding: str,
              pipeline_mb: float) -> dict[str, Any]:
    """Time every method on a ``size_mb`` MB fp32 buffer; returns per-method figures."""
    import torch
    import torch.distributed as dist

    from cgx.collectives import Reducer
    from cgx.comm.torch_dist import TorchTransport
    from cgx.quant.codec import QuantSpec
    from cgx.config import Config, ReductionType, Rounding

    from benchmarks.netsim import link_tx_bytes

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = int(size_mb * MB) // 4
    src = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    exact = src.clone()
    dist.all_reduce(exact)
    exact /= world
    transport = TorchTransport()
    out: dict[str, Any] = {}
    for name in methods:
        kind, bits, algorithm = METHODS[name]
        reducer = Reducer(transport, Config(pipeline_chunk_mb=pipeline_mb)) if kind == "cgx" \
            else None
        spec = QuantSpec(bits, bucket, Rounding(rounding)) if kind == "cgx" else None
        times, phases, wire, tx0 = [], [], 0, 0
        for i in range(reps + 1):  # the first run warms up
            if i == 1:
                tx0 = link_tx_bytes()
            buf = src.clone()
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "gloo" and bits == 32:
                dist.all_reduce(buf)
                buf /= world
            elif kind == "gloo":
                half = buf.half()  # the cast is part of the cost a user pays
                dist.all_reduce(half)
                buf = half.float() / world
            else:
                stats = reducer.allreduce([buf], [spec], algorithm=ReductionType(algorithm))
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a collective is as slow as its slowest rank
            if i:
                times.append(dt.item())
                if kind == "cgx":
                    phases.append({k: v for k, v in stats.seconds.items() if not k.startswith("_")})
                    wire = stats.wire_bytes
        err = (buf - exact).abs().max().item()
        entry = {"times_s": times, "max_abs_error": err,
                 "link_bytes": (link_tx_bytes() - tx0) / reps,
                 "wire_bytes": wire if kind == "cgx" else
                 int(2 * (world - 1) / world * numel * (4 if bits == 32 else 2))}
        if phases:
            entry["phases_s"] = {k: statistics.median(p.get(k, 0.0) for p in phases)
                                 for k in phases[0]}
        out[name] = entry
    return {"world": world, "numel": numel, "methods": out}


# -- driver ----------------------------------------------------------------------

def _summarize(results: list[dict]) -> list[dict]:
    rows = []
    for res in results:
        base = statistics.median(res["methods"]["gloo-fp32"]["times_s"]) \
            if "gloo-fp32" in res["methods"] else None
        world, nbytes = res["world"], res["numel"] * 4
        for name, m in res["methods"].items():
            t = statistics.median(m["times_s"])
            rows.append({"rate": res["rate"], "size_mb": res["size_mb"], "method": name,
                         "time_s": t, "busbw_gbps": 2 * (world - 1) / world * nbytes / t / 1e9,
                         "speedup": base / t if base else None,
                         "wire_mb": m["wire_bytes"] / MB, "max_abs_error": m["max_abs_error"],
                         "link_mb": m["link_bytes"] / MB if "link_bytes" in m else None,
                         "phases_s": m.get("phases_s")})
    return rows


def _markdown(rows: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`", ""]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        lines += [f"### link: {rate}", "",
                  "| size | method | time (s) | bus bw (GB/s) | vs gloo fp32 | wire MB/rank "
                  "(counted) | MB/rank on the link | compress / reduce / decompress / wait (s) "
                  "| max abs err |",
                  "|---:|---|---:|---:|---:|---:|---:|---|---:|"]
        for r in (x for x in rows if x["rate"] == rate):
            ph = r["phases_s"]
            split = " / ".join(f"{ph.get(k, 0):.3f}" for k in
                               ("compress", "reduce", "decompress", "wait")) if ph else "-"
            speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
            link = f"{r['link_mb']:.1f}" if r.get("link_mb") is not None else "-"
            lines.append(f"| {r['size_mb']:g} MB | {r['method']} | {r['time_s']:.4f} | "
                         f"{r['busbw_gbps']:.2f} | {speed} | {r['wire_mb']:.1f} | {link} | "
                         f"{split} | {r['max_abs_error']:.2e} |")
        lines.append("")
    return "\n".join(lines)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["size_mb"], r["time_s"]) for r in rows
                         if r["rate"] == rate and r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method,
                    linestyle="--" if method.startswith("gloo") else "-")
        ax.set(xscale="log", yscale="log", xlabel="buffer (MB, fp32)", ylabel="allreduce time (s)",
               title=f"2 ranks, link {rate}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rates", default="1gbit,10gbit,none",
                   help="comma-separated tc rates; 'none' = unshaped veth")
    p.add_argument("--sizes", default="1,4,16,64,100,256", help="buffer sizes in MB (fp32)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {list(METHODS)}")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--bucket", type=int, default=1024)
    p.add_argument("--rounding", default="stochastic", choices=["stochastic", "nearest"])
    p.add_argument("--pipeline-mb", type=float, default=16.0,
                   help="largest pipeline block in MB (CGX_PIPELINE_CHUNK_MB)")
    p.add_argument("--out", default="benchmarks/results/allreduce",
                   help="output prefix (.json, .md, .png)")
    return p


def _sweep(args, methods: list, rates: list, sizes: list, bar) -> list:
    """One simulated network per (rate, size); rank 0's timings of each point.

    Raises:
        NetnsUnavailable: this machine cannot build the network.
    """
    from benchmarks.netsim import SlowNetwork

    results = []
    for rate in rates:
        for size in sizes:
            bar.set_postfix_str(f"{rate or 'unshaped'}, {size:g} MB")
            with SlowNetwork(n_ranks=args.ranks, rate=rate) as net:
                per_rank = net.run_function(
                    "benchmarks.allreduce:rank_main",
                    {"size_mb": size, "methods": methods, "reps": args.reps,
                     "bucket": args.bucket, "rounding": args.rounding,
                     "pipeline_mb": args.pipeline_mb},
                    timeout=600 + 30 * size)
            res = per_rank[0]
            res.update(rate=rate or "unshaped", size_mb=size)
            results.append(res)
            bar.update()
    return results


def _write(args, argv, results: list) -> None:
    """Write ``<out>.json``, ``.md`` and ``.png``; print the table."""
    rows = _summarize(results)
    command = "python benchmarks/allreduce.py " + " ".join(argv if argv is not None
                                                           else sys.argv[1:])
    md = _markdown(rows, command.strip())
    from benchmarks.outputs import save
    save(args.out, {"command": command, "results": results, "rows": rows}, md)
    _plot(rows, args.out + ".png")
    print(f"wrote {args.out}.json, .md, .png")


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    rates = [None if r.strip().lower() == "none" else r.strip() for r in args.rates.split(",")]
    sizes = [float(s) for s in args.sizes.split(",")]

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    from benchmarks.netsim import NetnsUnavailable

    bar = progress(total=len(rates) * len(sizes), desc="allreduce", unit="point")
    try:
        results = _sweep(args, methods, rates, sizes, bar)
    except NetnsUnavailable as exc:
        print(f"cannot build the simulated network: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    _write(args, argv, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
