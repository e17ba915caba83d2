"""DiLoCo and BatchNorm: where the CNN's validation loss jumps after each outer step.

Trains the digits CNN (``benchmarks/timetoacc`` workload, BatchNorm after every
convolution) with ``hvd.DiLoCo(sync_every=50)`` and its default outer optimizer on the
ranks it is launched with; every 10 steps rank 0 evaluates the model two ways:

* ``running``: as it is (each BatchNorm's running statistics, the rank's own, estimated
  at the parameters before the outer step moved them);
* ``recalibrated``: a copy whose statistics are re-estimated from 20 training batches
  (what ``torch.optim.swa_utils.update_bn`` does for averaged weights).

Training itself never reads the running statistics (batch statistics in train mode),
so both views watch the same parameters. (Moving the statistics by the outer step as
the parameters are, averaged and extrapolated by the same Nesterov rule, was tried and is
far worse: the extrapolated variances fall to zero, losses in the hundreds at syncs.)

    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 \\
        benchmarks/diloco_batchnorm.py --seed 0
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.timetoacc.workloads import make  # noqa: E402

H = 50  # sync_every; the outer optimizer is DiLoCo's default (Nesterov, lr 0.7, momentum 0.9)


def recalibrated(model, batches):
    """A copy of ``model`` whose BatchNorm statistics are the average over ``batches``."""
    m = copy.deepcopy(model)
    torch.optim.swa_utils.update_bn(batches, m)
    return m


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    import cgx.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    rank = hvd.rank()
    rows = {}
    wl = make("cnn", rank, hvd.size(), seed=args.seed)
    model = wl.model
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DiLoCo(model, wl.optimizer(model.parameters()), sync_every=H)
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        wl.loss_fn(model, wl.train_batch(step - 1)).backward()
        opt.step()
        if step % 10 == 0 and rank == 0:
            batches = [wl.train_batch(s)[0] for s in range(step, step + 20)]
            rows[step] = {"running": wl.evaluate(model)["loss"],
                          "recalibrated": wl.evaluate(recalibrated(model, batches))["loss"]}
    if rank == 0:
        _report(rows, args)
    hvd.shutdown()
    return 0


def _report(rows, args) -> None:
    print(f"`.venv/bin/python -m torch.distributed.run --nproc_per_node 2 "
          f"benchmarks/diloco_batchnorm.py --seed {args.seed} --steps {args.steps}`\n")
    print("| step | running statistics | recalibrated (20 batches) |")
    print("|---:|---:|---:|")
    for step, r in sorted(rows.items()):
        mark = " (sync)" if step % H == 0 else ""
        print(f"| {step}{mark} | {r['running']:.3f} | {r['recalibrated']:.3f} |")
    for label, pick in (("at syncs", lambda s: s % H == 0),
                        ("between", lambda s: s % H != 0)):
        sel = [r for s, r in rows.items() if pick(s) and s > H // 2]
        if sel:
            print(f"\nmedian loss {label} (after step {H // 2}): " + ", ".join(
                f"{k} {statistics.median(r[k] for r in sel):.3f}"
                for k in ("running", "recalibrated")))


if __name__ == "__main__":
    sys.exit(main())
