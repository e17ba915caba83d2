"""Throughput of the quantization kernels, next to a same-size memcpy.

    .venv/bin/python benchmarks/kernels.py                  # 64 MB, CPU: C path vs reference
    .venv/bin/python benchmarks/kernels.py --size-mb 16 --json kernels.json
    .venv/bin/python benchmarks/kernels.py --device cuda    # Triton kernels on a GPU

Figures are GB/s of float32 input (``numel * 4`` bytes per second, for every
operation, so rows compare directly): quantize+pack, dequantize and
dequantize+accumulate at 2/4/8 bits, nearest and stochastic rounding. On CPU
each is run on one thread (``torch.set_num_threads(1)``, the C path with
``threads=1``) and on all cores; the memcpy baseline is ``dst.copy_(src)``
on preallocated tensors under the same thread setting. The eager torch
reference (the spec) is timed on a smaller buffer (``--ref-mb``) because it
is two orders of magnitude slower; its GB/s do not depend much on the size.

Each figure is the median of ``--reps`` timed runs after one warm-up run. On
a shared machine the figures are noisy: compare columns of one table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from cgx.console import progress

from cgx.quant import cpu, wire
from cgx.kernels import reference

BUCKET = 1024


def _time(fn, reps: int, sync=lambda: None, baseline=None) -> tuple[float, float]:
    """Median seconds of ``reps`` calls of ``fn`` (after one warm-up call).

    With ``baseline`` (the memcpy), each timed call of ``fn`` is followed by a
    timed call of it, and its median comes back too: on a shared machine the
    ratio of the two drifts much less than either figure.
    """
    fn()
    sync()
    times, base = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if baseline is not None:
            t0 = time.perf_counter()
            baseline()
            sync()
            base.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.median(base) if base else float("nan")


def _cases(bits_list):
    for bits in bits_list:
        for rounding in ("nearest", "stochastic"):
            yield "quantize", bits, rounding
        yield "dequantize", bits, "-"
        yield "dequantize+acc", bits, "-"


def _op(impl: str, op: str, x: torch.Tensor, bits: int, rounding: str, threads: int):
    """A zero-argument callable running one operation on preallocated buffers."""
    n = x.numel()
    stochastic = rounding == "stochastic"
    payload = torch.empty(wire.packed_nbytes(n, bits, BUCKET), dtype=torch.uint8,
                          device=x.device)
    out = torch.empty_like(x)
    if impl == "c":
        cpu.quantize(x, bits, BUCKET, False, out=payload)
        if op == "quantize":
            return lambda: cpu.quantize(x, bits, BUCKET, stochastic, key=1, out=payload,
                                        threads=threads)
        acc = op == "dequantize+acc"
        return lambda: cpu.dequantize(payload, n, bits, BUCKET, out=out, accumulate=acc,
                                      threads=threads)
    if impl == "triton":
        from cgx.kernels import dequantize as tdq
        from cgx.kernels import quantize as tq
        tq.quantize(x, bits, BUCKET, False, out=payload)
        if op == "quantize":
            return lambda: tq.quantize(x, bits, BUCKET, stochastic, key=1, out=payload)
        acc = op == "dequantize+acc"
        return lambda: tdq.dequantize(payload, n, bits, BUCKET, out=out, accumulate=acc)
    # the eager reference allocates its own outputs: that is part of its cost
    ref_payload = reference.quantize(x, bits, BUCKET, False)
    if op == "quantize":
        return lambda: reference.quantize(x, bits, BUCKET, stochastic, key=1)
    acc = op == "dequantize+acc"
    return lambda: reference.dequantize(ref_payload, n, bits, BUCKET, out=out, accumulate=acc)


def run_cpu(args) -> list[dict]:
    if not cpu.available():
        sys.exit(f"the C path is not built ({cpu.unavailable_reason()}); run `make ext` first")
    n = int(args.size_mb * (1 << 20)) // 4
    n_ref = int(args.ref_mb * (1 << 20)) // 4
    cores = args.threads or os.cpu_count() or 1
    thread_settings = [1] if cores == 1 else [1, cores]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen)
    x_ref = x[:n_ref].clone()
    cases = list(_cases(args.bits))
    total = len(thread_settings) * (1 + 2 * len(cases))
    records = []
    with progress(total=total, desc="kernels", unit="run") as bar:
        for threads in thread_settings:
            torch.set_num_threads(threads)
            dst = torch.empty_like(x)
            memcpy = lambda: dst.copy_(x)  # noqa: E731
            t, _ = _time(memcpy, args.reps)
            records.append(dict(op="memcpy", bits=None, rounding="-", impl="torch",
                                threads=threads, numel=n, seconds=t, gbps=n * 4 / t / 1e9))
            bar.update()
            for op, bits, rounding in cases:
                for impl, xx, reps in (("c", x, args.reps), ("reference", x_ref, args.ref_reps)):
                    bar.set_postfix_str(f"{impl} {op} {bits}b {rounding} x{threads}")
                    t, t_copy = _time(_op(impl, op, xx, bits, rounding, threads), reps,
                                      baseline=memcpy)
                    records.append(dict(op=op, bits=bits, rounding=rounding, impl=impl,
                                        threads=threads, numel=xx.numel(), seconds=t,
                                        gbps=xx.numel() * 4 / t / 1e9,
                                        memcpy_gbps=n * 4 / t_copy / 1e9))
                    bar.update()
    return records


def run_cuda(args) -> list[dict]:
    n = int(args.size_mb * (1 << 20)) // 4
    x = torch.randn(n, device="cuda")
    dst = torch.empty_like(x)
    sync = torch.cuda.synchronize
    cases = list(_cases(args.bits))
    records = []
    with progress(total=1 + len(cases), desc="kernels", unit="run") as bar:
        memcpy = lambda: dst.copy_(x)  # noqa: E731
        t, _ = _time(memcpy, args.reps, sync)
        records.append(dict(op="memcpy", bits=None, rounding="-", impl="torch", threads=0,
                            numel=n, seconds=t, gbps=n * 4 / t / 1e9))
        bar.update()
        for op, bits, rounding in cases:
            t, t_copy = _time(_op("triton", op, x, bits, rounding, 1), args.reps, sync, memcpy)
            records.append(dict(op=op, bits=bits, rounding=rounding, impl="triton", threads=0,
                                numel=n, seconds=t, gbps=n * 4 / t / 1e9,
                                memcpy_gbps=n * 4 / t_copy / 1e9))
            bar.update()
    return records


def table(records: list[dict], device: str) -> str:
    """Markdown table: one row per (op, bits, rounding), one column per implementation.

    Cells read "GB/s (% of the memcpy timed alternately with it)".
    """
    memcpy = {r["threads"]: r["gbps"] for r in records if r["op"] == "memcpy"}
    cols = sorted({(r["impl"], r["threads"]) for r in records if r["op"] != "memcpy"},
                  key=lambda c: (c[0] != "c", c[0] != "triton", c[1]))

    def name(impl, threads):
        label = {"c": "C", "triton": "Triton", "reference": "torch reference"}[impl]
        if device == "cuda":
            return f"{label} (GPU)"
        return f"{label}, {threads} thread{'s' if threads > 1 else ''}"

    lines = ["| op | bits | rounding | " + " | ".join(name(*c) for c in cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    lines.append("| memcpy | | | " + " | ".join(f"{memcpy.get(c[1], float('nan')):.2f}"
                                                for c in cols) + " |")
    keys = []
    for r in records:
        k = (r["op"], r["bits"], r["rounding"])
        if r["op"] != "memcpy" and k not in keys:
            keys.append(k)
    for op, bits, rounding in keys:
        by = {(r["impl"], r["threads"]): r for r in records
              if (r["op"], r["bits"], r["rounding"]) == (op, bits, rounding)}
        cells = [f"{by[c]['gbps']:.2f} ({100 * by[c]['gbps'] / by[c]['memcpy_gbps']:.0f}%)"
                 if c in by else "" for c in cols]
        lines.append(f"| {op} | {bits} | {rounding} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=64.0, help="float32 buffer size (MiB)")
    p.add_argument("--ref-mb", type=float, default=4.0,
                   help="buffer size for the slow eager reference (MiB)")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--reps", type=int, default=5, help="timed runs per figure (median)")
    p.add_argument("--ref-reps", type=int, default=2, help="timed runs of the reference")
    p.add_argument("--threads", type=int, default=0,
                   help="threads of the multi-threaded columns (default: all cores)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", metavar="PATH", help="also write the raw figures as JSON")
    args = p.parse_args(argv)

    records = run_cuda(args) if args.device == "cuda" else run_cpu(args)
    info = dict(device=args.device, size_mb=args.size_mb, ref_mb=args.ref_mb,
                bucket=BUCKET, simd=cpu.simd_path() if cpu.available() else None,
                cpu_count=os.cpu_count(), torch=torch.__version__)
    print(f"\n{args.size_mb:g} MiB float32 (reference: {args.ref_mb:g} MiB), bucket {BUCKET}; "
          f"GB/s of float32 input (% of a same-size memcpy timed alternately, same threads); "
          f"C path: {info['simd']}\n")
    print(table(records, args.device))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(info=info, records=records), indent=1))


if __name__ == "__main__":
    main()
