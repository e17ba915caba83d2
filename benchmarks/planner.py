"""The planner in numbers: decision time, and quality against brute force.

1. Decision time for 300 tensors (all of different sizes, ready times spread over backward), 2 ranks
   at 1 Gbit/s, the default options and fusion thresholds: median of repeated plans.
2. Quality: on random small instances (2-5 tensors, 2-8 ranks, 1-25 Gbit/s), the planned
   step against the best of every combination of options (same fusion groups).

    .venv/bin/python benchmarks/planner.py [--instances 300] [--out docs/results/planner]

Prints both figures and, with ``--out``, writes them to ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time


def decision_time(n: int = 300, reps: int = 9) -> dict:
    from cgx.policy.planner import CostModel, TensorProfile, plan
    rng = random.Random(0)
    # every tensor a different size (log-uniform, 300 to 5 M values): the planner shares
    # options between tensors of one shape, which real models have many of; not here
    tensors = [TensorProfile(f"t{i}", int(10 ** rng.uniform(2.5, 6.7)), ready_s=0.3 * (n - i) / n,
                             shape=(1024, 1024) if i % 50 == 0 else None,
                             rows=32 if i % 50 == 0 else None) for i in range(n)]
    model = CostModel.uniform(2, 1.0)
    times, cpu = [], []
    for _ in range(reps):
        c0 = time.process_time()
        p = plan(tensors, model, backward_s=0.3)
        cpu.append(time.process_time() - c0)
        times.append(p.decision_s)
    return {"tensors": n, "median_ms": 1e3 * statistics.median(times),
            "median_cpu_ms": 1e3 * statistics.median(cpu), "groups": len(p.groups)}


def quality(instances: int) -> dict:
    sys.path.insert(0, "tests/planner")
    from test_planner import _instance

    from cgx.policy.planner import plan, simulate
    rng = random.Random(1)
    ratios = []
    for _ in range(instances):
        m, tensors, backward = _instance(rng)
        p = plan(tensors, m, backward, fusion_mb=(rng.choice([1.0, 16.0, 1e6]),))
        best = min(simulate(tensors, list(c), p.groups, m, backward).step_s
                   for c in itertools.product(*p.options))
        ratios.append(p.step_s / best)
    return {"instances": instances, "optimal": sum(r < 1 + 1e-9 for r in ratios),
            "mean": statistics.mean(ratios), "worst": max(ratios)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=300)
    p.add_argument("--out", help="also write <out>.json and <out>.md")
    args = p.parse_args(argv)
    d = decision_time()
    q = quality(args.instances)
    lines = [f"Decision time, {d['tensors']} tensors ({d['groups']} fusion groups chosen): "
             f"{d['median_ms']:.1f} ms wall, {d['median_cpu_ms']:.1f} ms CPU (median of 9)",
             f"Against brute force, {q['instances']} random instances: optimal in "
             f"{q['optimal']}, mean {q['mean']:.4f}x, worst {q['worst']:.4f}x of the best step"]
    print("\n".join(lines))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"decision_time": d, "quality": q}, f, indent=1)
        load = os.getloadavg()[0]  # other work on the machine slows the decision time
        with open(args.out + ".md", "w") as f:
            f.write(f"Command: `.venv/bin/python benchmarks/planner.py --instances "
                    f"{args.instances} --out {os.path.relpath(args.out)}` (one process, "
                    f"{os.cpu_count()} cores, load average {load:.1f} at the end)\n\n"
                    + "\n\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
