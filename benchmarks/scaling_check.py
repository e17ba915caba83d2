"""The step simulator against measured steps: VGG-11 over netsim links, predicted vs measured.

For each link rate and rank count, in the simulated network:

1. measure the link (``cgx.policy.planner.calibration.link_model``: alpha-beta per collective,
   the slowest rank's) and the compute-only step of every rank running at once (on 2
   cores, 4 ranks compete for the CPU: the profile is scaled to that step);
2. predict the step of DDP fp32 (every tensor exact, 25 MB buckets) and of cgx's uniform
   4-bit exchange (the default rules, 64 MB buckets) from the traced backward profile,
   the measured link and the measured quantizer;
3. measure both steps (benchmarks/training.py's rank function) and print the two side by
   side with the error.

    .venv/bin/python benchmarks/scaling_check.py [--rates 1gbit,10gbit,none] [--ranks 2,4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.outputs import save  # noqa: E402


def link_probe() -> dict:
    """In every rank: cgx's link model of this world's transport."""
    import cgx.torch as hvd
    from cgx import runtime
    from cgx.policy.planner.calibration import link_model
    hvd.init()
    links = link_model(runtime.transport(), sizes=(1 << 12, 1 << 24), reps=3)
    return {k.value: [ab.alpha, ab.beta, ab.cpu] for k, ab in links.items()}


def local_profile(batch: int):
    """VGG-11's backward, traced in this process (one thread)."""
    import torch

    from benchmarks.training import vgg11
    from cgx.policy.planner.calibration import trace_backward
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = vgg11()
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    import time
    fwd = []

    def step():
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        fwd.append(time.perf_counter() - t0)
        return loss

    tensors, backward, tail = trace_backward(model, step, opt, steps=4)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    return tensors, shapes, statistics.median(fwd[1:]), backward, tail


def predict(tensors, shapes, forward, backward, tail, links, world, measured_compute,
            model_cpu=True):
    """Predicted s/step of DDP fp32 and of cgx's uniform 4-bit exchange; ``model_cpu``:
    with the exchange's CPU work taken from the compute where the cores are shared."""
    from dataclasses import replace

    from cgx.config import Config
    from cgx.policy.planner import AlphaBeta, Collective, CostModel, options_for, simulate
    from cgx.policy.planner.calibration import compressor_throughput, contention
    from cgx.policy.planner.strategy import fusion_groups
    from cgx.rules import LayerRules
    scale = measured_compute / (forward + backward + tail)  # CPU shared by the ranks
    tensors = [replace(t, ready_s=t.ready_s * scale) for t in tensors]
    forward, backward, tail = forward * scale, backward * scale, tail * scale
    tp = compressor_throughput()
    cost = CostModel(world, {Collective(k): AlphaBeta(*v) for k, v in links.items()},
                     compress_bps=tp["compress_bps"] / scale, decompress_bps=tp["decompress_bps"] / scale,
                     cast_bps=tp["cast_bps"] / scale,
                     contention=contention(world, threads=1) if model_cpu else 0.0)
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].ready_s)
    rules = LayerRules.from_config(Config(), None)

    def step_with(opts, mb):
        return forward + simulate(tensors, opts, fusion_groups(tensors, order, mb * 1e6), cost,
                                  backward, tail).step_s

    ex = [options_for(t, cost, families=("exact",))[0] for t in tensors]
    q = [options_for(t, cost, families=("sra",))[1] if rules.spec_for(t.name, shape) is not None
         else e for t, shape, e in zip(tensors, shapes, ex)]
    return {"ddp-fp32": step_with(ex, 25.0), "cgx-optimizer": step_with(q, 64.0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1gbit,10gbit,none")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="docs/results/scaling-check")
    args = p.parse_args(argv)
    from benchmarks.netsim import SlowNetwork
    from cgx.console import progress
    tensors, shapes, forward, backward, tail = local_profile(args.batch)
    rows = []
    cases = [(r, int(n)) for n in args.ranks.split(",") for r in args.rates.split(",")]
    for rate, world in progress(cases, desc="links", unit="case"):
        with SlowNetwork(n_ranks=world, rate=None if rate == "none" else rate) as net:
            links = net.run_function("benchmarks.scaling_check:link_probe", {}, timeout=600)[0]
            measured = {}
            for method in ("compute", "ddp-fp32", "cgx-optimizer"):
                res = net.run_function("benchmarks.training:rank_main",
                                       {"method": method, "steps": args.steps, "warmup": 2,
                                        "batch": args.batch}, timeout=1800)[0]
                measured[method] = statistics.mean(res["times_s"])
        pred = predict(tensors, shapes, forward, backward, tail, links, world, measured["compute"])
        lanes = predict(tensors, shapes, forward, backward, tail, links, world,
                        measured["compute"], model_cpu=False)
        for method in ("ddp-fp32", "cgx-optimizer"):
            rows.append({"rate": rate, "ranks": world, "method": method,
                         "predicted_s": pred[method], "measured_s": measured[method],
                         "error": pred[method] / measured[method] - 1,
                         "predicted_no_cpu_s": lanes[method],
                         "error_no_cpu": lanes[method] / measured[method] - 1,
                         "compute_s": measured["compute"]})
    lines = [f"Command: `python benchmarks/scaling_check.py {' '.join(argv or sys.argv[1:])}`", "",
             f"VGG-11, batch {args.batch}/rank, one thread per rank on 2 cores (4 ranks share "
             "them: their compute step is measured with all ranks running). \"predicted\": "
             "the simulator with the exchange's CPU work (compression and the transport's, "
             "measured) taken from the compute, as the cores are shared; \"lanes only\": "
             "without it.", "",
             "| link | ranks | method | compute-only s | predicted s/step | measured s/step | error "
             "| lanes only s/step | error |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {r['ranks']} | {r['method']} | {r['compute_s']:.3f} | "
                     f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} | {100 * r['error']:+.0f}% | "
                     f"{r['predicted_no_cpu_s']:.3f} | {100 * r['error_no_cpu']:+.0f}% |")
    save(args.out, rows, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
