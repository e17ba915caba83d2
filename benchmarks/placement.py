"""Where a CUDA tensor's compression runs, measured beside GPU compute, against the model.

    python3 benchmarks/placement.py --json placement.json      # needs a CUDA device

For gradients on a GPU, ``cgx.policy.planner.placement`` decides per tensor between the Triton
kernels (fast, but they share the GPU with backward's kernels) and the host's C path on
pinned copies (slow, two trips over PCIe, but the GPU keeps computing). This measures
both on the machine it runs on and checks the model's decision against the clock:

1. the device profile, as the planned mode measures it (``calibrate_device``);
2. for each gradient size and each length of a GPU compute load (back-to-back bf16 matrix
   products on their own stream, standing for the backward pass still running when the
   gradient is ready): the compute alone, each placement's exchange work alone (quantize
   then dequantize-and-accumulate, 4 bits, stochastic rounding; no network), and each
   placement started beside the compute: the time until both are done;
3. what the model predicts for each (``placement.costs``: the lanes' seconds, and what
   the GPU's kernels take from the compute) and which placement ``placement.decide``
   picks with the compute as its slack, next to the one the clock found faster.

Each figure is the median of ``--reps`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cgx.collectives import offload
from cgx.collectives.offload import Placement
from cgx.policy.planner import placement
from cgx.quant import codec
from cgx.quant.codec import QuantSpec

MATMUL = 4096  # the compute load's square bf16 matrices


def _median_s(fn, reps: int) -> float:
    """The median seconds of ``fn`` to its kernels' end (as ``calibrate_device`` times)."""
    return placement._seconds(fn, torch.cuda.synchronize, reps)


