"""compression="auto" in numbers: solver speed, and bytes vs accuracy against uniform 4-bit.

1. The solver: 300 layers x 20 candidates (costs falling, errors rising with the
   level, as real layers do), median of repeated solves.
2. Training: 2 ranks (Gloo on this machine) train an MLP on scikit-learn's
   digits with fp32, uniform 4-bit (bucket 1024) and ``auto`` (alpha 1.0)
   exchanges; bytes sent per step and test accuracy per method.

Usage::

    .venv/bin/python benchmarks/adaptive.py [--epochs 8] [--out docs/results/adaptive]

Writes ``<out>.json`` and ``<out>.md`` and prints the tables.
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

import numpy as np

METHODS = ("fp32", "uniform 4-bit", "auto (alpha 1.0)")


def bench_solver(layers: int = 300, candidates: int = 20, reps: int = 7) -> dict:
    from cgx.adaptive import solve
    rng = np.random.default_rng(0)
    errors = np.sort(rng.uniform(0, 1, (layers, candidates)), axis=1)
    costs = np.sort(rng.uniform(1, 100, (layers, candidates)), axis=1)[:, ::-1]
    ref = [candidates // 4] * layers
    budget = float(sum(errors[i][j] for i, j in enumerate(ref)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan = solve(costs, errors, budget, reference=ref)
        times.append(time.perf_counter() - t0)
    ref_cost = float(sum(costs[i][j] for i, j in enumerate(ref)))
    return {"layers": layers, "candidates": candidates, "median_ms": 1e3 * statistics.median(times),
            "cost_vs_reference": plan.cost / ref_cost, "error_vs_budget": plan.error / budget}


def _rank(rank, world, port, method, epochs, out):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import cgx.torch as hvd
    from sklearn.datasets import load_digits
    hvd.init()
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    train_x, train_y, test_x, test_y = X[:1400], y[:1400], X[1400:], y[1400:]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    comp = {"fp32": hvd.Compression.exact,
            "uniform 4-bit": hvd.Compression.quantize(bits=4, bucket_size=1024),
            "auto (alpha 1.0)": hvd.Compression.auto(alpha=1.0, window=10, adjust_every=40)
            }[method]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp)
    g = torch.Generator().manual_seed(rank)
    steps = 0
    before = hvd.stats().wire_bytes
    for _ in range(epochs):
        order = torch.randperm(len(train_x), generator=g)[rank::world]
        for i in range(0, len(order) - 31, 32):
            idx = order[i:i + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(train_x[idx]), train_y[idx]).backward()
            opt.step()
            steps += 1
    wire = (hvd.stats().wire_bytes - before) / steps
    with torch.no_grad():
        acc = float((model(test_x).argmax(1) == test_y).float().mean())
    if rank == 0:
        from cgx.adaptive import format_plan
        with open(out, "w") as f:
            json.dump({"bytes_per_step": wire, "accuracy": acc, "steps": steps,
                       "plan": format_plan(opt.compression_plan())}, f)
    dist.destroy_process_group()


def bench_training(epochs: int) -> dict:
    import torch.multiprocessing as mp
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            out = os.path.join(tmp, "r.json")
            mp.start_processes(_rank, args=(2, port, method, epochs, out), nprocs=2,
                               start_method="spawn")
            with open(out) as f:
                results[method] = json.load(f)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--out", default="docs/results/adaptive")
    args = p.parse_args(argv)
    solver = bench_solver()
    train = bench_training(args.epochs)
    lines = ["Solver: %d layers x %d candidates: %.1f ms (median); cost %.2f x the uniform "
             "reference at %.3f of the error budget" % (
                 solver["layers"], solver["candidates"], solver["median_ms"],
                 solver["cost_vs_reference"], solver["error_vs_budget"]), "",
             "| exchange (2 ranks, digits MLP, %d epochs) | bytes sent/step/rank | vs 4-bit | "
             "test accuracy |" % args.epochs, "|---|---:|---:|---:|"]
    base = train["uniform 4-bit"]["bytes_per_step"]
    for m in METHODS:
        r = train[m]
        lines.append(f"| {m} | {r['bytes_per_step'] / 1e3:.1f} kB | "
                     f"{base / r['bytes_per_step']:.2f}x | {100 * r['accuracy']:.1f}% |")
    lines += ["", "Last auto plan (rank 0):", "", train["auto (alpha 1.0)"]["plan"]]
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"solver": solver, "training": train}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(f"`{' '.join([os.path.basename(sys.executable), *sys.argv])}` "
                "(2 cores, no GPU, 2 ranks on one machine)\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
