"""The deciding exchange against every other method, paired in one process.

Each rank holds one VGG-11 (benchmarks/training.py's, batch 8) per method: the deciding
exchanges (``Compression.auto(objective="time")``, with and without the model) and the
methods they must not lose to (DDP fp32/fp16/bf16/PowerSGD, cgx 8-bit, 4-bit, 4-bit +
factors). The deciding ones run until they keep a plan; then every method takes a turn in
each block of timed steps (one untimed step first: the switch; a barrier around each
turn; the order rotates from block to block), so that all of them see the same machine.
Separate runs of one plan minutes apart differ by up to ~15% on 2 shared cores, more than
the 3% the deciding exchange is allowed; paired blocks cancel that drift.

    .venv/bin/python benchmarks/decide_paired.py --rate 10gbit --blocks 12 \\
        --out docs/results/decide-paired-10gbit

Both ranks run in their own network namespace behind a ``tc tbf``-shaped link
(``benchmarks/netsim``; ``--rate none``: unshaped), as in training.py. Writes
``<out>.md`` and ``<out>.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.outputs import save  # noqa: E402
from benchmarks.training import TRIALS, timed_steps, torch_method  # noqa: E402

DECIDING = ["cgx-decide", "cgx-decide-sfb"]
OTHERS = ["ddp-fp32", "ddp-fp16", "ddp-bf16", "ddp-powersgd", "cgx-optimizer-8bit",
          "cgx-optimizer", "cgx-optimizer-sfb"]
# Steps a deciding exchange may take to keep a plan before the blocks start anyway (the
# report then says it did not decide).
DECIDE_CAP = 150


def _turn(step, steps: int) -> float:
    """One untimed step (the switch from another method), then ``steps`` timed: the slowest
    rank's seconds per step."""
    step()
    return timed_steps(step, steps)


def rank_main(deciding: list, others: list, blocks: int, steps: int, batch: int,
              trials: str) -> dict[str, Any]:
    """Build every method, let the deciding ones keep a plan, then time ``blocks`` blocks."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    methods = {m: torch_method(m, x, y, trials) for m in deciding + others}
    decided = {}
    for name in deciding:
        opt, n = methods[name].opt, 0
        while not opt.exchange_trials() and n < DECIDE_CAP:
            methods[name].step()
            n += 1
        decided[name] = n
    names = list(methods)
    times: dict[str, list] = {m: [] for m in names}
    for b in range(blocks):
        for name in names[b % len(names):] + names[:b % len(names)]:
            times[name].append(_turn(methods[name].step, steps))
    out = {"times_s": times, "decide_steps": decided}
    out["trials"] = {m: methods[m].opt.exchange_trials() for m in deciding}
    return out


def _ratios(res: dict, name: str, others: list) -> dict[str, list]:
    """Per block: ``name``'s step over each other method's, and over the block's fastest."""
    t = res["times_s"]
    per = {o: [a / b for a, b in zip(t[name], t[o])] for o in others}
    per["fastest other"] = [a / min(t[o][k] for o in others) for k, a in enumerate(t[name])]
    return per


def report(res: dict, args) -> list[str]:
    t = res["times_s"]
    others = [m for m in t if m not in res["decide_steps"]]
    lines = [f"Command: `python benchmarks/decide_paired.py {' '.join(args.argv)}`", "",
             f"VGG-11 (28.1 M parameters), batch {args.batch}/rank, 2 ranks x 1 thread on this "
             f"machine's 2 cores, link {args.rate}; every method in every block, {args.steps} "
             f"timed steps a turn, {args.blocks} blocks; trials: {args.trials}", "",
             "| method | s/step, median of blocks | blocks (min-max) |", "|---|---:|---:|"]
    for m, ts in t.items():
        lines.append(f"| {m} | {statistics.median(ts):.3f} | {min(ts):.3f}-{max(ts):.3f} |")
    fastest = min(others, key=lambda o: statistics.median(t[o]))
    for name, n in res["decide_steps"].items():
        rounds = res["trials"][name]
        kept = rounds[-1]["chosen"] if rounds else "nothing (not decided)"
        per = _ratios(res, name, others)
        lines += ["", f"**{name}** kept '{kept}' after {n} steps ({len(rounds)} round(s) of "
                  f"trials by the end). Its step over another method's, block by block:", "",
                  "| against | median | range |", "|---|---:|---:|"]
        for o in [fastest, "fastest other"] + [o for o in others if o != fastest]:
            r = per[o]
            label = f"{o} (fastest by median)" if o == fastest else o
            lines.append(f"| {label} | {statistics.median(r):.3f}x | "
                         f"{min(r):.3f}-{max(r):.3f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="none", help="tc rate of each link ('none': unshaped)")
    p.add_argument("--deciding", default=",".join(DECIDING))
    p.add_argument("--others", default=",".join(OTHERS))
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--steps", type=int, default=5, help="timed steps per turn")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--trials", choices=sorted(TRIALS), default="default",
                   help="the deciding exchanges' settings (as benchmarks/training.py)")
    p.add_argument("--out", default="benchmarks/results/decide-paired")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    deciding = [m for m in args.deciding.split(",") if m]
    others = [m for m in args.others.split(",") if m]
    if not deciding or not others or args.blocks < 1 or args.steps < 1:
        p.error("need a deciding method, another method, --blocks >= 1 and --steps >= 1")
    from benchmarks.netsim import NetnsUnavailable, SlowNetwork

    rate = None if args.rate.lower() == "none" else args.rate
    kwargs = {"deciding": deciding, "others": others, "blocks": args.blocks,
              "steps": args.steps, "batch": args.batch, "trials": args.trials}
    try:
        with SlowNetwork(n_ranks=2, rate=rate) as net:
            res = net.run_function("benchmarks.decide_paired:rank_main", kwargs,
                                   timeout=3600)[0]
    except NetnsUnavailable as exc:
        print(f"cannot build the simulated network: {exc}", file=sys.stderr)
        return 2
    md = "\n".join(report(res, args))
    save(args.out, {"rate": args.rate, **kwargs, **res}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
