"""The deciding exchange's decision time: model + solver for 300 tensors x 20 options.

What runs at each of ``Compression.auto(objective="time")``'s plans, after the measurements
(the window's errors, the link and quantizer calibration, which are timed apart in the
training benchmarks): the planner's simulated-step plan (cgx.policy.planner.plan), auto's knapsack
over the measured errors (fewest bytes within the budget), the proposals (the knapsack
again with the planner's exact tensors, each plan simulated on the planner's timeline) and
the selection of what is tried. Synthetic layers: 300 matrices from 64x64 to 1024x1024 with
measured errors (each candidate's error on a random gradient of the layer's shape, as auto
measures them), 20 candidates per layer (12 quantization levels, 4 top-k densities, 3
PowerSGD ranks, exact), 2 ranks at 1 Gbit/s.

Usage::

    .venv/bin/python benchmarks/deciding.py [--layers 300] [--reps 7] [--out docs/results/deciding]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.outputs import save  # noqa: E402


def _setup(layers: int, seed: int = 0):
    """The schedule (errors measured once) and the planner's tensors."""
    from cgx.policy.levels import AdaptiveSchedule
    from cgx.compression import Compression
    from cgx.config import Config
    from cgx.policy.planner.costs import TensorProfile
    g = torch.Generator().manual_seed(seed)
    sizes = [64, 128, 256, 512, 1024]
    shapes = [(sizes[i % 5], sizes[(i * 7) % 5]) for i in range(layers)]
    names = [f"layer{i}.weight" for i in range(layers)]
    settings = Compression.auto(objective="time", window=1, bits=(2, 3, 4, 8),
                                bucket_sizes=(512, 1024, 4096), densities=(0.001, 0.004, 0.01,
                                                                           0.04),
                                ranks=(1, 4, 16))
    sched = AdaptiveSchedule(names, shapes, [True] * layers, settings, Config(),
                             error_feedback=True)
    grads = [torch.randn(math.prod(s), generator=g) for s in shapes]
    sched.observe(0, list(range(layers)), grads)
    ready = sorted(float(x) for x in torch.rand(layers, generator=g))
    tensors = [TensorProfile(n, math.prod(s), 0.2 * t, s) for n, s, t in
               zip(names, shapes, ready)]
    return sched, tensors


def decide_once(sched, tensors, world: int = 2, gbit: float = 1.0) -> dict:
    """One decision, timed in its parts (seconds)."""
    from cgx.policy.trials import propose, select
    from cgx.policy.planner.costs import CostModel
    from cgx.policy.planner.strategy import plan
    one = types.SimpleNamespace(size=1, rank=0, device=torch.device("cpu"))
    cost = CostModel.uniform(world, gbit)
    t0 = time.perf_counter()
    exchange = plan(tensors, cost, 0.2, bits=(4,), families=("exact", "sra"))
    t1 = time.perf_counter()
    sched.replan(1, one)  # the knapsack over the measured errors (combined: one rank here)
    t2 = time.perf_counter()
    planned = types.SimpleNamespace(chosen=[o.name != "exact" for o in exchange.chosen],
                                    plan=exchange, family="sra")
    proposals = propose(sched, planned, list(sched.plan), world)
    tried = select(proposals, 2, lambda r: r.predicted_s)
    t3 = time.perf_counter()
    return {"model_s": t1 - t0, "solver_s": t2 - t1, "proposals_s": t3 - t2,
            "total_s": t3 - t0, "tried": [p.record.label for p in tried],
            "options": sum(len(c) for c in sched.candidates) / len(sched.candidates)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=300)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/deciding")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sched, tensors = _setup(args.layers)
    measured = sched.state_dict()  # the window's errors: each decision starts from them
    runs = []
    for _ in range(args.reps):
        sched.load_state_dict(measured)
        runs.append(decide_once(sched, tensors))
    med = {k: statistics.median(r[k] for r in runs) for k in ("model_s", "solver_s",
                                                               "proposals_s", "total_s")}
    options = runs[0]["options"]
    md = "\n".join([
        f"Command: `python benchmarks/deciding.py {' '.join(argv or sys.argv[1:])}`", "",
        f"{args.layers} layers x {options:.0f} options each, 2 ranks at 1 Gbit/s (the model); "
        f"median of {args.reps} decisions (the first one included), one thread", "",
        "| part | ms |", "|---|---:|",
        f"| the planner's plan (simulated step, fusion thresholds) | {1e3 * med['model_s']:.1f} |",
        f"| auto's knapsack (fewest bytes within the budget) | {1e3 * med['solver_s']:.1f} |",
        f"| proposals (knapsack with the planner's exact tensors, each plan simulated) and "
        f"selection | {1e3 * med['proposals_s']:.1f} |",
        f"| **decision, in all** | **{1e3 * med['total_s']:.1f}** |",
        f"| the run's first decision (caches cold) | "
        f"{1e3 * runs[0]['total_s']:.1f} |", "",
        "Plans tried: " + ", ".join(runs[0]["tried"])])
    save(args.out, {"layers": args.layers, "options": options, "median": med, "runs": runs}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