class Load:
    """``count`` bf16 matrix products on a stream of their own (the backward pass)."""

    def __init__(self, compute_ms: float, reps: int):
        self.stream = torch.cuda.Stream()
        self.a = torch.randn(MATMUL, MATMUL, device="cuda", dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        one = _median_s(lambda: torch.matmul(self.a, self.a, out=self.c), max(1, reps))
        self.count = max(1, round(compute_ms / 1e3 / one))

    def start(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.count):
                torch.matmul(self.a, self.a, out=self.c)


class Exchange:
    """One gradient's compression work at a placement: quantize, then decode the payload
    accumulating into a sum (the reduction's two ends, without the network)."""

    def __init__(self, numel: int, spec: QuantSpec, threads: int):
        self.x = torch.randn(numel, device="cuda")
        self.acc = torch.zeros_like(self.x)
        self.spec, self.threads, self.numel = spec, threads, numel
        self.payload = codec.quantize(self.x, spec)

    def run(self, where: Placement) -> None:
        q, dq = (codec.quantize, codec.dequantize) if where is Placement.GPU \
            else (offload.quantize, offload.dequantize)
        kw = {} if where is Placement.GPU else {"threads": self.threads}
        q(self.x, self.spec, out=self.payload, key=1, **kw)
        dq(self.payload, self.numel, self.spec, out=self.acc, accumulate=True, **kw)


def predicted(numel: int, spec: QuantSpec, profile) -> dict:
    """The model's costs of both placements of one compress + decompress of ``numel``
    float32 values (one collective call each way)."""
    nbytes = 4 * numel
    return placement.costs(compress_s=nbytes / 1e9, decompress_s=nbytes / 1e9,
                           bytes_sent=spec.nbytes(numel), numel=numel, collectives=1,
                           compress_bps=1e9, decompress_bps=1e9, contention=0.0,
                           device=profile)


def measure_cell(size_mb: float, compute_ms: float, profile, args) -> dict:
    spec = QuantSpec(bits=args.bits, bucket_size=args.bucket)
    numel = int(size_mb * (1 << 20)) // 4
    load, ex = Load(compute_ms, args.reps), Exchange(numel, spec, args.offload_threads)
    compute_s = _median_s(load.start, args.reps)
    row = {"size_mb": size_mb, "numel": numel, "compute_ms": 1e3 * compute_s,
           "matmuls": load.count}
    model = predicted(numel, spec, profile)
    for where in (Placement.GPU, Placement.CPU_OFFLOAD):
        alone = _median_s(lambda: ex.run(where), args.reps)

        def both():
            load.start()
            ex.run(where)

        together = _median_s(both, args.reps)
        c = model[where]
        lanes = c.compress_s + c.decompress_s
        row[where.value] = {
            "alone_ms": 1e3 * alone, "together_ms": 1e3 * together,
            "added_ms": 1e3 * (together - compute_s),
            "predicted_lanes_ms": 1e3 * lanes, "predicted_taken_ms": 1e3 * c.compute_s,
            "predicted_together_ms": 1e3 * max(compute_s + c.compute_s, lanes)}
    chosen = placement.decide([model], slack_s=compute_s)
    faster = min((Placement.GPU, Placement.CPU_OFFLOAD),
                 key=lambda p: row[p.value]["together_ms"])
    gap = abs(row["gpu"]["together_ms"] - row["cpu"]["together_ms"])
    row.update(decided=chosen.value, faster=faster.value, gap_ms=gap,
               agrees=chosen is faster or gap <= args.tie_pct / 100 * row["compute_ms"])
    return row


def _print_profile(p) -> None:
    print(f"device profile ({p.source}):")
    print(f"  GPU kernels: quantize {p.gpu_quantize_gbps:.1f} GB/s, dequantize+accumulate "
          f"{p.gpu_dequantize_gbps:.1f} GB/s")
    for (t, q), (_, d) in zip(p.host_quantize_gbps, p.host_dequantize_gbps):
        print(f"  host C path, {t} thread(s): quantize {q:.2f} GB/s, dequantize+accumulate "
              f"{d:.2f} GB/s")
    print(f"  pinned copies: device to host {p.d2h_gbps:.1f} GB/s, host to device "
          f"{p.h2d_gbps:.1f} GB/s; an offloaded call's fixed cost {4e3 * p.copy_s:.2f} ms "
          f"(quantize and decode)")


def _print_rows(rows: list) -> None:
    print("\n| MB | compute ms | GPU: alone / beside (added) ms | predicted added | "
          "offload: alone / beside (added) ms | predicted lanes | decided | faster |")
    print("|---:|---:|---|---:|---|---:|---|---|")
    for r in rows:
        g, c = r["gpu"], r["cpu"]
        print(f"| {r['size_mb']:g} | {r['compute_ms']:.1f} | {g['alone_ms']:.2f} / "
              f"{g['together_ms']:.2f} ({g['added_ms']:+.2f}) | "
              f"{g['predicted_together_ms'] - r['compute_ms']:+.2f} | {c['alone_ms']:.2f} / "
              f"{c['together_ms']:.2f} ({c['added_ms']:+.2f}) | {c['predicted_lanes_ms']:.2f} | "
              f"{r['decided']} | {r['faster']}{'' if r['agrees'] else ' (disagrees)'} |")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=float, nargs="+", default=[4.0, 64.0, 512.0],
                    help="gradient sizes (MiB of float32)")
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[5.0, 50.0],
                    help="lengths of the GPU compute load beside the exchange")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=1024)
    ap.add_argument("--offload-threads", type=int, default=1,
                    help="host threads of an offloaded call (CGX_CPU_THREADS)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tie-pct", type=float, default=2.0,
                    help="a decision counts as right when the two placements' times differ "
                         "by at most this %% of the compute")
    ap.add_argument("--json", type=Path, help="write the profile and every row here")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/placement.py measures a CUDA device and torch sees none here "
                 "(torch.cuda.is_available() is False); run it on a GPU machine")
    threads = sorted({1, args.offload_threads})
    profile = placement.calibrate_device(threads=threads, bits=args.bits,
                                         bucket_size=args.bucket)
    _print_profile(profile)
    rows = [measure_cell(s, c, profile, args) for c in args.compute_ms for s in args.size_mb]
    _print_rows(rows)
    right = sum(r["agrees"] for r in rows)
    print(f"\nthe model's placement matches the clock in {right} of {len(rows)} cases "
          f"(a gap under {args.tie_pct:g}% of the compute counts as a tie)")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                         "torch": torch.__version__,
                                         "profile": profile.to_dict(), "rows": rows,
                                         "args": {k: v for k, v in vars(args).items()
                                                  if k != "json"}}, indent=1))


if __name__ == "__main__":
    main()
