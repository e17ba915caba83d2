"""The deciding exchange against the fixed exchange of the plan it keeps, paired.

Each rank holds two VGG-11 models (benchmarks/training.py's), one with fixed 4-bit, one
with ``Compression.auto(objective="time")`` (training.py's settings); the deciding one
runs until it keeps a plan, then the two take turns in blocks of timed steps (a barrier
around each block, which goes first alternating), so that both see the same machine.
Separate runs of one plan minutes apart differ by up to ~8% on 2 shared cores; this
says whether the deciding exchange itself costs anything once it has decided.

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 benchmarks/decide_paired.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.training import DECIDE, vgg11  # noqa: E402


def _trainer(hvd, comp, x, y):
    torch.manual_seed(0)
    model = vgg11()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt, step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per block")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import cgx.torch as hvd
    hvd.init()
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    _, fixed = _trainer(hvd, hvd.Compression.quantize(bits=4), x, y)
    deciding, decide = _trainer(hvd, hvd.Compression.auto(**DECIDE), x, y)
    steps = 0
    while not deciding.exchange_trials():
        decide()
        steps += 1
    times = {"fixed 4-bit": [], "deciding": []}
    runs = {"fixed 4-bit": fixed, "deciding": decide}
    for block in range(args.blocks):
        for name in list(runs)[::1 if block % 2 == 0 else -1]:
            runs[name]()  # the switch's step, not timed
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runs[name]()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)
    if dist.get_rank() == 0:
        kept = deciding.exchange_trials()[-1]["chosen"]
        print(f"deciding kept '{kept}' after {steps} steps\n")
        print("| exchange | s/step per block | median |\n|---|---|---:|")
        for name, ts in times.items():
            print(f"| {name} | {' '.join(f'{t:.3f}' for t in ts)} | {statistics.median(ts):.3f} |")
        ratios = [d / f for f, d in zip(times["fixed 4-bit"], times["deciding"])]
        print(f"\ndeciding / fixed per block: {' '.join(f'{r:.3f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.3f})")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
