"""What the randomized Hadamard rotation (``QuantSpec(rotate=True)``) buys and costs.

    .venv/bin/python benchmarks/rotation.py                      # LM gradients + C throughput
    .venv/bin/python benchmarks/rotation.py --device cuda        # Triton kernels on a GPU
    .venv/bin/python benchmarks/rotation.py --quick              # smoke run (seconds)

1. Error: the transformer LM of ``benchmarks/timetoacc/workloads.py`` trains a few
   AdamW steps on one process; the gradients of the last ``--grad-steps`` steps are
   quantized tensor by tensor (as ``Compression.quantize`` does) at 2, 3 and 4 bits,
   with and without rotation, nearest and stochastic rounding. Figure: relative L2
   error ``||Q(g) - g|| / ||g||`` over all tensors of a step, mean over the steps.
2. Throughput: quantize and dequantize of ``--size-mb`` of float32 through
   ``cgx.quant.codec`` (the C path with ``--threads`` on CPU, the Triton kernels with
   ``--device cuda``), plain and rotated, as GB/s of float32 input and as % of a
   same-size memcpy (``dst.copy_(src)``) timed right after each run; median of
   ``--reps`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timetoacc import workloads  # noqa: E402
from cgx.config import Rounding  # noqa: E402
from cgx.quant import wire  # noqa: E402
from cgx.quant.codec import QuantSpec, dequantize, quantize  # noqa: E402


def lm_gradients(steps: int, keep: int, tiny: bool, seed: int) -> list[list[torch.Tensor]]:
    """The LM's gradients (one list per step) of the last ``keep`` of ``steps`` AdamW steps."""
    w = workloads.make("lm", rank=0, world=1, seed=seed, tiny=tiny)
    opt = w.optimizer(w.model.parameters())
    kept = []
    for step in range(steps):
        opt.zero_grad()
        w.loss_fn(w.model, w.train_batch(step)).backward()
        if step >= steps - keep:
            kept.append([p.grad.detach().clone().view(-1) for p in w.model.parameters()
                         if p.grad is not None])
        opt.step()
    return kept


def relative_error(grads: list[torch.Tensor], spec: QuantSpec, step: int) -> float:
    """||Q(g) - g|| / ||g|| over all tensors of one step (each quantized on its own)."""
    err = norm = 0.0
    for i, g in enumerate(grads):
        key = wire.noise_key(0, step, i)
        rkey = wire.rotation_key(0, step, i)
        y = dequantize(quantize(g, spec, key=key, rotation_key=rkey), g.numel(), spec,
                       rotation_key=rkey)
        err += float((y - g).double().pow(2).sum())
        norm += float(g.double().pow(2).sum())
    return (err / norm) ** 0.5


def error_table(args) -> list[dict]:
    steps = lm_gradients(args.steps, args.grad_steps, args.quick, args.seed)
    numel = sum(g.numel() for g in steps[0])
    print(f"LM gradients: {len(steps[0])} tensors, {numel:,} values, last {len(steps)} "
          f"of {args.steps} steps, bucket {args.bucket}")
    print(f"{'bits':>4} {'rounding':>10} {'plain':>9} {'rotated':>9} {'ratio':>6}")
    records = []
    for bits in args.bits:
        for rounding in (Rounding.NEAREST, Rounding.STOCHASTIC):
            row = {}
            for rotate in (False, True):
                spec = QuantSpec(bits, args.bucket, rounding, rotate)
                row[rotate] = statistics.mean(relative_error(g, spec, s)
                                              for s, g in enumerate(steps))
            print(f"{bits:>4} {rounding.value:>10} {row[False]:>9.4f} {row[True]:>9.4f} "
                  f"{row[True] / row[False]:>6.2f}")
            records.append(dict(kind="error", bits=bits, rounding=rounding.value,
                                bucket=args.bucket, plain=row[False], rotated=row[True]))
    return records


def _time(fn, reps: int, sync, baseline) -> tuple[float, float]:
    """Median seconds of ``fn`` and of ``baseline`` timed right after it, ``reps`` times."""
    fn()
    baseline()
    sync()
    times, base = [], []
    for _ in range(reps):
        for f, out in ((fn, times), (baseline, base)):
            t0 = time.perf_counter()
            f()
            sync()
            out.append(time.perf_counter() - t0)
    return statistics.median(times), statistics.median(base)


def throughput_table(args) -> list[dict]:
    cuda = args.device == "cuda"
    n = int(args.size_mb * (1 << 20)) // 4
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(args.device)
    dst, out = torch.empty_like(x), torch.empty_like(x)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    backend, threads = ("triton", 1) if cuda else ("c", args.threads)
    print(f"\nthroughput on {args.device} ({backend}, threads={threads}), {args.size_mb} MB "
          f"float32, bucket {args.bucket}, stochastic rounding; % of memcpy")
    print(f"{'bits':>4} {'op':>10} {'plain GB/s':>10} {'%':>5} {'rotated GB/s':>12} {'%':>5}")
    records = []
    for bits in args.bits:
        for op in ("quantize", "dequantize"):
            cells = []
            for rotate in (False, True):
                spec = QuantSpec(bits, args.bucket, Rounding.STOCHASTIC, rotate)
                payload = quantize(x, spec, backend=backend, rotation_key=3)
                fn = (lambda: quantize(x, spec, out=payload, key=1, backend=backend,  # noqa: E731
                                       threads=threads, rotation_key=3)) if op == "quantize" \
                    else (lambda: dequantize(payload, n, spec, out=out, backend=backend,  # noqa
                                             threads=threads, rotation_key=3))
                t, t_copy = _time(fn, args.reps, sync, lambda: dst.copy_(x))
                gbps = n * 4 / t / 1e9
                cells.append((gbps, 100.0 * t_copy / t))
                records.append(dict(kind="throughput", device=args.device, backend=backend,
                                    threads=threads, bits=bits, op=op, rotate=rotate, numel=n,
                                    gbps=gbps, memcpy_gbps=n * 4 / t_copy / 1e9,
                                    pct_memcpy=100.0 * t_copy / t))
            print(f"{bits:>4} {op:>10} {cells[0][0]:>10.2f} {cells[0][1]:>5.1f} "
                  f"{cells[1][0]:>12.2f} {cells[1][1]:>5.1f}")
    return records


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--bucket", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30, help="LM training steps")
    ap.add_argument("--grad-steps", type=int, default=5, help="last steps whose grads count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size-mb", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=1, help="C path threads (CPU)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: the tiny LM, 3 steps, 1 MB, 2 reps")
    ap.add_argument("--skip-error", action="store_true", help="throughput only")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.grad_steps, args.size_mb, args.reps = 3, 1, 1.0, 2
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda needs a CUDA device, and torch sees none here "
                 "(torch.cuda.is_available() is False); run on a GPU machine or drop --device")
    torch.set_num_threads(max(1, args.threads))
    records = [] if args.skip_error else error_table(args)
    records += throughput_table(args)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
